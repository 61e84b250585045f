#pragma once
// The messages of publication (docs/wire-format.md §9) as the tests forge them, byte by byte
// and independently of the library's own encoder: raw peers send them over Gloo
// (dist_publication_test.cpp) and over the pipe (pipe_publication_test.cpp).

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

namespace publication_test {

inline void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

inline uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

// A message of §9, field by field: magic, protocol 1, the 32-bit word, six 64-bit fields.
inline std::string message(const char* magic, uint32_t word,
                           std::initializer_list<uint64_t> fields) {
  std::string m(64, '\0');
  auto* p = reinterpret_cast<uint8_t*>(m.data());
  std::memcpy(p, magic, 8);
  p[8] = 1;
  for (int i = 0; i < 4; ++i) p[12 + i] = static_cast<uint8_t>(word >> (8 * i));
  int at = 16;
  for (uint64_t f : fields) {
    put_u64(p + at, f);
    at += 8;
  }
  return m;
}

// The schema hash both sides compute (§9.5): 64-bit FNV-1a, 0 written as 1.
inline uint64_t schema_hash(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h == 0 ? 1 : h;
}

}  // namespace publication_test
