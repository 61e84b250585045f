// Metadata <-> pickle (docs/wire-format.md §4.2, §4.4). Written straight from Metadata, opcode by
// opcode, the bytes Python's pickler writes for the reference's dict. Read through the restricted
// reader, then by the reader metadata_from_json uses (metadata_reader.h), so that a peer's pickle
// gets the same errors and bounds, and validated once. A node's "cls" may be a class reference
// (the reference's tensorclass nodes): the node is read as a TensorDict node and Metadata::cls
// records "module.qualname"; a class reference anywhere else is a ValueError. We never write
// class references (a node with one is written as "TensorDict").

#include "wire/metadata_pickle.h"

#include "metadata_reader.h"
#include "tensordict/dtypes.h"
#include "wire/json_text.h"
#include "wire/metadata.h"

namespace tensordict {
namespace {

using pickle::Value;

// ---- writer -----------------------------------------------------------------------------------

// Strings leave as Python str, so they must be UTF-8 (Python's pickle would refuse them too).
void write_str(pickle::Writer& w, std::string_view s) {
  TORCH_CHECK_VALUE(wire::valid_utf8(s), "metadata_to_pickle: the string ", quote_key(s),
                    " is not valid UTF-8");
  w.str(s);
}

void write_ints(pickle::Writer& w, const std::vector<int64_t>& v) {
  w.list_open(v.size());
  for (int64_t d : v) w.integer(d);
  w.list_close(v.size());
}

void write_optional(pickle::Writer& w, const std::optional<std::string>& s) {
  if (s) {
    write_str(w, *s);
  } else {
    w.none();
  }
}

// A non-tensor entry's data: the Python value json.loads would give (lists, str-keyed dicts).
void write_json(pickle::Writer& w, const JsonValue& j) {
  if (j.is_null()) {
    w.none();
  } else if (j.is_bool()) {
    w.boolean(j.as_bool());
  } else if (j.is_int()) {
    w.integer(j.as_int());
  } else if (j.is_float()) {
    w.floating(j.as_float());
  } else if (j.is_string()) {
    write_str(w, j.as_string());
  } else if (j.is_list()) {
    w.list_open(j.as_list().size());
    for (const auto& e : j.as_list()) write_json(w, e);
    w.list_close(j.as_list().size());
  } else {
    w.dict_open(j.as_map().size());
    for (const auto& [k, e] : j.as_map()) {
      write_str(w, k);
      write_json(w, e);
    }
    w.dict_close(j.as_map().size());
  }
}

// One node as the reference's dict: cls, non_tensors, leaves, cls_metadata, then the nested
// nodes, then (at the root) the transport fields: metadata_to_json's order.
void write_node(pickle::Writer& w, const Metadata& m, const TransportFields* transport) {
  const size_t n = 4 + m.children.size() + (transport ? transport->size() : 0);
  w.dict_open(n);
  w.str("cls");
  write_str(w, wire::is_class_reference_name(m.cls) ? std::string_view("TensorDict")
                                                    : std::string_view(m.cls));
  w.str("non_tensors");
  w.dict_open(m.non_tensors.size());
  for (const auto& [key, nt] : m.non_tensors) {
    write_str(w, key);
    w.tuple_open(3);
    write_json(w, nt.data);
    write_ints(w, nt.batch_size);
    write_optional(w, nt.device);
    w.tuple_close(3);
  }
  w.dict_close(m.non_tensors.size());
  w.str("leaves");
  w.dict_open(m.leaves.size());
  for (const auto& [key, l] : m.leaves) {
    write_str(w, key);
    w.tuple_open(5);
    w.str(dtype_name(l.dtype));
    write_ints(w, l.shape);
    w.integer(l.start);
    w.integer(l.stop);
    w.integer(l.pad);
    w.tuple_close(5);
  }
  w.dict_close(m.leaves.size());
  w.str("cls_metadata");
  const auto& cm = m.cls_metadata;
  w.dict_open(4);
  w.str("device");
  write_optional(w, cm.device);
  w.str("names");
  w.list_open(cm.names.size());
  for (const auto& name : cm.names) write_optional(w, name);
  w.list_close(cm.names.size());
  w.str("batch_size");
  write_ints(w, cm.batch_size);
  w.str("is_locked");
  w.boolean(cm.is_locked);
  w.dict_close(4);
  for (const auto& [key, child] : m.children) {
    write_str(w, key);
    write_node(w, child, nullptr);
  }
  if (transport) {
    for (const auto& [key, value] : *transport) {
      write_str(w, key);
      std::visit(
          [&](const auto& v) {
            using T = std::decay_t<decltype(v)>;
            if constexpr (std::is_same_v<T, std::nullptr_t>) {
              w.none();
            } else if constexpr (std::is_same_v<T, bool>) {
              w.boolean(v);
            } else if constexpr (std::is_same_v<T, int64_t>) {
              w.integer(v);
            } else {
              write_str(w, v);
            }
          },
          value);
    }
  }
  w.dict_close(n);
}

// ---- reader -----------------------------------------------------------------------------------

// One step into a peer's dict: a key, or a list position when key is null. Rendered only for
// an error message, so that walking a large tree costs no string per value.
struct Step {
  const std::string* key;
  size_t index;
};
using Path = std::vector<Step>;

// Where a value sits in a peer's dict, as Python subscripts: ["inner"]["leaves"]["q"][0].
std::string where(const Path& path) {
  std::string out;
  for (const auto& [key, index] : path) {
    out += key ? c10::str("[\"", *key, "\"]") : c10::str("[", index, "]");
  }
  return out.empty() ? std::string("the top level") : out;
}

std::string class_name(const Value& ref) { return ref.ref_module() + "." + ref.ref_qualname(); }

// Refuses a class reference anywhere but a node's "cls", before anything is read: a node is the
// root or a dict under a node key other than "non_tensors", "leaves" and "cls_metadata".
void refuse_class_refs(const Value& v, Path& path, bool is_node) {
  switch (v.kind()) {
    case Value::Kind::ClassRef:
      TORCH_CHECK_VALUE(false, "metadata: the class reference ", class_name(v), " at ",
                        where(path), " is refused: only a node's \"cls\" may name a class");
    case Value::Kind::List:
    case Value::Kind::Tuple:
      for (size_t i = 0; i < v.items().size(); ++i) {
        path.push_back({nullptr, i});
        refuse_class_refs(v.items()[i], path, false);
        path.pop_back();
      }
      return;
    case Value::Kind::Dict:
      for (size_t i = 0; i < v.keys().size(); ++i) {
        const std::string& key = v.keys()[i];
        const Value& e = v.values()[i];
        if (is_node && key == "cls" && e.kind() == Value::Kind::ClassRef) continue;
        path.push_back({&key, 0});
        refuse_class_refs(e, path,
                          is_node && e.kind() == Value::Kind::Dict && key != "non_tensors" &&
                              key != "leaves" && key != "cls_metadata");
        path.pop_back();
      }
      return;
    default: return;
  }
}

// A peer's unpickled values as JSON-like values (a non-tensor entry's data, and messages):
// tuples become lists, as JSON makes them. refuse_class_refs has run: none is left here.
JsonValue to_json(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::None: return JsonValue();
    case Value::Kind::Bool: return JsonValue(v.as_bool());
    case Value::Kind::Int: return JsonValue(v.as_int());
    case Value::Kind::Float: return JsonValue(v.as_float());
    case Value::Kind::Str: return JsonValue(v.as_str());
    case Value::Kind::List:
    case Value::Kind::Tuple: {
      JsonValue::List out;
      out.reserve(v.items().size());
      for (const auto& e : v.items()) out.push_back(to_json(e));
      return JsonValue(std::move(out));
    }
    case Value::Kind::Dict: {
      JsonValue::Map out;
      out.reserve(v.keys().size());
      for (size_t i = 0; i < v.keys().size(); ++i) {
        out.emplace_back(v.keys()[i], to_json(v.values()[i]));
      }
      return JsonValue(std::move(out));
    }
    case Value::Kind::ClassRef: return JsonValue(class_name(v));  // messages only
  }
  TORCH_INTERNAL_ASSERT(false);
}

// A dict's entries as (key, value) pairs, the way metadata_reader.h iterates a map.
class DictMembers {
 public:
  explicit DictMembers(const Value& d) : d_(d) {}
  class iterator {
   public:
    iterator(const Value& d, size_t i) : d_(d), i_(i) {}
    std::pair<const std::string&, const Value&> operator*() const {
      return {d_.keys()[i_], d_.values()[i_]};
    }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator!=(const iterator& o) const { return i_ != o.i_; }

