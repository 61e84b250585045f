#pragma once
// A restricted pickle reader and writer for the data the reference's object collectives carry:
// dicts with str keys, lists, tuples, str, int, float, bool and None, plus inert class
// references (GLOBAL / STACK_GLOBAL: a tensorclass node's "cls"). Nothing here imports or calls
// anything: a class reference is only a (module, qualname) pair, and every opcode that would
// call or build an object (REDUCE, BUILD, NEWOBJ, INST, OBJ, EXT, PERSID, ...) is refused, so
// bytes from a peer can be read safely.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/metadata.h"

namespace tensordict::wire::pickle {

/// One value of the subset. Dicts keep insertion order (as Python's do) and have str keys.
class Value {
 public:
  enum class Kind { None, Bool, Int, Float, Str, List, Tuple, Dict, ClassRef };

  Value() = default;         // None
  Value(const Value& other)  // the key index is not copied: rebuilt when needed
      : kind_(other.kind_),
        scalar_(other.scalar_),
        s_(other.s_),
        items_(other.items_),
        keys_(other.keys_) {}
  Value& operator=(const Value& other) {
    if (this != &other) *this = Value(other);
    return *this;
  }
  Value(Value&&) noexcept = default;
  Value& operator=(Value&&) noexcept = default;
  static Value from_bool(bool v);
  static Value from_int(int64_t v);
  static Value from_float(double v);
  static Value from_str(std::string v);
  static Value list(std::vector<Value> items = {});
  static Value tuple(std::vector<Value> items = {});
  static Value dict();
  /// An inert reference to a class or function, as GLOBAL / STACK_GLOBAL name it: nothing is
  /// imported or resolved. Both parts must satisfy valid_dotted_name (ValueError otherwise).
  static Value class_ref(std::string module, std::string qualname);

  Kind kind() const { return kind_; }
  bool is_none() const { return kind_ == Kind::None; }
  /// Accessors; each throws ValueError naming the expected and the actual kind.
  bool as_bool() const;
  int64_t as_int() const;
  double as_float() const;  // ints convert, as in Python
  const std::string& as_str() const;
  /// The two parts of a class reference.
  const std::string& ref_module() const;
  const std::string& ref_qualname() const;
  /// The elements of a list or a tuple.
  const std::vector<Value>& items() const;
  std::vector<Value>& items();
  /// Dict entries in insertion order.
  const std::vector<std::string>& keys() const;
  const std::vector<Value>& values() const;
  /// Dict lookup; nullptr when absent.
  const Value* find(std::string_view key) const;
  /// Sets a dict entry (replacing an existing key in place, as Python does).
  Value& set(std::string key, Value value);
  /// Moves a str's text out (the value keeps an empty str).
  std::string take_str();
  /// Room for `n` more elements of a list or tuple, or entries of a dict.
  void reserve(size_t n);
  /// Removes a dict entry if present; returns whether it was.
  bool erase(std::string_view key);

  /// Python's name of the kind: "dict", "str", ...
  static const char* kind_name(Kind kind);

  friend bool operator==(const Value& a, const Value& b);

 private:
  // Lean on purpose: a metadata pickle reads into tens of thousands of these. A dict keeps its
  // keys in order and finds one by a scan up to core::kScanKeys keys; a larger dict builds a
  // hash index on first lookup (not copied with the value: rebuilt when needed).
  struct KeyHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };
  // key -> position, so that building a dict of n keys from a peer costs O(n), not O(n^2).
  using KeyIndex = std::unordered_map<std::string, size_t, KeyHash, std::equal_to<>>;
  size_t position(std::string_view key) const;  // keys_.size() when absent
  Kind kind_ = Kind::None;
  union Scalar {
    bool b;
    int64_t i = 0;
    double f;
  } scalar_;
  std::string s_;                  // str, or a class reference's module
  std::vector<Value> items_;       // list / tuple elements, or dict values
  std::vector<std::string> keys_;  // dict keys; a class reference's qualname alone
  mutable std::unique_ptr<KeyIndex> index_;
};

/// The memory budget of a read, by default: kBaseBudgetBytes plus kBudgetPerInputByte per byte
/// of input, at most kMaxBudgetBytes (a metadata pickle of 20,000 leaves, which expands about
/// 70-fold, fits: tests/cpp/pickle_test.cpp), plus the input's size again (so that a long string,
/// which costs about its size, always fits).
inline constexpr size_t kBaseBudgetBytes = size_t{1} << 20;
inline constexpr size_t kBudgetPerInputByte = 128;
inline constexpr size_t kMaxBudgetBytes = size_t{64} << 20;

/// Bounds applied while reading untrusted bytes.
struct Limits {
  size_t max_depth = 64;          // nesting of containers
  size_t max_elements = 1 << 20;  // values created, counting each memo reference again
  size_t max_name_bytes = 4096;   // each of a class reference's module and qualname
  /// Bytes of memory the values read may take, every memo copy counted again, enforced as the
  /// reader goes; 0: the default budget above.
  size_t max_bytes = 0;
};

namespace detail {
/// What loads() charges its memory budget: per value made or copied (plus a str's bytes), per
/// dict entry (plus its key's bytes), per memo index a GET reads. (The metadata reader's fast
/// path counts its own, smaller structures: src/wire/metadata_pickle.cpp.)
inline constexpr size_t kValueCharge = 256;
inline constexpr size_t kDictEntryCharge = 64;
inline constexpr size_t kMemoIndexCharge = 48;
/// The budget of a read of `data` under `limits` (Limits::max_bytes, or the default above).
size_t read_budget(std::string_view data, const Limits& limits);
}  // namespace detail

/// The schema's rule for class names (core/metadata.h), which a class reference's module and
/// qualname must satisfy.
using core::valid_dotted_name;

/// Writes a protocol-4 pickle opcode by opcode, as Python's pickler writes the subset without
/// memo (what dumps() and the metadata writer emit): open a container with its element count,
/// write the elements, close it with the same count.
class Writer {
 public:
  explicit Writer(std::string& out);  // appends PROTO 4
  void none();
  void boolean(bool v);
  void integer(int64_t v);
  void floating(double v);
  void str(std::string_view s);
  void class_ref(std::string_view module, std::string_view qualname);  // STACK_GLOBAL
  void list_open(size_t n);
  void list_close(size_t n);
  void tuple_open(size_t n);
  void tuple_close(size_t n);
  void dict_open(size_t n);  // then n times: str(key), the value
  void dict_close(size_t n);
  void finish();  // STOP

 private:
  void op(uint8_t code) { out_.push_back(static_cast<char>(code)); }
  std::string& out_;
};

/// Serialises `value` as a protocol-4 pickle that Python's pickle.loads reads back equal (a
/// class reference is written as STACK_GLOBAL, which Python's loads would import).
std::string dumps(const Value& value);

/// Reads a pickle of the subset (protocols 2 to 5, as Python writes them: memo, frames).
/// GLOBAL and STACK_GLOBAL give an inert Kind::ClassRef value. Throws ValueError on anything
/// else: an opcode outside the subset (calls, object construction, bytes, persistent ids),
/// truncated or trailing data, a non-str dict key, an int beyond int64, a class reference
/// whose parts are not dotted names, or a bound of `limits` exceeded.
Value loads(std::string_view data, const Limits& limits = {});

}  // namespace tensordict::wire::pickle
