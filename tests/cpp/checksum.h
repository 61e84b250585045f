#pragma once
// The checksum of the fault and soak tests: FNV-1a over a tensor's bytes (8-byte words, then
// the tail bytes), chained through `h`.
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace tensordict::testing {

inline constexpr uint64_t kFnvBasis = 1469598103934665603ull;

inline uint64_t fnv(uint64_t h, const at::Tensor& t) {
  const auto c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.const_data_ptr());
  const size_t n = c.nbytes();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace tensordict::testing