   private:
    const Value& d_;
    size_t i_;
  };
  iterator begin() const { return {d_, 0}; }
  iterator end() const { return {d_, d_.keys().size()}; }

 private:
  const Value& d_;
};

// An unpickled tree as metadata_reader.h reads trees: tuples and lists alike are JSON arrays.
struct PickleTraits {
  using Value = pickle::Value;
  using Members = DictMembers;
  using Kind = Value::Kind;
  static bool is_null(const Value& v) { return v.kind() == Kind::None; }
  static bool is_bool(const Value& v) { return v.kind() == Kind::Bool; }
  static bool is_int(const Value& v) { return v.kind() == Kind::Int; }
  static bool is_number(const Value& v) { return is_int(v) || v.kind() == Kind::Float; }
  static bool is_string(const Value& v) { return v.kind() == Kind::Str; }
  static bool is_list(const Value& v) { return v.kind() == Kind::List || v.kind() == Kind::Tuple; }
  static bool is_map(const Value& v) { return v.kind() == Kind::Dict; }
  static bool is_class_ref(const Value& v) { return v.kind() == Kind::ClassRef; }
  static std::string class_name(const Value& v) { return ::tensordict::class_name(v); }
  static bool as_bool(const Value& v) { return v.as_bool(); }
  static int64_t as_int(const Value& v) { return v.as_int(); }
  static const std::string& as_string(const Value& v) { return v.as_str(); }
  static const std::vector<Value>& items(const Value& v) { return v.items(); }
  static Members members(const Value& v) { return DictMembers(v); }
  static JsonValue to_json(const Value& v) { return ::tensordict::to_json(v); }
  static std::string dump(const Value& v) { return to_json(v).dump(); }
};

wire::ValidatedMetadata read_validated(const pickle::Value& value) {
  TORCH_CHECK_VALUE(value.kind() == pickle::Value::Kind::Dict, "metadata: expected a dict, got a ",
                    pickle::Value::kind_name(value.kind()));
  Path path;
  refuse_class_refs(value, path, /*is_node=*/true);
  TransportFields transport;
  Metadata m = wire::reader::read_root<PickleTraits>(value, &transport);
  return wire::validated(std::move(m), std::move(transport));
}

}  // namespace

