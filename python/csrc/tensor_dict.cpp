// Binding of tensordict::TensorDict as _C.TensorDict. The Python class tensordict_cpp.TensorDict
// wraps it and owns the Python conventions (kwargs, torch.Size, index forms, docstrings); this
// layer converts keys, values and indices and calls the core.

#include <ATen/TensorIndexing.h>
#include <torch/csrc/autograd/python_variable.h>
// After Python.h (python_variable.h): PyMemberDef, the layout of a __slots__ member.
#include <structmember.h>

#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "bindings.h"
#include "core/json_text.h"
#include "tensordict/consolidate.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/sub_tensor_dict.h"

namespace tensordict::python {
namespace {

// tensordict_cpp.errors.InvalidKeyError: a KeyError, as the reference raises, and a TypeError.
[[noreturn]] void invalid_key(py::handle key) {
  static const py::handle kind =
      py::object(py::module_::import("tensordict_cpp.errors").attr("InvalidKeyError")).release();
  const std::string text = c10::str("a key must be a str or a tuple of str (not empty), got ",
                                    py::repr(key).cast<std::string>(), " (",
                                    py::str(py::type::of(key)).cast<std::string>(), ")");
  PyErr_SetString(kind.ptr(), text.c_str());
  throw py::error_already_set();
}

void flatten_key(py::handle key, py::handle whole, std::vector<std::string>& parts) {
  if (py::isinstance<py::str>(key)) {
    parts.push_back(key.cast<std::string>());
  } else if (py::isinstance<py::tuple>(key) && py::len(key) > 0) {
    for (py::handle part : key) {
      flatten_key(part, whole, parts);
    }
  } else {
    invalid_key(whole);
  }
}

at::indexing::TensorIndex index_from_py(py::handle item) {
  using namespace at::indexing;
  if (item.is_none()) {
    return TensorIndex(None);
  }
  if (item.ptr() == Py_Ellipsis) {
    return TensorIndex(Ellipsis);
  }
  if (PyBool_Check(item.ptr())) {  // before int: bool is an int in Python
    return TensorIndex(item.cast<bool>());
  }
  if (PyLong_Check(item.ptr())) {
    return TensorIndex(item.cast<int64_t>());
  }
  if (PySlice_Check(item.ptr())) {
    auto* s = reinterpret_cast<PySliceObject*>(item.ptr());
    auto bound = [](PyObject* o) -> std::optional<c10::SymInt> {
      if (o == Py_None) return std::nullopt;
      return c10::SymInt(py::handle(o).cast<int64_t>());
    };
    return TensorIndex(Slice(bound(s->start), bound(s->stop), bound(s->step)));
  }
  if (THPVariable_Check(item.ptr())) {
    return TensorIndex(THPVariable_Unpack(item.ptr()));
  }
  C10_THROW_ERROR(TypeError, c10::str("unsupported index element of type ",
                                      py::str(py::type::of(item)).cast<std::string>()));
}

// torch's pybind11 caster cannot load a c10::Scalar.
at::Scalar scalar_from_py(py::handle v) {
  if (PyBool_Check(v.ptr())) return at::Scalar(v.cast<bool>());
  if (PyLong_Check(v.ptr())) return at::Scalar(v.cast<int64_t>());
  if (PyFloat_Check(v.ptr())) return at::Scalar(v.cast<double>());
  if (PyComplex_Check(v.ptr())) return at::Scalar(v.cast<c10::complex<double>>());
  C10_THROW_ERROR(
      TypeError, c10::str("expected a number, got ", py::str(py::type::of(v)).cast<std::string>()));
}

std::vector<int64_t> ints(py::handle seq) { return seq.cast<std::vector<int64_t>>(); }

// Deeper data than this is refused (the conversions recurse; Python's own limit is ~1000).
constexpr size_t kMaxJsonDepth = 512;

std::string py_type_name(py::handle v) { return py::str(py::type::of(v).attr("__name__")); }

// The conversions of one scope (one call, or a _C.json_scope() block: a rebuild from a pickle)
// share: a Python str (beyond the small-string buffer), list or dict used again is converted
// once and its value shared, so 256 entries holding one 8 MiB str hold it once, and a pickle's
// "billion laughs" (one list referenced 32 times, five levels deep) costs its distinct objects.
struct PyJsonScope {
  core::SharedJsonBuilder builder{{.max_depth = kMaxJsonDepth}, [] { return std::string(); }};
  std::vector<py::object> keep;  // the objects whose addresses key the builder, alive meanwhile
  // The way back: a node's Python object, the node kept so that its address is not reused.
  std::unordered_map<const void*, std::pair<JsonValue, py::object>> to_py;
  int open = 0;
};
thread_local PyJsonScope* g_json_scope = nullptr;

// Opens the thread's scope, or joins the one open.
class JsonScopeGuard {
 public:
  JsonScopeGuard() {
    if (g_json_scope == nullptr) {
      own_ = std::make_unique<PyJsonScope>();
      g_json_scope = own_.get();
    }
    ++g_json_scope->open;
  }
  ~JsonScopeGuard() {
    if (--g_json_scope->open == 0) g_json_scope = nullptr;
  }
  JsonScopeGuard(const JsonScopeGuard&) = delete;
  JsonScopeGuard& operator=(const JsonScopeGuard&) = delete;
  PyJsonScope& scope() { return *g_json_scope; }

