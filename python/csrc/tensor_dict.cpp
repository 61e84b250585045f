// Binding of tensordict::TensorDict as _C.TensorDict. The Python class tensordict_cpp.TensorDict
// wraps it and owns the Python conventions (kwargs, torch.Size, index forms, docstrings); this
// layer converts keys, values and indices and calls the core.

#include <ATen/TensorIndexing.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "tensordict/consolidate.h"

namespace tensordict::python {
namespace {

void flatten_key(py::handle key, std::vector<std::string>& parts) {
  if (py::isinstance<py::str>(key)) {
    parts.push_back(key.cast<std::string>());
  } else if (py::isinstance<py::tuple>(key)) {
    for (py::handle part : key) {
      flatten_key(part, parts);
    }
  } else {
    C10_THROW_ERROR(TypeError, c10::str("a key must be a str or a tuple of str, got ",
                                        py::str(py::type::of(key)).cast<std::string>()));
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
  C10_THROW_ERROR(TypeError, c10::str("expected a number, got ",
                                      py::str(py::type::of(v)).cast<std::string>()));
}

std::vector<int64_t> ints(py::handle seq) { return seq.cast<std::vector<int64_t>>(); }

py::list py_list(const std::vector<TensorDict>& tds) {
  py::list out;
  for (const auto& td : tds) out.append(py::cast(td));
  return out;
}

}  // namespace

NestedKey key_from_py(py::handle key) {
  std::vector<std::string> parts;
  flatten_key(key, parts);
  return NestedKey(std::move(parts));
}

py::object key_to_py(const NestedKey& key) {
  if (!key.is_nested()) {
    return py::str(key.front());
  }
  return py::tuple(py::cast(key.parts()));
}

Value value_from_py(py::handle value) {
  if (THPVariable_Check(value.ptr())) {
    return Value(THPVariable_Unpack(value.ptr()));
  }
  if (py::isinstance<TensorDict>(value)) {
    return Value(value.cast<TensorDict>());
  }
  C10_THROW_ERROR(TypeError, c10::str("a TensorDict holds tensors and TensorDicts, got ",
                                      py::str(py::type::of(value)).cast<std::string>()));
}

py::object value_to_py(const Value& value) {
  if (value.is_tensor()) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(value.tensor()));
  }
  return py::cast(value.tensordict());
}

