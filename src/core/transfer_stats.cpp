#include "tensordict/transfer_stats.h"

#include <atomic>
#include <cstdio>

namespace tensordict {
namespace {
std::atomic<int64_t> counters[2][6];  // per channel, TransferStats' fields in order
}  // namespace

TransferStats transfer_stats(Channel channel) {
  const auto& c = counters[static_cast<int>(channel)];
  return {c[0].load(), c[1].load(), c[2].load(), c[3].load(), c[4].load(), c[5].load()};
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

void count_transfer(Channel channel, int64_t nanoseconds) {
  auto& c = counters[static_cast<int>(channel)];
  c[0].fetch_add(1, std::memory_order_relaxed);
  c[5].fetch_add(nanoseconds, std::memory_order_relaxed);
}

int64_t finish_transfer(Channel channel, std::chrono::steady_clock::time_point start) {
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - start).count();
  count_transfer(channel, ns);
  return ns;
}

std::string micros_text(int64_t nanoseconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f us", static_cast<double>(nanoseconds) / 1e3);
  return text;
}

}  // namespace detail
}  // namespace tensordict