 private:
  std::unique_ptr<PyJsonScope> own_;
};

// `where` is the position inside the data, for messages: "", "[2]", "['k'][0]", ...
JsonValue json_from_py(py::handle v, const NestedKey& key, const std::string& where, size_t depth,
                       PyJsonScope& scope) {
  const auto at = [&] { return where.empty() ? std::string() : " at " + where; };
  core::SharedJsonBuilder& b = scope.builder;
  b.enter(depth, "");
  if (v.is_none()) return JsonValue();
  if (PyBool_Check(v.ptr())) return JsonValue(v.ptr() == Py_True);
  if (PyLong_Check(v.ptr())) {
    int overflow = 0;
    const long long i = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    TORCH_CHECK_VALUE(
        overflow == 0, "the non-tensor value of key ", key.str(), at(),
        " holds an integer outside the int64 range: ", py::repr(v).cast<std::string>());
    return JsonValue(static_cast<int64_t>(i));
  }
  if (PyFloat_Check(v.ptr())) return JsonValue(PyFloat_AS_DOUBLE(v.ptr()));
  const bool shareable = PyUnicode_Check(v.ptr()) || PyList_Check(v.ptr()) || PyDict_Check(v.ptr());
  if (shareable) {
    if (const JsonValue* done = b.find(v.ptr())) return *done;
  }
  const auto keep = [&](JsonValue value) -> JsonValue {
    if (value.node() == nullptr) return value;  // a short str: a copy costs no more
    scope.keep.push_back(py::reinterpret_borrow<py::object>(v));
    return b.remember(v.ptr(), std::move(value));
  };
  if (PyUnicode_Check(v.ptr())) {
    Py_ssize_t n = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(v.ptr(), &n);
    if (utf8 == nullptr) {
      PyErr_Clear();  // a lone surrogate: no UTF-8 form
      TORCH_CHECK_VALUE(false, "the non-tensor value of key ", key.str(), at(),
                        " holds a string that cannot be encoded as UTF-8");
    }
    b.charge(core::SharedJsonBuilder::string_bytes(static_cast<size_t>(n)));
    return keep(JsonValue(std::string(utf8, static_cast<size_t>(n))));
  }
  if (PyList_Check(v.ptr())) {
    b.charge(core::kSharedNodeBytes);
    JsonValue::List items;
    const py::list list = py::reinterpret_borrow<py::list>(v);
    items.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      items.push_back(json_from_py(list[i], key, c10::str(where, "[", i, "]"), depth + 1, scope));
    }
    return keep(JsonValue(std::move(items)));
  }
  if (PyDict_Check(v.ptr())) {
    b.charge(core::kSharedNodeBytes);
    JsonValue::Map items;
    for (auto [k, item] : py::reinterpret_borrow<py::dict>(v)) {
      TORCH_CHECK_TYPE(PyUnicode_Check(k.ptr()), "the non-tensor value of key ", key.str(), at(),
                       " is a dict with a key of type ", py_type_name(k),
                       "; JSON-like data has str keys only");
      std::string name = k.cast<std::string>();
      b.charge(core::SharedJsonBuilder::key_bytes(name.size()) - sizeof(JsonValue));
      JsonValue value =
          json_from_py(item, key, c10::str(where, "[", quote_key(name), "]"), depth + 1, scope);
      items.emplace_back(std::move(name), std::move(value));
    }
    return keep(JsonValue(std::move(items)));
  }
  TORCH_CHECK_TYPE(false, "the non-tensor value of key ", key.str(), at(), " is of type ",
                   py_type_name(v),
                   "; non-tensor data must be JSON-like: str, int, float, bool, "
                   "None, or lists and dicts (with str keys) of them");
}

JsonValue json_from_py(py::handle v, const NestedKey& key, const std::string& where, int depth) {
  JsonScopeGuard guard;
  guard.scope().builder.set_what([key] { return "the non-tensor value of key " + key.str(); });
  return json_from_py(v, key, where, static_cast<size_t>(depth), guard.scope());
}

// A node reused within the value becomes one Python object reused, as the reference's data is
// (one unpickled object), so shared data never expands here.
using ToPyMemo = std::unordered_map<const void*, std::pair<JsonValue, py::object>>;

py::object json_to_py(const JsonValue& v, ToPyMemo& done) {
  if (v.is_null()) return py::none();
  if (v.is_bool()) return py::bool_(v.as_bool());
  if (v.is_int()) return py::int_(v.as_int());
  if (v.is_float()) return py::float_(v.as_float());
  if (v.node() != nullptr) {
    if (const auto it = done.find(v.node()); it != done.end()) return it->second.second;
  }
  py::object out;
  if (v.is_string()) {
    out = py::str(v.as_string());
  } else if (v.is_list()) {
    py::list list(v.as_list().size());
    size_t i = 0;
    for (const auto& item : v.as_list()) list[i++] = json_to_py(item, done);
    out = std::move(list);
  } else {
    py::dict dict;
    for (const auto& [k, item] : v.as_map()) dict[py::str(k)] = json_to_py(item, done);
    out = std::move(dict);
  }
  if (v.node() != nullptr) done.emplace(v.node(), std::make_pair(v, out));
  return out;
}

py::object json_to_py(const JsonValue& v) {
  // Within a scope (a pickling __reduce__), entries that share a node share its Python object.
  if (g_json_scope != nullptr) return json_to_py(v, g_json_scope->to_py);
  ToPyMemo done;
  return json_to_py(v, done);
}

py::list py_list(const std::vector<TensorDict>& tds) {
  py::list out;
  for (const auto& td : tds) out.append(py::cast(td));
  return out;
}

std::vector<at::indexing::TensorIndex> indices_from_py(const py::tuple& index) {
  std::vector<at::indexing::TensorIndex> idx;
  idx.reserve(index.size());
  for (py::handle item : index) idx.push_back(index_from_py(item));
  return idx;
}

std::vector<NestedKey> keys_from_py(const py::sequence& keys) {
  std::vector<NestedKey> out;
  out.reserve(keys.size());
  for (py::handle k : keys) out.push_back(key_from_py(k));
  return out;
}

// The reference's reduction keywords: dim (None, an int, a tuple, or "feature"), keepdim,
// dtype, correction.
ReductionOptions reduction_from_py(const py::object& dim, bool keepdim,
                                   std::optional<at::ScalarType> dtype, int64_t correction) {
  ReductionOptions o;
  if (py::isinstance<py::str>(dim)) {
    TORCH_CHECK_VALUE(dim.cast<std::string>() == "feature",
                      "dim must be an int, a tuple of "
                      "ints or 'feature', got ",
                      py::repr(dim).cast<std::string>());
    o.feature = true;
  } else if (PyLong_Check(dim.ptr())) {
    o.dims = {dim.cast<int64_t>()};
  } else if (!dim.is_none()) {
    o.dims = dim.cast<std::vector<int64_t>>();
  }
  o.keepdim = keepdim;
  o.dtype = dtype;
  o.correction = correction;
  return o;
}

// The reference's name of a reduction ("sum", ...) as reduce_all's Reduction.
Reduction reduction_op_from_py(const std::string& op) {
  if (op == "sum") return Reduction::kSum;
  if (op == "mean") return Reduction::kMean;
  if (op == "std") return Reduction::kStd;
  if (op == "max") return Reduction::kMax;
  TORCH_CHECK_VALUE(op == "min", "unknown reduction '", op, "'");
  return Reduction::kMin;
}

// A Python number or tensor as the `other` of an elementwise method, on TensorDict `td`.
template <typename OnTd, typename OnTensor, typename OnScalar>
TensorDict binary(py::handle other, OnTd&& on_td, OnTensor&& on_tensor, OnScalar&& on_scalar) {
  if (py::isinstance<TensorDict>(other)) return on_td(other.cast<TensorDict>());
  if (THPVariable_Check(other.ptr())) return on_tensor(THPVariable_Unpack(other.ptr()));
  return on_scalar(scalar_from_py(other));
}

}  // namespace

