// Metadata <-> pickle goes through the metadata's JSON form, so that a pickle from a peer gets
// exactly the parsing, validation and bounds of metadata_from_json.

#include "tensordict/metadata_pickle.h"

#include <nlohmann/json.hpp>

namespace tensordict {
namespace {

using Json = nlohmann::ordered_json;
using pickle::Value;

Json to_json(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::None: return nullptr;
    case Value::Kind::Bool: return v.as_bool();
    case Value::Kind::Int: return v.as_int();
    case Value::Kind::Float: return v.as_float();
    case Value::Kind::Str: return v.as_str();
    case Value::Kind::List:
    case Value::Kind::Tuple: {
      Json out = Json::array();
      for (const auto& item : v.items()) out.push_back(to_json(item));
      return out;
    }
    case Value::Kind::Dict: {
      Json out = Json::object();
      // Keys are unique already: append, since ordered_json's operator[] scans every key.
      auto& object = out.get_ref<Json::object_t&>();
      for (size_t i = 0; i < v.keys().size(); ++i) {
        object.emplace_back(v.keys()[i], to_json(v.values()[i]));
      }
      return out;
    }
  }
  TORCH_INTERNAL_ASSERT(false);
}

Value from_json(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return Value();
    case Json::value_t::boolean: return Value::from_bool(j.get<bool>());
    case Json::value_t::number_integer: return Value::from_int(j.get<int64_t>());
    case Json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      TORCH_CHECK_VALUE(u <= static_cast<uint64_t>(INT64_MAX), "metadata integer ", u,
                        " exceeds int64");
      return Value::from_int(static_cast<int64_t>(u));
    }
    case Json::value_t::number_float: return Value::from_float(j.get<double>());
    case Json::value_t::string: return Value::from_str(j.get<std::string>());
    case Json::value_t::array: {
      std::vector<Value> items;
      for (const auto& e : j) items.push_back(from_json(e));
      return Value::list(std::move(items));
    }
    case Json::value_t::object: {
      Value d = Value::dict();
      for (const auto& [k, e] : j.items()) d.set(k, from_json(e));
      return d;
    }
    default: TORCH_CHECK_VALUE(false, "metadata holds a JSON value with no pickle form");
  }
}

// A metadata node: its "leaves" and "non_tensors" entries are tuples in the reference's dict.
Value node_from_json(const Json& node) {
  Value d = Value::dict();
  for (const auto& [key, value] : node.items()) {
    if (key == "leaves" || key == "non_tensors") {
      Value entries = Value::dict();
      for (const auto& [name, entry] : value.items()) {
        entries.set(name, Value::tuple(from_json(entry).items()));
      }
      d.set(key, std::move(entries));
    } else if (value.is_object() && key != "cls_metadata") {
      d.set(key, node_from_json(value));
    } else {
      d.set(key, from_json(value));
    }
  }
  return d;
}

}  // namespace

pickle::Value metadata_to_pickle(const Metadata& metadata, const TransportFields& transport) {
  return node_from_json(Json::parse(metadata_to_json(metadata, false, transport)));
}

Metadata metadata_from_pickle(const pickle::Value& value, TransportFields* transport) {
  TORCH_CHECK_VALUE(value.kind() == pickle::Value::Kind::Dict, "metadata: expected a dict, got a ",
                    pickle::Value::kind_name(value.kind()));
  return metadata_from_json(to_json(value).dump(), transport);
}

Metadata metadata_from_pickle_bytes(std::string_view bytes, TransportFields* transport) {
  // Nodes nest kMaxMetadataDepth deep, plus a node's dict, its leaves, a tuple and a shape.
  const pickle::Limits limits{.max_depth = kMaxMetadataDepth + 6,
                              .max_elements = static_cast<size_t>(kMaxMetadataEntries) * 8};
  return metadata_from_pickle(pickle::loads(bytes, limits), transport);
}

}  // namespace tensordict
