#pragma once
// Counters of what this process moved, per channel: the process-group transfers (send, recv,
// their async and consolidated forms, the collectives, init_remote; Gloo or any c10d backend)
// and the UCX pipe. Updated by every transfer, read at any time from any thread.
// docs/observability.md.

#include <cstdint>
#include <string>

namespace tensordict {

enum class Channel { kProcessGroup = 0, kPipe = 1 };

struct TransferStats {
  int64_t transfers = 0;      // completed calls (a send, a recv, a collective, ...)
  int64_t messages_sent = 0;  // messages handed to the transport
  int64_t messages_received = 0;
  int64_t bytes_sent = 0;  // their payload bytes
  int64_t bytes_received = 0;
  int64_t nanoseconds = 0;  // time spent in the completed calls (posting to completion)
};

/// A snapshot of `channel`'s counters since the process started (or the last reset).
TransferStats transfer_stats(Channel channel);
void reset_transfer_stats();
/// "process_group" or "pipe".
const char* channel_name(Channel channel);

namespace detail {
/// Counting, for the transport layers: messages and bytes as they are posted, and a completed
/// call with its duration.
void count_messages(Channel channel, bool sent, int64_t messages, int64_t bytes);
/// The clock that times transfers, in ticks: the CPU's time-stamp counter on x86-64 where it is
/// invariant (a few ns to read, where steady_clock costs about 25 ns on a VM, paid twice by
/// every call of a 1 µs round trip), else steady_clock's nanoseconds.
int64_t transfer_ticks();
/// Counts a call of `channel` that started at `start` (transfer_ticks()) and ends now; returns
/// its duration in ticks.
int64_t finish_transfer(Channel channel, int64_t start);
/// A duration in ticks as the log lines write it: "12.3 us".
std::string micros_text(int64_t ticks);
}  // namespace detail

}  // namespace tensordict