NestedKey key_from_py(py::handle key) {
  std::vector<std::string> parts;
  flatten_key(key, key, parts);
  return NestedKey(std::move(parts));
}

py::object key_to_py(const NestedKey& key) {
  if (!key.is_nested()) {
    return py::str(key.front());
  }
  return py::tuple(py::cast(key.parts()));
}

namespace {

// tensordict_cpp.UnbatchedTensor, which wraps an unbatched leaf for Python.
py::handle unbatched_class() {
  static py::handle cls =
      py::object(py::module_::import("tensordict_cpp._unbatched").attr("UnbatchedTensor"))
          .release();
  return cls;
}

}  // namespace

Value value_from_py(py::handle value) {
  if (THPVariable_Check(value.ptr())) {
    // Ours or the reference's UnbatchedTensor: both classes say _pass_through.
    if (py::getattr(py::type::of(value), "_pass_through", py::bool_(false)).cast<bool>()) {
      // The reference's is, on torch 2.14, a wrapper subclass whose own TensorImpl has no
      // storage: its values are _base_tensor() (a plain tensor over them, on any torch). Ours
      // holds its values itself.
      if (py::hasattr(value, "_base_tensor")) {
        const py::object base = value.attr("_base_tensor")();
        return Value::unbatched(THPVariable_Unpack(base.ptr()));
      }
      return Value::unbatched(THPVariable_Unpack(value.ptr()));
    }
    return Value(THPVariable_Unpack(value.ptr()));
  }
  if (py::isinstance<TensorDict>(value)) {
    return Value(value.cast<TensorDict>());
  }
  if (py::isinstance<NonTensorData>(value)) {
    return Value(value.cast<NonTensorData>());
  }
  C10_THROW_ERROR(TypeError, c10::str("a TensorDict holds tensors, TensorDicts and non-tensor "
                                      "entries, got ",
                                      py::str(py::type::of(value)).cast<std::string>()));
}

py::object value_to_py(const Value& value) {
  if (value.is_unbatched()) {
    return unbatched_class().attr("_wrap")(
        py::reinterpret_steal<py::object>(THPVariable_Wrap(value.tensor())));
  }
  if (value.is_tensor()) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(value.tensor()));
  }
  if (value.is_non_tensor()) return py::cast(value.non_tensor());
  return py::cast(value.tensordict());
}

JsonValue json_from_py(py::handle value, const NestedKey& key) {
  return json_from_py(value, key, "", 0);
}