std::string metadata_pickle_bytes(const Metadata& metadata, const TransportFields& transport) {
  std::string out;
  out.reserve(256 + 64 * metadata.leaves.size());
  pickle::Writer w(out);
  write_node(w, metadata, &transport);
  w.finish();
  return out;
}

pickle::Value metadata_to_pickle(const Metadata& metadata, const TransportFields& transport) {
  // Our own bytes: bounded only by what the TensorDict holds.
  return pickle::loads(metadata_pickle_bytes(metadata, transport),
                       {.max_depth = size_t{1} << 16, .max_elements = SIZE_MAX,
                        .max_bytes = SIZE_MAX});
}

Metadata metadata_from_pickle(const pickle::Value& value, TransportFields* transport) {
  wire::ValidatedMetadata v = read_validated(value);
  if (transport) *transport = v.transport();
  return std::move(v.metadata());
}

pickle::Limits metadata_pickle_limits() {
  // The bounds of metadata_from_json, counted on the pickle's containers and values.
  return {.max_depth = wire::kMaxMetadataJsonDepth, .max_elements = wire::kMaxMetadataJsonValues};
}

Metadata metadata_from_pickle_bytes(std::string_view bytes, TransportFields* transport) {
  return metadata_from_pickle(pickle::loads(bytes, metadata_pickle_limits()), transport);
}

namespace wire {

ValidatedMetadata read_metadata_pickle(std::string_view bytes) {
  return read_validated(pickle::loads(bytes, metadata_pickle_limits()));
}

}  // namespace wire

}  // namespace tensordict
