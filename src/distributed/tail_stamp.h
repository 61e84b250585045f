#pragma once
// A stamp at the end of a receive buffer, telling a message shorter than the buffer. Private to
// the c10d layer.

#include <ATen/ATen.h>

#include <cstdint>

namespace tensordict::dist::detail {

/// Gloo does not tell a receiver how many bytes a message carried: a message shorter than the
/// posted buffer leaves the rest of the buffer as it was, which for a fresh allocation is
/// memory freed earlier. A TailStamp writes 8 random bytes at the end of a buffer before the
/// receive; if they are still there afterwards, the message stopped short of the end (by 8
/// bytes or more; the chance that a full message ends with the same 8 bytes is 2^-64). A
/// message shorter by 1 to 7 bytes leaves stamp bytes, never old memory. Buffers under 8
/// bytes are zeroed instead, and short_message() is then always false.
class TailStamp {
 public:
  /// `bytes`: a contiguous 1-D uint8 tensor, on any device, about to be received into.
  explicit TailStamp(const at::Tensor& bytes);
  /// After the receive: whether the message ended before the stamp.
  bool short_message() const;

 private:
  at::Tensor tail_;  // a view of the buffer's last 8 bytes, or undefined
  uint64_t stamp_ = 0;
};

}  // namespace tensordict::dist::detail
