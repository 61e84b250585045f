#pragma once
// Internal (not installed): JSON text as Python's json module writes and reads it, shared by
// JsonValue, the metadata codecs, memmap's meta.json and the pipe's headers. Every reader of a
// peer's text goes through parse_json with bounds, so nesting and element counts are checked while
// the tree is built.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "tensordict/json_value.h"

namespace tensordict::core {

/// Maps up to this size find a duplicate key by a scan; larger ones through a hash index.
inline constexpr size_t kScanKeys = 8;

/// Whether `s` is UTF-8 that Python's strict decoder accepts: no overlong form, surrogate or
/// code point above U+10FFFF. Every peer string is checked with it, so that what we read we
/// can write back.
bool valid_utf8(std::string_view s);

/// A JSON number at the start of a text, by parse_json's grammar
/// -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?: where it ends (0 when no digit comes after
/// the optional minus), whether it is a float (it has a fraction or an exponent) and whether
/// its exponent is negative.
struct JsonNumber {
  size_t length = 0;
  bool is_float = false;
  bool negative_exponent = false;
};
JsonNumber scan_json_number(std::string_view s);

/// Appends `s` as a JSON string literal the way json.dumps(ensure_ascii=True) writes it.
/// ValueError (starting with `who`) when `s` is not valid UTF-8.
void append_json_string(std::string& out, std::string_view s, const char* who = "json");

/// Python's repr() of a float: the shortest round-trip digits, "1.0", "1e-07", "1e+16",
/// "inf", "-inf", "nan".
std::string python_float_repr(double d);

/// Appends json.dumps(value, sort_keys=sort_keys): ", " and ": " separators, ASCII only,
/// NaN / Infinity / -Infinity for the non-finite floats. Throws ValueError (starting with `who`)
/// on invalid UTF-8.
void append_json(std::string& out, const JsonValue& value, bool sort_keys,
                 const char* who = "json");

/// Python's str(value): a string as is, anything else as repr() would print the Python object
/// json.loads gives ('single quotes', True, None, {'k': 1}). Non-ASCII characters are kept
/// (escaping only the control characters), which is what repr() does for printable ones.
std::string python_str(const JsonValue& value);

/// What a shared node of a JsonValue costs beside its contents: make_shared's control block
/// and the std::string or vector it holds.
inline constexpr size_t kSharedNodeBytes = 48;

/// The value budget of a text a reader did not write (a meta.json, a consolidated file's or a
/// pipe peer's metadata JSON): the non-tensor values built from it may take this many bytes of
/// memory per byte of text, plus kValueAllowanceBytes.
inline constexpr size_t kValueBytesPerTextByte = 3;
inline constexpr size_t kValueAllowanceBytes = size_t{16} << 20;

/// How much more than the data holds a full write (JSON text, a pickle, repr) of data that
/// reuses shared values may produce, by default: a value read from a pickle that references
/// one object many times is held once, and writing it out copies it each time. A NonTensorStack
/// built from a list (NonTensorData::from_list, a member per use of a reused list) is held to it
/// too.
inline constexpr size_t kMaxJsonExpansion = size_t{256} << 20;

/// The memory `value` holds, as parse_json's budget counts it (a value, a shared node, a long
/// string's bytes, a map entry's key), each node once however often it is reused.
size_t json_memory(const JsonValue& value);

/// Measures, before anything is written, the bytes a full write of some values takes (about
/// their JSON text), every reuse of a shared node counted again, against the bytes of their
/// distinct nodes. Memoized per node: O(nodes + edges) however often they are reused.
class JsonExpansion {
 public:
  explicit JsonExpansion(size_t max_extra_bytes = kMaxJsonExpansion);
  /// Adds one value to the write: ValueError, starting with what(), when the values added so
  /// far would write more than max_extra_bytes beyond the bytes they hold.
  void add(const JsonValue& value, const std::function<std::string()>& what);

 private:
  size_t text_bytes(const JsonValue& v);
  size_t max_extra_;
  size_t written_ = 0;                             // the text of every value added, expanded
  size_t distinct_ = 0;                            // the bytes of their distinct nodes
  std::unordered_map<const void*, size_t> sizes_;  // a shared node's text, once measured
};

/// Builds JsonValues from a graph of objects that may reuse one another (a Python object graph,
/// a pickle's memo): each object with an identity is built once, and each further use of it
/// costs a node (a copy of the shared value, O(1)), not its contents, as the reference keeps one
/// Python object. What it builds is charged as it goes; the caller walks its graph and asks
/// find() before building an object, remember() after.
class SharedJsonBuilder {
 public:
  struct Limits {
    size_t max_depth = 512;       // nesting of lists and maps
    size_t max_bytes = SIZE_MAX;  // memory of what is built, each use of a node counted
  };
  explicit SharedJsonBuilder(Limits limits, std::function<std::string()> what)
      : limits_(limits), what_(std::move(what)) {}
  /// Starts the values of another entry (`what` names it in errors).
  void set_what(std::function<std::string()> what) { what_ = std::move(what); }
  /// The value built for `id` earlier, or nullptr; a hit charges one node.
  const JsonValue* find(const void* id);
  /// Records the value built for `id` (a string, list or map) and returns it.
  const JsonValue& remember(const void* id, JsonValue value);
  /// ValueError, starting with what(), past max_depth (`where` names the position).
  void enter(size_t depth, const std::string& where) const;
  /// Charges a value made: a node, plus `extra` bytes (a string's, a map entry's key).
  void charge(size_t extra = 0);
  /// The charge of a string of `n` bytes, a container, a map entry's key of `n` bytes.
  static size_t string_bytes(size_t n);
  static size_t key_bytes(size_t n);
  size_t bytes() const { return bytes_; }

 private:
  Limits limits_;
  std::function<std::string()> what_;
  size_t bytes_ = 0;
  std::unordered_map<const void*, JsonValue> built_;
};

struct JsonLimits {
  size_t max_depth = 256;        // nesting of lists and maps
  size_t max_values = SIZE_MAX;  // values created, containers included
  size_t max_bytes = SIZE_MAX;   // memory the values take (json_bytes), checked as they are made
};

/// Parses JSON text as json.loads does (NaN, Infinity, -Infinity accepted; a duplicate key
/// keeps its first position and its last value). ValueError, starting with `who`, on bad
/// text, an integer outside int64, or a bound of `limits` exceeded. Never recurses deeper
/// than limits.max_depth.
JsonValue parse_json(std::string_view text, const JsonLimits& limits, const char* who = "json");

/// The bytes of memory parse_json would spend on the values of `text` (each value, a map
/// entry's key, a long string's bytes), found without building them: a reader can refuse a
/// text before it costs anything. The same errors as parse_json.
size_t json_bytes(std::string_view text, const JsonLimits& limits, const char* who = "json");

/// Reads a JSON object member by member: `each(key, value)` gets every member in the order of
/// the text (a repeated key comes twice), and the object is never built, so the memory a
/// member's value takes is returned to the caller's choice. The limits apply to each member's
/// value on its own. The same errors as parse_json, and ValueError when the text is not an
/// object.
void parse_json_members(std::string_view text, const JsonLimits& limits, const char* who,
                        const std::function<void(std::string, JsonValue)>& each);

/// Python's name of the value's type: "NoneType", "bool", "int", "float", "str", "list",
/// "dict".
const char* json_type_name(const JsonValue& value);

/// Equality where a float equals itself bit for bit (NaN included), unlike operator==: "the
/// same data", for the checks that a copy is unchanged (consolidated views, update, stack).
bool json_identical(const JsonValue& a, const JsonValue& b);

}  // namespace tensordict::core