void bind_tensor_dict(py::module_& m) {
  using TD = TensorDict;
  py::class_<TD>(m, "TensorDict")
      .def(py::init([](const py::list& entries, const py::object& batch_size,
                       std::optional<at::Device> device) {
             std::vector<TD::Entry> es;
             es.reserve(entries.size());
             for (py::handle e : entries) {
               auto pair = e.cast<py::tuple>();
               es.emplace_back(pair[0].cast<std::string>(), value_from_py(pair[1]));
             }
             return TD(std::move(es), ints(batch_size), device);
           }),
           py::arg("entries"), py::arg("batch_size"), py::arg("device"))
      .def("is_same", &TD::is_same)
      .def_property_readonly("batch_size", [](const TD& td) { return td.batch_size().vec(); })
      .def("set_batch_size",
           [](TD& td, const py::object& bs) { td.set_batch_size(ints(bs)); })
      .def_property_readonly("batch_dims", &TD::batch_dims)
      .def("numel", &TD::numel)
      .def_property_readonly("device", &TD::device)
      .def("contains", [](const TD& td, py::handle key) { return td.contains(key_from_py(key)); })
      .def("get", [](const TD& td, py::handle key) { return value_to_py(td.get(key_from_py(key))); })
      .def("set", [](TD& td, py::handle key, py::handle value) {
        td.set(key_from_py(key), value_from_py(value));
      })
      .def("set_", [](TD& td, py::handle key, const at::Tensor& t) { td.set_(key_from_py(key), t); })
      .def("erase", [](TD& td, py::handle key) { td.erase(key_from_py(key)); })
      .def("pop", [](TD& td, py::handle key) { return value_to_py(td.pop(key_from_py(key))); })
      .def("keys",
           [](const TD& td, bool include_nested, bool leaves_only) {
             py::list out;
             for (const auto& k : td.keys({include_nested, leaves_only})) out.append(key_to_py(k));
             return out;
           },
           py::arg("include_nested"), py::arg("leaves_only"))
      .def("values",
           [](const TD& td, bool include_nested, bool leaves_only) {
             py::list out;
             for (const auto& v : td.values({include_nested, leaves_only})) out.append(value_to_py(v));
             return out;
           },
           py::arg("include_nested"), py::arg("leaves_only"))
      .def("items",
           [](const TD& td, bool include_nested, bool leaves_only) {
             py::list out;
             for (const auto& [k, v] : td.items({include_nested, leaves_only})) {
               out.append(py::make_tuple(key_to_py(k), value_to_py(v)));
             }
             return out;
           },
           py::arg("include_nested"), py::arg("leaves_only"))
      .def("sorted_keys", &TD::sorted_keys)
      .def("is_empty", &TD::is_empty)
      .def("is_locked", &TD::is_locked)
      .def("lock_", [](TD& td) { td.lock_(); })
      .def("unlock_", [](TD& td) { td.unlock_(); })
      .def("index",
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
      .def("clone", &TD::clone)
      .def("to_device", [](const TD& td, at::Device d) { return td.to(d); })
      .def("to_dtype", [](const TD& td, at::ScalarType t) { return td.to(t); })
      .def("contiguous", &TD::contiguous)
      // fn runs with the GIL held (it is Python); a None result leaves the leaf out.
      .def("apply",
           [](const TD& td, const py::function& fn) {
             return td.apply([&](const at::Tensor& t) {
               py::object r = fn(t);
               return r.is_none() ? at::Tensor() : r.cast<at::Tensor>();
             });
           })
      .def("apply2",
           [](const TD& td, const py::function& fn, const TD& other) {
             return td.apply(
                 [&](const at::Tensor& a, const at::Tensor& b) {
                   py::object r = fn(a, b);
                   return r.is_none() ? at::Tensor() : r.cast<at::Tensor>();
                 },
                 other);
           })
      .def("update",
           [](TD& td, const TD& other, bool clone, bool inplace) {
             td.update(other, {.clone = clone, .inplace = inplace});
           })
      .def("zero_", [](TD& td) { td.zero_(); })
      .def("fill_", [](TD& td, py::handle key, py::handle v) {
        td.fill_(key_from_py(key), scalar_from_py(v));
      })
      .def("eq", [](const TD& a, const TD& b) { return a == b; })
      .def("ne", [](const TD& a, const TD& b) { return a != b; })
      .def("eq_scalar", [](const TD& a, py::handle b) { return a == scalar_from_py(b); })
      .def("ne_scalar", [](const TD& a, py::handle b) { return a != scalar_from_py(b); })
      .def("all", &TD::all)
      .def("any", &TD::any)
      .def("allclose", &TD::allclose)
      .def("repr", &TD::repr)
      .def("consolidate",
           [](const TD& td, std::optional<at::Device> device, bool pin_memory, bool share_memory,
              int num_threads) {
             py::gil_scoped_release nogil;  // copies every leaf
             return consolidate(td, {.device = device,
                                     .pin_memory = pin_memory,
                                     .share_memory = share_memory,
                                     .num_threads = num_threads});
           })
      .def("is_consolidated", [](const TD& td) { return is_consolidated(td); })
      .def("consolidated_storage", [](const TD& td) { return consolidated_storage(td); });

  m.def("stack", [](const std::vector<TD>& tds, int64_t dim) { return stack(tds, dim); });
  m.def("cat", [](const std::vector<TD>& tds, int64_t dim) { return cat(tds, dim); });
}

}  // namespace tensordict::python
