#pragma once
// NestedKey: the path to an entry of a TensorDict, one string per level.

#include <initializer_list>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace tensordict {

/// A key path. "a" is the one-level path {"a"}; {"a", "b"} reaches leaf b inside the
/// nested TensorDict a. Keys never contain separators: nesting is only the list structure,
/// as in the reference's tuple keys. A path must have at least one part (ValueError).
class NestedKey {
 public:
  NestedKey(const char* key);       // NOLINT: implicit, like a Python str key
  NestedKey(std::string key);       // NOLINT
  NestedKey(std::string_view key);  // NOLINT
  NestedKey(std::initializer_list<std::string> parts);
  NestedKey(std::vector<std::string> parts);  // NOLINT

  const std::vector<std::string>& parts() const { return parts_; }
  size_t size() const { return parts_.size(); }
  bool is_nested() const { return parts_.size() > 1; }
  const std::string& front() const { return parts_.front(); }
  const std::string& back() const { return parts_.back(); }
  const std::string& operator[](size_t i) const { return parts_[i]; }

  /// The key without its last part (the path of the TensorDict holding the entry).
  NestedKey parent() const;
  /// This path followed by `child`.
  NestedKey join(const NestedKey& child) const;

  /// The key as the reference prints it: 'a' for one level, ('a', 'b') for a path.
  std::string str() const;

  friend bool operator==(const NestedKey& a, const NestedKey& b) { return a.parts_ == b.parts_; }
  friend std::ostream& operator<<(std::ostream& os, const NestedKey& k) { return os << k.str(); }

 private:
  explicit NestedKey(std::vector<std::string> parts, bool /*unchecked*/)
      : parts_(std::move(parts)) {}
  std::vector<std::string> parts_;
};

/// Python's repr of a str: quoted with ' (or " when the text holds ' but not ").
std::string quote_key(std::string_view key);

}  // namespace tensordict
