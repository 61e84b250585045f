#pragma once
// The state behind a Pipe handle (shared with TensorDictServer, which builds pipes from the
// endpoints its listener accepts).

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "wire/pipe_frames.h"
#include "link.h"
#include "tensordict/consolidate.h"
#include "tensordict/pipe/pipe.h"
#include "ucx_listener.h"
#include "ucx_worker.h"

namespace tensordict::pipe::detail {

/// PipeStats' fields as atomics: counted on every message, read by stats().
struct Counters {
  std::atomic<int64_t> sends{0}, schema_sends{0}, recvs{0}, schema_recvs{0}, bytes_sent{0},
      bytes_received{0};
};

struct PipeImpl {
  PipeImpl(PipeOptions options, std::shared_ptr<Worker> worker);
  ~PipeImpl();

  /// The connected endpoint; a listening pipe waits for its client here (bounded).
  std::shared_ptr<Link> endpoint(const char* op);
  /// The connected endpoint, or nullptr while a listening pipe has no client (no wait).
  std::shared_ptr<Link> endpoint_if_connected();
  void close() noexcept;

  /// One send, `send_mu` held: send() and try_send().
  void send_locked(Link& e, const TensorDict& td);
  /// The wait a send's next message may take (send_mu held): the timeout, or what is left
  /// until the send's deadline (PipeSendOptions).
  Millis send_wait() const;
  /// One receive, `recv_mu` held: recv() and try_recv().
  TensorDict recv_locked(Link& e, const std::optional<TensorDict>& td,
                         std::optional<at::Device> device);
  /// Whether send_locked(e, td) would not wait for the peer (Pipe::try_send's conditions).
  Pipe::SendAttempt sends_without_waiting(Link& e, const TensorDict& td, Micros spin);
  void signal_event() const;

  void send_consolidated(Link& e, const TensorDict& td);
  TensorDict recv_consolidated(Link& e, const std::optional<TensorDict>& td,
                               std::optional<at::Device> device);
  void send_uncollated(Link& e, const TensorDict& td);
  TensorDict recv_uncollated(Link& e, std::optional<at::Device> device);

  void send_bytes(Link& e, const void* data, size_t n, const at::Tensor& owner,
                  const char* what);
  /// The first message of a TensorDict (`n` <= 8 bytes at `data`), as a credit send
  /// (Endpoint::send_credit): copied into the credit ring, so send() need not wait for it.
  void send_first(Link& e, const void* data, size_t n, const char* what);
  /// A same-schema TensorDict as one joined message (docs/wire-format.md §6.8): the flag byte
  /// and a copy of the storage (at most kMaxJoinedStorage bytes), as a credit send.
  void send_joined(Link& e, const at::Tensor& storage);
  void send_credit(Link& e, const void* data, size_t n, const at::Tensor& owner, const char* what);
  void recv_bytes(Link& e, void* data, size_t n, const at::Tensor& owner, const char* what);
  // One message moved: this pipe's and the process's counters, and a debug line.
  void counted(Link& e, bool sent, size_t n, const char* what);
  [[noreturn]] void peer_left(Link& e);
  void say_goodbye(Link& e) noexcept;
  void count(std::atomic<int64_t> Counters::*field, int64_t n) {
    (counters.*field).fetch_add(n, std::memory_order_relaxed);
  }

  const PipeOptions options;
  // Declared before the listener and the endpoint, so released after them: they point into it.
  // close() drops all three (calls still running hold their own references), so that a closed
  // pipe keeps no UCX worker, thread or descriptor, healthy or broken. Guarded by event_mu.
  std::shared_ptr<Worker> worker;
  std::shared_ptr<Listener> listener;  // listening pipes only; guarded by ep_mu
  int port = 0;

  mutable std::mutex ep_mu;  // guards ep (set by connect or by the first accept, reset by close)
  std::shared_ptr<Link> ep;
  std::string closed_peer;    // ep's peer() and peer_info().ours, kept by close() (ep_mu)
  bool closed_peer_ours = false;
  std::atomic<bool> closed{false};
  // The pipe carries a publication (src/pipe/publication.cpp): send() and recv() refuse.
  std::atomic<bool> publication{false};
  std::atomic<bool> peer_closed{false};  // the peer's close marker was read

  std::mutex send_mu;  // one send at a time; guards the send state below
  at::Tensor send_scratch;  // 16 bytes: the flag byte and the length, never reallocated
  // max_unreceived + 1 slots of 8 bytes for the first messages in flight: the slot of the next
  // one was used by a message the window no longer holds.
  at::Tensor credit_ring;
  int64_t credits_sent = 0;
  at::Tensor joined_staging;  // 1 + kMaxJoinedStorage bytes: send_joined's copy
  bool sent_once = false;
  bool at_message_boundary = true;  // false after a raw or failed send: no close marker then
  std::shared_ptr<const Metadata> last_sent_metadata;
  std::string last_sent_schema;
  std::optional<Clock::time_point> send_deadline;  // the running send's (PipeSendOptions)

  std::mutex recv_mu;  // one recv at a time; guards the receive state below
  FrameReader reader;  // the framing and the receive state (the last schema and its storage)

  Counters counters;
  std::atomic<int64_t> last_recv_bytes{0};

  // Event loops' wake-up (Pipe::event_fd): made on first use, watched on the worker while
  // `watchers` > 0; closed by close(), or by the last unwatch after it.
  mutable std::mutex event_mu;  // guards the fd, `watchers` and `worker`
  std::atomic<int> event_fd{-1};
  std::atomic<int> watchers{0};
};

/// The state behind a Pipe, for the library's own classes built on pipes.
struct PipeAccess {
  static const std::shared_ptr<PipeImpl>& impl(const Pipe& pipe) { return pipe.impl_; }
};

/// One send() or recv(): counted in the process's pipe channel when done() and logged at info
/// (transfer_stats.h, log.h).
class Transfer {
 public:
  Transfer(PipeImpl& pipe, Link& e, bool sent);
  void done() const;
  /// Bytes moved in its direction since it began, framing included.
  int64_t bytes() const;

 private:
  PipeImpl& pipe_;
  Link& e_;
  const bool sent_;
  const int64_t start_;     // transfer_ticks()
  const int64_t bytes_;    // the pipe's byte counter when the call began
  const int64_t schemas_;  // and its schema counter
};

/// Logs (info) a connection made or accepted, with the UCX transports it uses.
void log_connected(Link& e, const char* how);

}  // namespace tensordict::pipe::detail