namespace {

// td[key] for a str key naming a tensor or a nested TensorDict of the top level, as a raw
// CPython method: pybind11's dispatch (argument loaders, the overload walk, the key's
// std::string) and the Python wrapper's construction cost more than the lookup itself, and
// td[key] is the call that data code makes most. Every other case goes to the Python
// __getitem__ it replaces.
struct FastGetitem {
  Py_ssize_t cpp_offset;       // the `_cpp` slot's place in instances of the Python class
  PyTypeObject* cpp_type;      // _C.TensorDict
  PyTypeObject* wrapper_type;  // tensordict_cpp.TensorDict
  PyObject* fallback;          // the Python __getitem__
};
const FastGetitem* fast_getitem = nullptr;

const TensorDict* cpp_of(PyObject* self) {
  PyObject* cpp =
      *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) + fast_getitem->cpp_offset);
  if (cpp == nullptr || Py_TYPE(cpp) != fast_getitem->cpp_type) return nullptr;
  auto* inst = reinterpret_cast<py::detail::instance*>(cpp);
  if (!inst->simple_layout || !inst->simple_holder_constructed) return nullptr;
  return static_cast<const TensorDict*>(inst->simple_value_holder[0]);
}

PyObject* fast_getitem_call(PyObject* self, PyObject* index) {
  if (PyUnicode_CheckExact(index)) {
    if (const TensorDict* td = cpp_of(self)) {
      Py_ssize_t n = 0;
      const char* s = PyUnicode_AsUTF8AndSize(index, &n);
      if (s == nullptr) return nullptr;
      const Value* v = td->find(std::string_view(s, static_cast<size_t>(n)));
      if (v != nullptr && v->is_tensor() && !v->is_unbatched())
        return THPVariable_Wrap(v->tensor());
      if (v != nullptr && v->is_tensordict() && !v->tensordict().is_lazy_stack()) {
        // What TensorDict._wrap does: a new wrapper whose _cpp is the nested handle.
        py::object cpp;
        try {
          cpp = py::cast(v->tensordict());
        } catch (const std::exception&) {
          PyErr_Clear();
          return PyObject_Vectorcall(fast_getitem->fallback, std::array{self, index}.data(), 2,
                                     nullptr);
        }
        PyObject* out = fast_getitem->wrapper_type->tp_alloc(fast_getitem->wrapper_type, 0);
        if (out == nullptr) return nullptr;
        *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(out) + fast_getitem->cpp_offset) =
            cpp.release().ptr();
        return out;
      }
    }
  }
  PyObject* args[] = {self, index};
  return PyObject_Vectorcall(fast_getitem->fallback, args, 2, nullptr);
}

// Replaces cls.__getitem__ (a Python function) by the fast path, which falls back to it.
void install_fast_getitem(const py::type& cls) {
  TORCH_CHECK(fast_getitem == nullptr, "_install_getitem: already installed");
  py::object slot = cls.attr("__dict__")["_cpp"];
  TORCH_CHECK(Py_TYPE(slot.ptr()) == &PyMemberDescr_Type,
              "_install_getitem: ", py::str(cls).cast<std::string>(),
              "._cpp is not a __slots__ member");
  py::object fallback = cls.attr("__dict__")["__getitem__"];
  const Py_ssize_t offset = reinterpret_cast<PyMemberDescrObject*>(slot.ptr())->d_member->offset;
  // Both live as long as the class: never freed (the interpreter may use them at exit).
  py::object cpp_type = py::module_::import("tensordict_cpp._C").attr("TensorDict");
  fast_getitem = new FastGetitem{offset, reinterpret_cast<PyTypeObject*>(cpp_type.release().ptr()),
                                 reinterpret_cast<PyTypeObject*>(cls.inc_ref().ptr()),
                                 fallback.release().ptr()};
  py::object doc = py::getattr(py::handle(fast_getitem->fallback), "__doc__", py::none());
  static PyMethodDef def{"__getitem__", reinterpret_cast<PyCFunction>(&fast_getitem_call), METH_O,
                         nullptr};
  if (!doc.is_none()) def.ml_doc = strdup(doc.cast<std::string>().c_str());
  py::object descr = py::reinterpret_steal<py::object>(
      PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &def));
  if (!descr) throw py::error_already_set();
  py::setattr(cls, "__getitem__", descr);
}

}  // namespace

