#include "tensordict/distributed/tags.h"

#include <c10/util/Exception.h>

#include <array>

namespace tensordict::dist {
namespace {

// numpy/random/bit_generator.pyx (SeedSequence) constants.
constexpr uint32_t kInitA = 0x43b0d7e5;
constexpr uint32_t kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd;
constexpr uint32_t kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd;
constexpr uint32_t kMixMultR = 0x4973f715;
constexpr int kPoolSize = 4;

using u128 = unsigned __int128;
// numpy's PCG64 multiplier, 0x2360ed051fc65da4'4385df649fccf645.
constexpr u128 kPcgMult = (u128{0x2360ed051fc65da4ULL} << 64) | u128{0x4385df649fccf645ULL};

inline uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> 16;
  return value;
}

inline uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  return r ^ (r >> 16);
}

inline uint64_t rotr64(uint64_t value, unsigned rot) {
  return (value >> rot) | (value << ((64 - rot) & 63));
}

}  // namespace

int64_t int_generator(int64_t seed) {
  TORCH_CHECK_VALUE(seed >= 0, "expected non-negative integer");
  // SeedSequence(seed): the seed as 32-bit words, least significant first, no leading zero
  // words (0 is one zero word). A non-negative int64 needs at most two, so every word fits in
  // the pool and the "extra entropy" loop of mix_entropy never runs.
  const auto useed = static_cast<uint64_t>(seed);
  const int n_words = (useed >> 32) != 0 ? 2 : 1;
  const uint32_t words[2] = {static_cast<uint32_t>(useed), static_cast<uint32_t>(useed >> 32)};

  std::array<uint32_t, kPoolSize> pool{};
  uint32_t hash_const = kInitA;
  for (int i = 0; i < kPoolSize; ++i) {
    pool[i] = hashmix(i < n_words ? words[i] : 0u, hash_const);
  }
  for (int src = 0; src < kPoolSize; ++src) {
    for (int dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) {
        pool[dst] = mix(pool[dst], hashmix(pool[src], hash_const));
      }
    }
  }

  // generate_state(4, uint64): 8 words from a fresh hash constant, paired little-endian.
  std::array<uint64_t, 4> state{};
  uint32_t hash_b = kInitB;
  for (int i = 0; i < 8; ++i) {
    uint32_t d = pool[i % kPoolSize];
    d ^= hash_b;
    hash_b *= kMultB;
    d *= hash_b;
    d ^= d >> 16;
    state[i / 2] |= static_cast<uint64_t>(d) << (32 * (i % 2));
  }

  // PCG64 seeding (pcg_setseq_128_srandom_r), then one XSL-RR output.
  const u128 initstate = (u128{state[0]} << 64) | state[1];
  const u128 initseq = (u128{state[2]} << 64) | state[3];
  const u128 inc = (initseq << 1) | 1u;
  u128 s = inc;  // state 0, stepped once
  s += initstate;
  s = s * kPcgMult + inc;
  s = s * kPcgMult + inc;  // next64 steps before it outputs
  const auto hi = static_cast<uint64_t>(s >> 64);
  const auto lo = static_cast<uint64_t>(s);
  const uint64_t x = rotr64(hi ^ lo, static_cast<unsigned>(hi >> 58));

  // Generator.bytes(8) yields x little-endian; int.from_bytes(..., "big") reads it swapped.
  return static_cast<int64_t>(__builtin_bswap64(x) % 10000);
}

}  // namespace tensordict::dist
