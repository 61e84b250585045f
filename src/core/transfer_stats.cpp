#include "tensordict/transfer_stats.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>

#if defined(__x86_64__)
#include <cpuid.h>
#include <x86intrin.h>
#endif

namespace tensordict {
namespace {
// Per channel, TransferStats' fields in order; the duration in transfer_ticks().
std::atomic<int64_t> counters[2][6];

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// An invariant TSC (CPUID 0x80000007, EDX bit 8) ticks at one rate on every core, whatever
// the power state.
bool invariant_tsc() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(0x80000007, &a, &b, &c, &d) && (d & (1u << 8)) != 0;
#else
  return false;
#endif
}

bool use_tsc() {
  static const bool tsc = invariant_tsc();  // not a global: safe from static-init order
  return tsc;
}

// Nanoseconds per tick, measured once against steady_clock over 2 ms (first needed when a
// duration is read or logged, not on the transfer path).
double ns_per_tick() {
  static const double ratio = [] {
    if (!use_tsc()) return 1.0;
    const int64_t t0 = steady_ns(), k0 = detail::transfer_ticks();
    int64_t t1 = t0, k1 = k0;
    while (t1 - t0 < 2'000'000) {
      t1 = steady_ns();
      k1 = detail::transfer_ticks();
    }
    return k1 > k0 ? static_cast<double>(t1 - t0) / static_cast<double>(k1 - k0) : 1.0;
  }();
  return ratio;
}

int64_t ticks_to_ns(int64_t ticks) {
  return static_cast<int64_t>(static_cast<double>(ticks) * ns_per_tick());
}
}  // namespace

TransferStats transfer_stats(Channel channel) {
  const auto& c = counters[static_cast<int>(channel)];
  return {c[0].load(), c[1].load(), c[2].load(),
          c[3].load(), c[4].load(), ticks_to_ns(c[5].load())};
}

void reset_transfer_stats() {
  for (auto& channel : counters) {
    for (auto& c : channel) c.store(0);
  }
}

const char* channel_name(Channel channel) {
  return channel == Channel::kPipe ? "pipe" : "process_group";
}

namespace detail {

void count_messages(Channel channel, bool sent, int64_t messages, int64_t bytes) {
  auto& c = counters[static_cast<int>(channel)];
  c[sent ? 1 : 2].fetch_add(messages, std::memory_order_relaxed);
  c[sent ? 3 : 4].fetch_add(bytes, std::memory_order_relaxed);
}

int64_t transfer_ticks() {
#if defined(__x86_64__)
  if (use_tsc()) return static_cast<int64_t>(__rdtsc());
#endif
  return steady_ns();
}

int64_t finish_transfer(Channel channel, int64_t start) {
  const int64_t ticks = std::max<int64_t>(0, transfer_ticks() - start);
  auto& c = counters[static_cast<int>(channel)];
  c[0].fetch_add(1, std::memory_order_relaxed);
  c[5].fetch_add(ticks, std::memory_order_relaxed);
  return ticks;
}

std::string micros_text(int64_t ticks) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f us", static_cast<double>(ticks_to_ns(ticks)) / 1e3);
  return text;
}

}  // namespace detail
}  // namespace tensordict
