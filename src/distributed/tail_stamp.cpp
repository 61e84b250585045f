#include "tail_stamp.h"

#include <atomic>
#include <cstring>
#include <random>

namespace tensordict::dist::detail {

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

}  // namespace tensordict::dist::detail
