// JsonValue: the JSON-like value of a non-tensor entry (tensordict/json_value.h); its text
// form is core/json_text.h's.

#include "tensordict/json_value.h"

#include <c10/util/Exception.h>

#include <string>
#include <unordered_set>

#include "core/excerpt.h"
#include "core/json_text.h"
#include "tensordict/errors.h"

namespace tensordict {

// ---- JsonValue --------------------------------------------------------------------------------

namespace {

// The keys of a map are unique: checked by a scan for small maps, a hash set for large ones.
void check_unique_keys(const JsonValue::Map& map) {
  if (map.size() <= core::kScanKeys) {
    for (size_t i = 0; i < map.size(); ++i) {
      for (size_t k = 0; k < i; ++k) {
        TORCH_CHECK_VALUE(map[k].first != map[i].first, "JsonValue: the map has the key ",
                          core::quoted_excerpt(map[i].first), " twice");
      }
    }
    return;
  }
  std::unordered_set<std::string_view> seen;
  seen.reserve(map.size());
  for (const auto& [key, value] : map) {
    TORCH_CHECK_VALUE(seen.insert(key).second, "JsonValue: the map has the key ",
                      core::quoted_excerpt(key), " twice");
  }
}

[[noreturn]] void wrong_type(const char* want, const JsonValue& got) {
  TORCH_CHECK_TYPE(false, "JsonValue: expected ", want, ", got ", core::json_type_name(got));
}

}  // namespace

JsonValue::JsonValue(const JsonValue& other) = default;
JsonValue& JsonValue::operator=(const JsonValue& other) = default;

JsonValue::JsonValue(std::string s) {
  if (s.size() <= kInlineString) {
    v_ = std::move(s);
  } else {
    v_ = std::make_shared<const std::string>(std::move(s));
  }
}

JsonValue::JsonValue(Map map) {
  check_unique_keys(map);
  v_ = std::make_shared<const Map>(std::move(map));
}

bool JsonValue::as_bool() const {
  if (!is_bool()) wrong_type("bool", *this);
  return std::get<bool>(v_);
}

int64_t JsonValue::as_int() const {
  if (!is_int()) wrong_type("int", *this);
  return std::get<int64_t>(v_);
}

double JsonValue::as_float() const {
  if (is_int()) return static_cast<double>(std::get<int64_t>(v_));
  if (!is_float()) wrong_type("float", *this);
  return std::get<double>(v_);
}

const std::string& JsonValue::as_string() const {
  if (v_.index() == 4) return std::get<std::string>(v_);
  if (!is_string()) wrong_type("str", *this);
  return *std::get<std::shared_ptr<const std::string>>(v_);
}

const JsonValue::List& JsonValue::as_list() const {
  if (!is_list()) wrong_type("list", *this);
  return *std::get<std::shared_ptr<const List>>(v_);
}

const JsonValue::Map& JsonValue::as_map() const {
  if (!is_map()) wrong_type("dict", *this);
  return *std::get<std::shared_ptr<const Map>>(v_);
}

const JsonValue& JsonValue::at(std::string_view key) const {
  for (const auto& [k, v] : as_map()) {
    if (k == key) return v;
  }
  TD_CHECK_KEY(false, "JsonValue: key ", core::quoted_excerpt(key), " not found");
  TORCH_INTERNAL_ASSERT(false);
}

const JsonValue& JsonValue::at(size_t index) const {
  const auto& list = as_list();
  TORCH_CHECK_INDEX(index < list.size(), "JsonValue: index ", index,
                    " is out of range for a list of ", list.size(), " items");
  return list[index];
}

const void* JsonValue::node() const {
  switch (v_.index()) {
    case 5: return std::get<5>(v_).get();
    case 6: return std::get<6>(v_).get();
    case 7: return std::get<7>(v_).get();
    default: return nullptr;
  }
}

bool JsonValue::operator==(const JsonValue& other) const {
  if (is_string() && other.is_string()) return as_string() == other.as_string();
  if (v_.index() != other.v_.index()) return false;
  if (node() != nullptr && node() == other.node()) return true;  // one shared node
  switch (v_.index()) {
    case 6: return as_list() == other.as_list();
    case 7: return as_map() == other.as_map();
    default: return v_ == other.v_;
  }
}

std::string JsonValue::dump() const {
  std::string out;
  core::append_json(out, *this, /*sort_keys=*/false);
  return out;
}

JsonValue JsonValue::parse(std::string_view text) {
  return core::parse_json(text, core::JsonLimits{}, "JsonValue::parse");
}

}  // namespace tensordict
