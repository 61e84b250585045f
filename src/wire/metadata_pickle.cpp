// Metadata <-> pickle. A peer's pickle becomes the JSON-like tree metadata_from_json reads, so
// that it gets exactly the same validation and bounds; ours is built from our JSON text. A
// node's "cls" may be a class reference (the reference's tensorclass nodes): the node is read
// as a TensorDict node and Metadata::cls records "module.qualname"; a class reference anywhere
// else is a ValueError. We never write class references (metadata_to_json writes "TensorDict").

#include "tensordict/metadata_pickle.h"

#include "json_text.h"
#include "metadata_value.h"

namespace tensordict {
namespace {

using pickle::Value;

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

// A peer's unpickled values as JSON-like values: tuples become lists, as JSON makes them. A
// class reference is refused here: only a node's "cls" (node_to_json) may hold one.
JsonValue to_json(const Value& v, Path& path) {
  switch (v.kind()) {
    case Value::Kind::ClassRef:
      TORCH_CHECK_VALUE(false, "metadata: the class reference ", class_name(v), " at ",
                        where(path), " is refused: only a node's \"cls\" may name a class");
    case Value::Kind::None: return JsonValue();
    case Value::Kind::Bool: return JsonValue(v.as_bool());
    case Value::Kind::Int: return JsonValue(v.as_int());
    case Value::Kind::Float: return JsonValue(v.as_float());
    case Value::Kind::Str: return JsonValue(v.as_str());
    case Value::Kind::List:
    case Value::Kind::Tuple: {
      JsonValue::List out;
      out.reserve(v.items().size());
      for (size_t i = 0; i < v.items().size(); ++i) {
        path.push_back({nullptr, i});
        out.push_back(to_json(v.items()[i], path));
        path.pop_back();
      }
      return JsonValue(std::move(out));
    }
    case Value::Kind::Dict: {
      JsonValue::Map out;
      out.reserve(v.keys().size());
      for (size_t i = 0; i < v.keys().size(); ++i) {
        path.push_back({&v.keys()[i], 0});
        out.emplace_back(v.keys()[i], to_json(v.values()[i], path));
        path.pop_back();
      }
      return JsonValue(std::move(out));
    }
  }
  TORCH_INTERNAL_ASSERT(false);
}

// A node of a peer's dict (the root or a nested one, as the metadata reader sees them: any dict
// that is not "non_tensors", "leaves" or "cls_metadata"). A class reference as its "cls" (the
// reference's tensorclass nodes) reads as "TensorDict"; set_class_names records it afterwards.
JsonValue node_to_json(const Value& node, Path& path) {
  JsonValue::Map out;
  out.reserve(node.keys().size());
  for (size_t i = 0; i < node.keys().size(); ++i) {
    const std::string& key = node.keys()[i];
    const Value& v = node.values()[i];
    path.push_back({&key, 0});
    if (key == "cls" && v.kind() == Value::Kind::ClassRef) {
      out.emplace_back(key, JsonValue(std::string("TensorDict")));
    } else if (v.kind() == Value::Kind::Dict && key != "non_tensors" && key != "leaves" &&
               key != "cls_metadata") {
      out.emplace_back(key, node_to_json(v, path));
    } else {
      out.emplace_back(key, to_json(v, path));
    }
    path.pop_back();
  }
  return JsonValue(std::move(out));
}

// Metadata::cls = "module.qualname" for each node whose "cls" is a class reference.
void set_class_names(const Value& node, Metadata& m) {
  if (const Value* cls = node.find("cls"); cls && cls->kind() == Value::Kind::ClassRef) {
    m.cls = class_name(*cls);
  }
  for (auto& [key, child] : m.children) {
    const Value* sub = node.find(key);
    TORCH_INTERNAL_ASSERT(sub && sub->kind() == Value::Kind::Dict);
    set_class_names(*sub, child);
  }
}

Value from_json(const JsonValue& j) {
  if (j.is_null()) return Value();
  if (j.is_bool()) return Value::from_bool(j.as_bool());
  if (j.is_int()) return Value::from_int(j.as_int());
  if (j.is_float()) return Value::from_float(j.as_float());
  if (j.is_string()) return Value::from_str(j.as_string());
  if (j.is_list()) {
    std::vector<Value> items;
    items.reserve(j.as_list().size());
    for (const auto& e : j.as_list()) items.push_back(from_json(e));
    return Value::list(std::move(items));
  }
  Value d = Value::dict();
  for (const auto& [k, e] : j.as_map()) d.set(k, from_json(e));
  return d;
}

// A metadata node: its "leaves" and "non_tensors" entries are tuples in the reference's dict;
// a non-tensor's data is the plain Python value (dicts, lists, str, ...).
Value node_from_json(const JsonValue& node) {
  Value d = Value::dict();
  for (const auto& [key, value] : node.as_map()) {
    if (key == "leaves" || key == "non_tensors") {
      Value entries = Value::dict();
      for (const auto& [name, entry] : value.as_map()) {
        entries.set(name, Value::tuple(from_json(entry).items()));
      }
      d.set(key, std::move(entries));
    } else if (value.is_map() && key != "cls_metadata") {
      d.set(key, node_from_json(value));
    } else {
      d.set(key, from_json(value));
    }
  }
  return d;
}

}  // namespace

pickle::Value metadata_to_pickle(const Metadata& metadata, const TransportFields& transport) {
  // Our own text: bounded only by what the TensorDict holds.
  const detail::JsonLimits limits{.max_depth = 1 << 16};
  return node_from_json(
      detail::parse_json(metadata_to_json(metadata, false, transport), limits, "metadata"));
}

Metadata metadata_from_pickle(const pickle::Value& value, TransportFields* transport) {
  TORCH_CHECK_VALUE(value.kind() == pickle::Value::Kind::Dict, "metadata: expected a dict, got a ",
                    pickle::Value::kind_name(value.kind()));
  Path path;
  Metadata m = detail::metadata_from_value(node_to_json(value, path), transport);
  set_class_names(value, m);
  return m;
}

pickle::Limits metadata_pickle_limits() {
  // The bounds of metadata_from_json, counted on the pickle's containers and values.
  return {.max_depth = detail::kMaxMetadataJsonDepth,
          .max_elements = detail::kMaxMetadataJsonValues};
}

Metadata metadata_from_pickle_bytes(std::string_view bytes, TransportFields* transport) {
  return metadata_from_pickle(pickle::loads(bytes, metadata_pickle_limits()), transport);
}

}  // namespace tensordict
