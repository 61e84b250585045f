#pragma once
// JsonValue: a JSON-like value (null, bool, integer, float, string, list, map with string keys
// in insertion order), the data of a non-tensor entry. Our own small type, so that the public
// headers need no JSON library; the sources convert it to and from JSON text and pickles.
// A value is immutable, and its strings (beyond the small-string buffer), lists and maps are
// shared nodes: a copy costs O(1), and data that reuses one object (a pickle's memo, one Python
// str in many entries) holds it once. Whatever writes such data out in full (JSON text, a
// pickle, repr) measures it first (core/json_text.h: JsonExpansion).

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace tensordict {

class JsonValue {
 public:
  using List = std::vector<JsonValue>;
  using Map = std::vector<std::pair<std::string, JsonValue>>;  // insertion order, unique keys

  JsonValue() : v_(nullptr) {}
  // Out of line: GCC 12 inlines the variant's copy into vector growth and then reports a false
  // -Warray-bounds.
  JsonValue(const JsonValue& other);
  JsonValue& operator=(const JsonValue& other);
  JsonValue(JsonValue&&) noexcept = default;
  JsonValue& operator=(JsonValue&&) noexcept = default;
  JsonValue(std::nullptr_t) : v_(nullptr) {}                    // NOLINT: implicit on purpose
  JsonValue(bool b) : v_(b) {}                                  // NOLINT
  JsonValue(int i) : v_(static_cast<int64_t>(i)) {}             // NOLINT
  JsonValue(int64_t i) : v_(i) {}                               // NOLINT
  JsonValue(double d) : v_(d) {}                                // NOLINT
  JsonValue(const char* s) : JsonValue(std::string(s)) {}       // NOLINT: implicit on purpose
  JsonValue(std::string s);                                     // NOLINT
  JsonValue(std::string_view s) : JsonValue(std::string(s)) {}  // NOLINT
  JsonValue(List list) : v_(std::make_shared<const List>(std::move(list))) {}  // NOLINT
  JsonValue(Map map);  // NOLINT; ValueError on a duplicate key
  /// A list: JsonValue::list({1, "a", nullptr}).
  static JsonValue list(std::initializer_list<JsonValue> items) { return JsonValue(List(items)); }
  /// A map: JsonValue::map({{"a", 1}, {"b", "x"}}).
  static JsonValue map(std::initializer_list<std::pair<std::string, JsonValue>> items) {
    return JsonValue(Map(items));
  }

  bool is_null() const { return v_.index() == 0; }
  bool is_bool() const { return v_.index() == 1; }
  bool is_int() const { return v_.index() == 2; }
  bool is_float() const { return v_.index() == 3; }
  bool is_string() const { return v_.index() == 4 || v_.index() == 5; }
  bool is_list() const { return v_.index() == 6; }
  bool is_map() const { return v_.index() == 7; }

  /// The value; TypeError naming both types when it holds another one.
  bool as_bool() const;
  int64_t as_int() const;
  /// A float, or an integer converted to double.
  double as_float() const;
  const std::string& as_string() const;
  const List& as_list() const;
  const Map& as_map() const;
  /// The map's value at `key`; KeyError when absent, TypeError when not a map.
  const JsonValue& at(std::string_view key) const;
  /// The list's item at `index`; IndexError when out of range, TypeError when not a list.
  const JsonValue& at(size_t index) const;

  /// JSON text as Python's json.dumps writes it (", " and ": " separators, ASCII only, floats
  /// with repr's shortest round-trip form, NaN and Infinity as Python writes them).
  std::string dump() const;
  /// Parses JSON text (Python's NaN/Infinity/-Infinity accepted); ValueError on bad text.
  static JsonValue parse(std::string_view text);

  /// The shared node behind a string longer than kInlineString bytes, a list or a map (values
  /// that copied one another share it); nullptr for the other values. For walks that visit
  /// each node of shared data once (conversions, size measures).
  const void* node() const;

  /// Equal contents, shared or not: a float by ==, so NaN differs from itself, except inside
  /// one shared node compared with itself (taken as equal without a walk, which could expand).
  bool operator==(const JsonValue& other) const;

  /// Strings up to this many bytes are held inline (std::string's small-string buffer).
  static constexpr size_t kInlineString = 15;

 private:
  std::variant<std::nullptr_t, bool, int64_t, double, std::string,
               std::shared_ptr<const std::string>, std::shared_ptr<const List>,
               std::shared_ptr<const Map>>
      v_;
};

}  // namespace tensordict
