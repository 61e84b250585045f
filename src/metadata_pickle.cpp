// Metadata <-> pickle. A peer's pickle becomes the JSON-like tree metadata_from_json reads, so
// that it gets exactly the same validation and bounds; ours is built from our JSON text.

#include "tensordict/metadata_pickle.h"

#include "json_text.h"
#include "metadata_value.h"

namespace tensordict {
namespace {

using pickle::Value;

// A peer's unpickled values as JSON-like values: tuples become lists, as JSON makes them.
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
      for (const auto& item : v.items()) out.push_back(to_json(item));
      return JsonValue(std::move(out));
    }
    case Value::Kind::Dict: {
      JsonValue::Map out;
      out.reserve(v.keys().size());
      for (size_t i = 0; i < v.keys().size(); ++i) out.emplace_back(v.keys()[i], to_json(v.values()[i]));
      return JsonValue(std::move(out));
    }
  }
  TORCH_INTERNAL_ASSERT(false);
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
  return detail::metadata_from_value(to_json(value), transport);
}

Metadata metadata_from_pickle_bytes(std::string_view bytes, TransportFields* transport) {
  // The bounds of metadata_from_json, counted on the pickle's containers and values.
  const pickle::Limits limits{.max_depth = detail::kMaxMetadataJsonDepth,
                              .max_elements = detail::kMaxMetadataJsonValues};
  return metadata_from_pickle(pickle::loads(bytes, limits), transport);
}

}  // namespace tensordict
