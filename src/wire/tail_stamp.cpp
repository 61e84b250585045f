#include "wire/tail_stamp.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>

namespace tensordict::wire {

namespace {

// A 64-bit stamp no peer can predict: seeded once from the OS, then advanced per stamp.
uint64_t next_stamp() {
  static std::atomic<uint64_t> state{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }()};
  uint64_t z = state.fetch_add(0x9e3779b97f4a7c15ULL) + 0x9e3779b97f4a7c15ULL;  // splitmix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

at::Tensor stamp_tensor(uint64_t stamp) {
  at::Tensor t = at::empty({8}, at::kByte);
  std::memcpy(t.data_ptr(), &stamp, 8);
  return t;
}

}  // namespace

TailStamp::TailStamp(const at::Tensor& bytes) {
  const int64_t n = bytes.numel();
  if (n < 8) {
    if (n > 0) bytes.zero_();
    return;
  }
  stamp_ = next_stamp();
  tail_ = bytes.narrow(0, n - 8, 8);
  if (tail_.is_cpu()) {
    std::memcpy(tail_.data_ptr(), &stamp_, 8);
  } else {
    tail_.copy_(stamp_tensor(stamp_));
  }
}

bool TailStamp::short_message() const {
  if (!tail_.defined()) return false;
  uint64_t now = 0;
  if (tail_.is_cpu()) {
    std::memcpy(&now, tail_.data_ptr(), 8);
  } else {
    std::memcpy(&now, tail_.cpu().data_ptr(), 8);
  }
  return now == stamp_;
}

int64_t room_for(int64_t expected) { return std::clamp<int64_t>(expected, 64, int64_t{1} << 20); }

at::Tensor with_room(const at::Tensor& buffer, int64_t max_room) {
  const auto n = static_cast<int64_t>(buffer.nbytes());
  if (!buffer.is_cpu() || !buffer.is_contiguous() || !buffer.storage()) return buffer;
  const int64_t at = buffer.storage_offset() * buffer.element_size();
  const int64_t have = static_cast<int64_t>(buffer.storage().nbytes()) - at - n;
  if (have < 8) return buffer;
  return at::empty({0}, buffer.options().dtype(at::kByte))
      .set_(buffer.storage(), at, {n + std::min(have, max_room)});
}

TailStamp stamp_beyond(const at::Tensor& posted, int64_t expected) {
  return TailStamp(posted.narrow(0, 0, expected + 8));
}

}  // namespace tensordict::wire
