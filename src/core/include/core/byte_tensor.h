#pragma once
// Messages as tensors: what every transport posts is a 1-D uint8 tensor.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstddef>
#include <cstring>
#include <string_view>

namespace tensordict::core {

/// A CPU uint8 tensor of `n` bytes, uninitialised.
inline at::Tensor bytes_tensor(size_t n) {
  return at::empty({static_cast<int64_t>(n)}, at::kByte);
}

/// A uint8 tensor holding a copy of `s`, on `device`.
inline at::Tensor bytes_tensor(std::string_view s, at::Device device = at::kCPU) {
  at::Tensor t = bytes_tensor(s.size());
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());  // null data when empty
  return device.is_cpu() ? t : t.to(device);
}

}  // namespace tensordict::core