namespace {

using TD = TensorDict;

// The TensorDict's entries and state: construction, keys, get and set, locking, repr.
void bind_entries(py::class_<TD>& cls) {
  cls.def(py::init([](const py::list& entries, const py::object& batch_size,
                      std::optional<at::Device> device) {
            // str keys (the common case) take the flat constructor; a tuple key makes nested
            // levels through the NestedKey one.
            std::vector<TD::Entry> flat;
            flat.reserve(entries.size());
            for (py::handle e : entries) {
              auto pair = py::reinterpret_borrow<py::tuple>(e);
              if (!PyUnicode_Check(pair[0].ptr())) break;
              flat.emplace_back(pair[0].cast<std::string>(), value_from_py(pair[1]));
            }
            if (flat.size() == entries.size()) return TD(std::move(flat), ints(batch_size), device);
            std::vector<std::pair<NestedKey, Value>> es;
            es.reserve(entries.size());
            for (py::handle e : entries) {
              auto pair = e.cast<py::tuple>();
              es.emplace_back(key_from_py(pair[0]), value_from_py(pair[1]));
            }
            return TD(std::move(es), ints(batch_size), device);
          }),
          py::arg("entries"), py::arg("batch_size"), py::arg("device"))
      .def("is_same", &TD::is_same)
      .def_property_readonly("batch_size", [](const TD& td) { return td.batch_size().vec(); })
      .def("set_batch_size", [](TD& td, const py::object& bs) { td.set_batch_size(ints(bs)); })
      .def_property_readonly("batch_dims", &TD::batch_dims)
      .def("numel", &TD::numel)
      .def_property_readonly("device", &TD::device)
      .def("contains", [](const TD& td, py::handle key) { return td.contains(key_from_py(key)); })
      .def("get",
           [](const TD& td, py::handle key) { return value_to_py(td.get(key_from_py(key))); })
      .def("set", [](TD& td, py::handle key,
                     py::handle value) { td.set(key_from_py(key), value_from_py(value)); })
      .def("set_",
           [](TD& td, py::handle key, const at::Tensor& t) { td.set_(key_from_py(key), t); })
      .def("set_non_tensor",
           [](TD& td, py::handle key, py::handle value) {
             const NestedKey k = key_from_py(key);
             td.set_non_tensor(k, json_from_py(value, k, "", 0));
           })

      .def("erase", [](TD& td, py::handle key) { td.erase(key_from_py(key)); })
      .def("pop", [](TD& td, py::handle key) { return value_to_py(td.pop(key_from_py(key))); })
      .def(
          "keys",
          [](const TD& td, bool include_nested, bool leaves_only, const py::object& is_leaf) {
            KeysOptions options{include_nested, leaves_only};
            if (!is_leaf.is_none()) {  // called with the entry, as the Python layer wraps it
              options.is_leaf = [&](const Value& v) {
                return is_leaf(value_to_py(v)).cast<bool>();
              };
            }
            py::list out;
            for (const auto& k : td.keys(options)) out.append(key_to_py(k));
            return out;
          },
          py::arg("include_nested"), py::arg("leaves_only"), py::arg("is_leaf") = py::none())
      .def(
          "values",
          [](const TD& td, bool include_nested, bool leaves_only) {
            py::list out;
            for (const auto& v : td.values({include_nested, leaves_only}))
              out.append(value_to_py(v));
            return out;
          },
          py::arg("include_nested"), py::arg("leaves_only"))
      .def(
          "items",
          [](const TD& td, bool include_nested, bool leaves_only) {
            py::list out;
            // This level as it is: no key paths to build (a lazy stack's entries are its members).
            if (!include_nested && !leaves_only && !td.is_lazy_stack()) {
              for (const auto& [k, v] : td.entries()) {
                out.append(py::make_tuple(py::str(k), value_to_py(v)));
              }
              return out;
            }
            for (const auto& [k, v] : td.items({include_nested, leaves_only})) {
              out.append(py::make_tuple(key_to_py(k), value_to_py(v)));
            }
            return out;
          },
          py::arg("include_nested"), py::arg("leaves_only"))
      .def("sorted_keys", &TD::sorted_keys)
      .def("is_lazy_stack", &TD::is_lazy_stack)
      .def("has_lazy_stack",
           [](const TD& td) {  // whether any level is one (their leaves read as copies)
             const auto any = [](const auto& self, const TD& t) -> bool {
               if (t.is_lazy_stack()) return true;
               for (const auto& [k, v] : t.entries()) {
                 if (v.is_tensordict() && self(self, v.tensordict())) return true;
               }
               return false;
             };
             return any(any, td);
           })
      .def("tensordicts",
           [](const TD& td) { return py_list(LazyStackedTensorDict::of(td).tensordicts()); })
      .def_property_readonly("stack_dim",
                             [](const TD& td) { return LazyStackedTensorDict::of(td).stack_dim(); })
      .def_property_readonly(
          "stack_dim_name",
          [](const TD& td) { return LazyStackedTensorDict::of(td).stack_dim_name(); })
      .def("is_empty", &TD::is_empty)
      .def("is_locked", &TD::is_locked)
      .def("lock_", [](TD& td) { td.lock_(); })
      .def("unlock_", [](TD& td) { td.unlock_(); })
      .def(
          "repr",
          [](const TD& td, bool compact, const std::string& type_name,
             std::vector<std::string> hidden,
             std::vector<std::pair<std::string, std::string>> trailing,
             std::vector<std::pair<std::string, std::string>> nested_names) {
            return td.repr({.compact = compact,
                            .type_name = type_name,
                            .hidden = std::move(hidden),
                            .trailing = std::move(trailing),
                            .nested_names = std::move(nested_names)});
          },
          py::arg("compact") = true, py::arg("type_name") = "",
          py::arg("hidden") = std::vector<std::string>{},
          py::arg("trailing") = std::vector<std::pair<std::string, std::string>>{},
          py::arg("nested_names") = std::vector<std::pair<std::string, std::string>>{});
}

// The batch-shape operations (the core's tensor_dict_shape.cpp).
void bind_shape(py::class_<TD>& cls) {
  cls.def("index",
          [](const TD& td, const py::tuple& index) {
            std::vector<at::indexing::TensorIndex> idx;
            idx.reserve(index.size());
            for (py::handle item : index) idx.push_back(index_from_py(item));
            return td.index(idx);
          })
      .def("unbind", [](const TD& td, int64_t dim) { return py_list(td.unbind(dim)); })
      .def("reshape", [](const TD& td, const py::object& s) { return td.reshape(ints(s)); })
      .def("view", [](const TD& td, const py::object& s) { return td.view(ints(s)); })
      .def("expand", [](const TD& td, const py::object& s) { return td.expand(ints(s)); })
      .def("unsqueeze", &TD::unsqueeze)
      .def("squeeze", &TD::squeeze)
      .def("split",
           [](const TD& td, const py::object& sizes, int64_t dim) {
             if (PyLong_Check(sizes.ptr())) return py_list(td.split(sizes.cast<int64_t>(), dim));
             return py_list(td.split(at::IntArrayRef(ints(sizes)), dim));
           })
      .def("chunk", [](const TD& td, int64_t n, int64_t dim) { return py_list(td.chunk(n, dim)); })
      .def("flatten", &TD::flatten)
      .def("unflatten", [](const TD& td, int64_t dim,
                           const py::object& sizes) { return td.unflatten(dim, ints(sizes)); })
      .def("permute", [](const TD& td, const py::object& dims) { return td.permute(ints(dims)); })
      .def("transpose", &TD::transpose);
}

// The operations on every leaf (the core's tensor_dict_elementwise.cpp).
void bind_elementwise(py::class_<TD>& cls) {
  cls.def("clone", &TD::clone)
      .def("to_device", [](const TD& td, at::Device d) { return td.to(d); })
      .def("to_dtype", [](const TD& td, at::ScalarType t) { return td.to(t); })
      .def("contiguous", &TD::contiguous)
      // fn runs with the GIL held (it is Python); a None result leaves the leaf out.
      .def(
          "apply",
          [](const TD& td, const py::function& fn, std::optional<std::vector<int64_t>> batch_size) {
            return td.apply(
                [&](const at::Tensor& t) {
                  py::object r = fn(t);
                  return r.is_none() ? at::Tensor() : r.cast<at::Tensor>();
                },
                {.batch_size = std::move(batch_size)});
          },
          py::arg("fn"), py::arg("batch_size") = py::none())
      .def(
          "apply2",
          [](const TD& td, const py::function& fn, const TD& other,
             std::optional<std::vector<int64_t>> batch_size) {
            return td.apply(
                [&](const at::Tensor& a, const at::Tensor& b) {
                  py::object r = fn(a, b);
                  return r.is_none() ? at::Tensor() : r.cast<at::Tensor>();
                },
                other, {.batch_size = std::move(batch_size)});
          },
          py::arg("fn"), py::arg("other"), py::arg("batch_size") = py::none())
      .def("zero_", [](TD& td) { td.zero_(); })
      .def("fill_", [](TD& td, py::handle key,
                       py::handle v) { td.fill_(key_from_py(key), scalar_from_py(v)); })
      .def("apply_",
           [](TD& td, const py::function& fn) {
             td.apply_([&](const at::Tensor& t) {
               py::object r = fn(t);
               return r.is_none() ? at::Tensor() : r.cast<at::Tensor>();
             });
           })
      .def("named_apply",
           [](const TD& td, const py::function& fn, bool nested_keys) {
             return td.named_apply(
                 [&](const NestedKey& k, const at::Tensor& t) {
                   py::object r = fn(key_to_py(k), t);
                   return r.is_none() ? at::Tensor() : r.cast<at::Tensor>();
                 },
                 nested_keys);
           })
      .def("masked_fill", [](const TD& td, const at::Tensor& mask,
                             py::handle v) { return td.masked_fill(mask, scalar_from_py(v)); })
      .def("masked_fill_", [](TD& td, const at::Tensor& mask,
                              py::handle v) { td.masked_fill_(mask, scalar_from_py(v)); })
      .def("where",
           [](const TD& td, const at::Tensor& cond, py::handle other) {
             if (py::isinstance<TD>(other)) return td.where(cond, other.cast<TD>());
             return td.where(cond, scalar_from_py(other));
           })
      .def("detach", &TD::detach)
      .def("detach_", [](TD& td) { td.detach_(); })
      .def("abs", &TD::abs)
      .def("isfinite", &TD::isfinite)
      .def("add_",
           [](TD& td, py::handle other, py::handle alpha) {
             const at::Scalar a = alpha.is_none() ? at::Scalar(1) : scalar_from_py(alpha);
             binary(
                 other, [&](const TD& o) { return td.add_(o, a); },
                 [&](const at::Tensor& o) { return td.add_(o, a); },
                 [&](const at::Scalar& o) { return td.add_(o, a); });
           })
      .def("mul_",
           [](TD& td, py::handle other) {
             binary(
                 other, [&](const TD& o) { return td.mul_(o); },
                 [&](const at::Tensor& o) { return td.mul_(o); },
                 [&](const at::Scalar& o) { return td.mul_(o); });
           })
      .def("lerp_",
           [](TD& td, const TD& end, py::handle weight) {
             if (py::isinstance<TD>(weight)) {
               td.lerp_(end, weight.cast<TD>());
             } else {
               td.lerp_(end, scalar_from_py(weight));
             }
           })
      .def("arith",
           [](const TD& td, char op, py::handle other) {
             return binary(
                 other,
                 [&](const TD& o) {
                   return op == '+' ? td + o : op == '-' ? td - o : op == '*' ? td * o : td / o;
                 },
                 [&](const at::Tensor& o) {
                   return op == '+' ? td + o : op == '-' ? td - o : op == '*' ? td * o : td / o;
                 },
                 [&](const at::Scalar& o) {
                   return op == '+' ? td + o : op == '-' ? td - o : op == '*' ? td * o : td / o;
                 });
           })
      .def("pin_memory", &TD::pin_memory)
      .def("share_memory_", [](TD& td) { td.share_memory_(); })
      .def("is_shared", &TD::is_shared);
}

// Reductions and comparisons (the core's tensor_dict_reductions.cpp).
void bind_reductions(py::class_<TD>& cls) {
  cls.def("eq", [](const TD& a, const TD& b) { return a == b; })
      .def("ne", [](const TD& a, const TD& b) { return a != b; })
      .def("eq_scalar", [](const TD& a, py::handle b) { return a == scalar_from_py(b); })
      .def("ne_scalar", [](const TD& a, py::handle b) { return a != scalar_from_py(b); })
      .def("all", &TD::all)
      .def("any", &TD::any)
      .def("allclose", &TD::allclose)
      .def("reduction",
           [](const TD& td, const std::string& op, const py::object& dim, bool keepdim,
              std::optional<at::ScalarType> dtype, int64_t correction, bool reduce) -> py::object {
             const auto o = reduction_from_py(dim, keepdim, dtype, correction);
             const Reduction r = reduction_op_from_py(op);  // an unknown name is refused
             if (reduce) return py::cast(td.reduce_all(r, o));
             if (r == Reduction::kSum) return py::cast(td.sum(o));
             if (r == Reduction::kMean) return py::cast(td.mean(o));
             if (r == Reduction::kStd) return py::cast(td.std(o));
             auto [values, indices] = r == Reduction::kMax ? td.max(o) : td.min(o);
             if (!indices) return py::cast(values);
             return py::make_tuple(values, *indices);
           });
}

// Operations on the keys and levels (the core's tensor_dict_structure.cpp).
void bind_structure(py::class_<TD>& cls) {
  cls.def("update", [](TD& td, const TD& other, bool clone,
                       bool inplace) { td.update(other, {.clone = clone, .inplace = inplace}); })
      // ---- the reference's everyday methods (docs/api-coverage.md) ----
      .def("select",
           [](const TD& td, const py::sequence& keys, bool inplace, bool strict) {
             return td.select(keys_from_py(keys), {.inplace = inplace, .strict = strict});
           })
      .def("exclude", [](const TD& td, const py::sequence& keys,
                         bool inplace) { return td.exclude(keys_from_py(keys), inplace); })
      .def("flatten_keys", &TD::flatten_keys)
      .def("unflatten_keys", &TD::unflatten_keys)
      .def("rename_key_", [](TD& td, py::handle a, py::handle b,
                             bool safe) { td.rename_key_(key_from_py(a), key_from_py(b), safe); })
      .def("update_",
           [](TD& td, const TD& other, const py::object& keys) {
             td.update_(other, keys.is_none() ? std::vector<NestedKey>{} : keys_from_py(keys));
           })
      .def("set_at_",
           [](TD& td, py::handle key, const at::Tensor& v, const py::tuple& index) {
             td.set_at_(key_from_py(key), v, indices_from_py(index));
           })
      .def("get_at",
           [](const TD& td, py::handle key, const py::tuple& index) {
             return td.get_at(key_from_py(key), indices_from_py(index));
           })
      .def("filter_non_tensor_data", &TD::filter_non_tensor_data)
      .def("empty", &TD::empty)
      .def("copy", &TD::copy)
      .def("copy_", [](TD& td, const TD& src) { td.copy_(src); });
}

// The consolidated storage and its metadata.
void bind_consolidation(py::class_<TD>& cls) {
  cls.def(
         "consolidate",
         [](const TD& td, std::optional<at::Device> device, bool pin_memory, bool share_memory,
            int num_threads, std::optional<std::string> filename) {
           py::gil_scoped_release nogil;  // copies every leaf
           return consolidate(td, {.device = device,
                                   .pin_memory = pin_memory,
                                   .share_memory = share_memory,
                                   .num_threads = num_threads,
                                   .filename = std::move(filename)});
         },
         py::arg("device"), py::arg("pin_memory"), py::arg("share_memory"), py::arg("num_threads"),
         py::arg("filename") = py::none())
      .def("is_consolidated", [](const TD& td) { return is_consolidated(td); })
      .def("consolidated_storage", [](const TD& td) { return consolidated_storage(td); })
      // The metadata as the reference's json.dumps(td._consolidated["metadata"]) writes it.
      .def(
          "consolidated_metadata_json",
          [](const TD& td, bool sort_keys) {
            return metadata_to_json(*consolidated_metadata(td), sort_keys);
          },
          py::arg("sort_keys") = false);
}

void bind_non_tensor(py::module_& m) {
  // The core's non-tensor entry in its three kinds; tensordict_cpp.NonTensorData, MetaData and
  // NonTensorStack are the Python faces.
  py::class_<NonTensorData>(m, "NonTensorData")
      .def(py::init([](py::handle data, const py::object& batch_size,
                       std::optional<at::Device> device, py::handle key, bool metadata) {
             return NonTensorData(json_from_py(data, key_from_py(key), "", 0), ints(batch_size),
                                  device,
                                  metadata ? NonTensorKind::kMetaData : NonTensorKind::kData);
           }),
           py::arg("data"), py::arg("batch_size"), py::arg("device"), py::arg("key"),
           py::arg("metadata") = false)
      .def_static(
          "stack",
          [](std::vector<NonTensorData> members, int64_t stack_dim,
             std::optional<std::string> stack_dim_name) {
            return NonTensorData::stack(std::move(members), stack_dim, std::move(stack_dim_name));
          },
          py::arg("members"), py::arg("stack_dim"), py::arg("stack_dim_name"))
      .def_static(
          "from_list",
          [](py::handle values, std::optional<at::Device> device, py::handle key) {
            const NestedKey k = key_from_py(key);
            return NonTensorData::from_list(json_from_py(values, k, "", 0), device, std::nullopt,
                                            "the non-tensor value of key " + k.str());
          },
          py::arg("values"), py::arg("device"), py::arg("key"))
      .def_property_readonly("data", [](const NonTensorData& nt) { return json_to_py(nt.data()); })
      .def_property_readonly("class_name", &NonTensorData::class_name)
      .def_property_readonly("is_stack", &NonTensorData::is_stack)
      .def_property_readonly("is_metadata", &NonTensorData::is_metadata)
      .def_property_readonly("members", &NonTensorData::members)
      .def_property_readonly("stack_dim", &NonTensorData::stack_dim)
      .def_property_readonly("stack_dim_name", &NonTensorData::stack_dim_name)
      .def("tolist", [](const NonTensorData& nt) { return json_to_py(nt.tolist()); })
      .def("common_data",
           [](const NonTensorData& nt) -> py::object {
             auto d = nt.common_data();
             return d ? json_to_py(*d) : py::object(py::none());
           })
      .def("unbind", &NonTensorData::unbind, py::arg("dim"))
      .def("with_device", &NonTensorData::with_device, py::arg("device"))
      .def("repr", &NonTensorData::repr)
      .def("__eq__", [](const NonTensorData& a, const NonTensorData& b) { return a == b; })
      .def_property_readonly("batch_size",
                             [](const NonTensorData& nt) { return nt.batch_size().vec(); })
      .def_property_readonly("device", &NonTensorData::device);
}

void bind_sub_tensor_dict(py::module_& m) {
  // The reference's _SubTensorDict as a receiver: the parent's rows at `index`.
  py::class_<SubTensorDict>(m, "SubTensorDict")
      .def(py::init([](const TD& parent, const py::tuple& index) {
             return SubTensorDict(parent, indices_from_py(index));
           }),
           py::arg("parent"), py::arg("index"))
      .def_property_readonly("parent", &SubTensorDict::parent)
      .def_property_readonly("batch_size",
                             [](const SubTensorDict& s) { return s.batch_size().vec(); })
      .def_property_readonly("is_view", &SubTensorDict::is_view)
      .def("view", &SubTensorDict::view)
      .def("get", [](const SubTensorDict& s,
                     py::handle key) { return value_to_py(s.get(key_from_py(key))); })
      .def("set_", [](const SubTensorDict& s, py::handle key,
                      const at::Tensor& t) { s.set_(key_from_py(key), t); })
      .def("set", [](const SubTensorDict& s, py::handle key,
                     py::handle value) { s.set(key_from_py(key), value_from_py(value)); })
      .def("update_", &SubTensorDict::update_)
      .def("to_tensordict", &SubTensorDict::to_tensordict);
}

}  // namespace

