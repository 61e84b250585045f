#pragma once
// Messages as tensors: what every transport posts is a 1-D uint8 tensor.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstddef>
#include <cstring>
#include <string_view>

namespace tensordict::core {

/// A CPU uint8 tensor of `n` bytes, uninitialised.
inline at::Tensor bytes_tensor(size_t n) { return at::empty({static_cast<int64_t>(n)}, at::kByte); }

/// A uint8 tensor of `n` bytes on `device` (uninitialised) that is about to be written whole:
/// a consolidated storage, a received one. On the CPU, from 4 MiB up, it asks for 2 MiB pages
/// (THP in "madvise" mode), so that writing it faults its pages in 512 times less often: the
/// faults otherwise cost as much as the copy itself (benchmarks/micro_bench.cpp's MemcpyFresh).
at::Tensor fresh_bytes(int64_t n, at::Device device = at::kCPU, bool pin_memory = false);

/// A uint8 tensor holding a copy of `s`, on `device`.
inline at::Tensor bytes_tensor(std::string_view s, at::Device device = at::kCPU) {
  at::Tensor t = bytes_tensor(s.size());
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());  // null data when empty
  return device.is_cpu() ? t : t.to(device);
}

}  // namespace tensordict::core
