#include "core/byte_tensor.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#include <cstdint>

namespace tensordict::core {

at::Tensor fresh_bytes(int64_t n, at::Device device, bool pin_memory) {
  at::Tensor t =
      at::empty({n}, at::TensorOptions().dtype(at::kByte).device(device).pinned_memory(pin_memory));
#ifdef __linux__
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  if (device.is_cpu() && !pin_memory && n >= int64_t{4} << 20) {
    const auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t lo = (p + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t hi = (p + static_cast<uintptr_t>(n)) & ~(kHugePage - 1);
    if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
#endif
  return t;
}

}  // namespace tensordict::core