void bind_tensor_dict(py::module_& m) {
  bind_non_tensor(m);

  // `with _C.json_scope():` makes the non-tensor conversions inside share what they convert
  // (PyJsonScope): the rebuild functions torch.load calls open one.
  struct JsonScopeBlock {
    std::unique_ptr<JsonScopeGuard> guard;
  };
  py::class_<JsonScopeBlock>(m, "_JsonScope")
      .def("__enter__", [](JsonScopeBlock& b) { b.guard = std::make_unique<JsonScopeGuard>(); })
      .def("__exit__", [](JsonScopeBlock& b, py::args) { b.guard.reset(); });
  m.def("json_scope", [] { return JsonScopeBlock{}; });
  m.def("_install_getitem", &install_fast_getitem, py::arg("cls"));
  py::class_<TD> cls(m, "TensorDict");
  bind_entries(cls);
  bind_shape(cls);
  bind_elementwise(cls);
  bind_reductions(cls);
  bind_structure(cls);
  bind_consolidation(cls);

  // Unpickling a consolidated TensorDict: the metadata is validated against the storage.
  m.def("rebuild_consolidated", [](const std::string& json, const at::Tensor& storage) {
    return rebuild(metadata_from_json(json), storage);
  });
  m.def("stack", [](const std::vector<TD>& tds, int64_t dim) { return stack(tds, dim); });
  m.def("maybe_dense_stack",
        [](const std::vector<TD>& tds, int64_t dim) { return maybe_dense_stack(tds, dim); });
  m.def(
      "from_consolidated",
      [](const std::string& filename) {
        py::gil_scoped_release nogil;
        return from_consolidated(filename);
      },
      py::arg("filename"));
  bind_sub_tensor_dict(m);
  m.def("cat", [](const std::vector<TD>& tds, int64_t dim) { return cat(tds, dim); });
  m.def("lazy_stack", [](const std::vector<TD>& tds, int64_t dim, std::optional<std::string> name) {
    return TD(LazyStackedTensorDict(tds, dim, std::move(name)));
  });
}

}  // namespace tensordict::python
