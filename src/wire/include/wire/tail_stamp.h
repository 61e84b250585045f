#pragma once
// Stamps in a receive buffer, telling a message shorter than the buffer, or longer than it when
// the buffer was posted with room after it. For transports that do not say how long a message
// was (Gloo); no transport here, so that fuzz/receive_stamps.cpp plays every length.

#include <ATen/ATen.h>

#include <cstdint>

namespace tensordict::wire {

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

/// Gloo ends the process when a message is longer than the receive posted for it
/// (GLOO_ENFORCE_LE in its event loop, which no caller can catch). A receive posted with room
/// after the bytes it expects takes a longer message instead, and a TailStamp over the room's
/// first 8 bytes (short_message() false once a message wrote them) tells it: the room a
/// receive of `expected` bytes gets when the transport layer sizes it (64 B to 1 MiB, as long
/// as the message expected); only a message longer than expected + room still aborts.
int64_t room_for(int64_t expected);

/// What to post for `buffer`: the buffer and the room after it in its allocation (up to
/// `max_room` bytes), when it is a contiguous CPU view with 8 bytes or more after it there;
/// otherwise `buffer` itself. Only for memory of the library's own: the room is written by a
/// longer message.
at::Tensor with_room(const at::Tensor& buffer, int64_t max_room);

/// The stamp over the 8 bytes after `expected` in `posted` (with_room's result, longer than
/// `expected` by 8 bytes or more): long_message(stamp) after the receive.
TailStamp stamp_beyond(const at::Tensor& posted, int64_t expected);
inline bool long_message(const TailStamp& beyond) { return !beyond.short_message(); }

}  // namespace tensordict::wire
