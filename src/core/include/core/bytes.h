#pragma once
// Fixed-width integers as the wire formats lay them out (docs/wire-format.md): little-endian
// everywhere (pipe lengths, pickle arguments, our checked-transfer header), except pickle's
// BINFLOAT, which is big-endian. The one reader and writer of them.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tensordict::core {

/// The low `n` bytes (1 to 8) of `v`, least significant first, at `out`.
inline void put_le(uint8_t* out, uint64_t v, size_t n = 8) {
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

/// The `n` bytes (1 to 8) at `in` as a little-endian unsigned integer.
inline uint64_t get_le(const uint8_t* in, size_t n = 8) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t{in[i]} << (8 * i);
  return v;
}

inline void append_le(std::string& out, uint64_t v, size_t n) {
  for (size_t i = 0; i < n; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

inline void append_be(std::string& out, uint64_t v, size_t n) {
  for (size_t i = n; i-- > 0;) out.push_back(static_cast<char>(v >> (8 * i)));
}

/// A cursor over untrusted bytes. It never reads past the end: every read is preceded by
/// has(n), and the caller raises its own error (naming what it was reading) when that is false.
class ByteReader {
 public:
  explicit ByteReader(std::string_view data) : data_(data) {}
  size_t pos() const { return pos_; }
  size_t size() const { return data_.size(); }
  size_t left() const { return data_.size() - pos_; }
  bool has(uint64_t n) const { return n <= left(); }
  /// The next `n` (1 to 8) bytes as a little-endian integer; requires has(n).
  uint64_t le(size_t n) {
    const uint64_t v = get_le(reinterpret_cast<const uint8_t*>(data_.data()) + pos_, n);
    pos_ += n;
    return v;
  }
  /// The next `n` bytes as big-endian; requires has(n).
  uint64_t be(size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v = (v << 8) | static_cast<uint8_t>(data_[pos_ + i]);
    pos_ += n;
    return v;
  }
  uint8_t u8() { return static_cast<uint8_t>(data_[pos_++]); }  // requires has(1)
  /// The next `n` bytes; requires has(n).
  std::string_view take(size_t n) {
    const std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  /// The rest of the data from the cursor.
  std::string_view rest() const { return data_.substr(pos_); }
  void skip(size_t n) { pos_ += n; }  // requires has(n)

 private:
  std::string_view data_;
  size_t pos_ = 0;
};

}  // namespace tensordict::core
