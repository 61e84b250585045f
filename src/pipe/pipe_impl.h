#pragma once
// The state behind a Pipe handle and its invariants (src/pipe/pipe_impl.cpp); Pipe forwards
// each call here in one line (src/pipe/pipe.cpp). TensorDictServer makes pipes from the
// endpoints its listener accepts, publication (src/pipe/publication.cpp) takes a pipe's link.

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "connection.h"
#include "tensordict/pipe/pipe.h"
#include "ucx_listener.h"
#include "ucx_worker.h"
#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {

/// PipeStats' fields as atomics: counted on every message, read by stats().
struct Counters {
  std::atomic<int64_t> sends{0}, schema_sends{0}, recvs{0}, schema_recvs{0}, bytes_sent{0},
      bytes_received{0};
  void add(std::atomic<int64_t> Counters::* field, int64_t n) {
    (this->*field).fetch_add(n, std::memory_order_relaxed);
  }
};

/// One pipe end. Invariants: one send and one receive at a time (each under its mutex, which
/// guards that direction's state); the link, once set (connected, or a listening pipe's first
/// client), changes only to none, by close(); a closed pipe keeps no link, worker, thread or
/// descriptor; a close marker goes only at a message boundary, to a peer of ours.
class PipeImpl {
 public:
  /// A listening pipe: its first client is accepted by the first call that needs it.
  PipeImpl(PipeOptions options, std::shared_ptr<Worker> worker, std::shared_ptr<Listener> listener);
  /// A connected pipe over `link` (`worker` null for a caller's link); `port`: the peer's.
  PipeImpl(PipeOptions options, std::shared_ptr<Worker> worker, std::shared_ptr<Connection> link,
           int port);
  ~PipeImpl();
  PipeImpl(const PipeImpl&) = delete;
  PipeImpl& operator=(const PipeImpl&) = delete;

  // Pipe's calls (tensordict/pipe/pipe.h says what each does).
  void send(const TensorDict& td, const PipeSendOptions& send_options);
  Pipe::SendAttempt try_send(const TensorDict& td, Micros spin);
  TensorDict recv(const std::optional<TensorDict>& td, std::optional<at::Device> device);
  std::optional<TensorDict> try_recv(Pipe::RecvAttempt* attempt,
                                     const std::optional<TensorDict>& td,
                                     std::optional<at::Device> device, Micros spin);
  bool recv_ready(Micros spin);
  void accept() { link("accept"); }
  void close() noexcept;
  bool closed() const { return closed_.load(); }
  bool peer_closed() const { return peer_closed_.load(); }
  int port() const { return port_; }
  std::string peer() const;
  std::string transports() const;
  bool peer_is_tensordict_cpp() const;
  const PipeOptions& options() const { return options_; }
  PipeStats stats() const;
  int64_t last_recv_bytes() const { return last_recv_bytes_.load(); }
  int event_fd();
  void watch(bool on);
  void send_raw(const void* data, size_t n);
  std::string recv_raw(size_t n);

  /// The connected link for a publication (src/pipe/publication.cpp), its client accepted
  /// (bounded); carry_publication() then makes send() and recv() refuse.
  std::shared_ptr<Connection> publication_connection(const char* call) { return link(call); }
  void carry_publication() { publication_ = true; }

  // For ConnectionSource (the FrameReader's messages) and Transfer (the counters and the log).
  void recv_bytes(Connection& e, void* data, size_t n, const at::Tensor& owner, const char* what);
  void counted(Connection& e, bool sent, size_t n, const char* what);
  [[noreturn]] void peer_left(Connection& e);
  Counters& counters() { return counters_; }

 private:
  /// The connected link; a listening pipe waits for its client here (bounded). `op` names the
  /// call in errors.
  std::shared_ptr<Connection> link(const char* op);
  /// The connected link, or nullptr while a listening pipe has no client (no wait).
  std::shared_ptr<Connection> link_if_connected();
  /// One send, send_mu_ held: send() and try_send().
  void send_locked(Connection& e, const TensorDict& td);
  /// One receive, recv_mu_ held: recv() and try_recv().
  TensorDict recv_locked(Connection& e, const std::optional<TensorDict>& td,
                         std::optional<at::Device> device);
  /// The wait a send's next message may take (send_mu_ held): the timeout, or what is left
  /// until the send's deadline (PipeSendOptions).
  Millis send_wait() const;
  void send_frame(Connection& e, const OutFrame& f);
  /// A TensorDict's first message, as a credit send (Connection::send_credit): one of at most 8
  /// bytes is copied into the credit ring first, so send() need not wait for it.
  void send_first(Connection& e, const OutFrame& f);
  void say_goodbye(Connection& e) noexcept;
  void signal_event() const;

  const PipeOptions options_;
  // Declared before the listener and the link, so released after them: they point into it.
  // close() drops all three (calls still running hold their own references). Guarded by
  // event_mu_.
  std::shared_ptr<Worker> worker_;
  std::shared_ptr<Listener> listener_;  // listening pipes only; guarded by ep_mu_
  int port_ = 0;

  mutable std::mutex ep_mu_;  // guards ep_ (set at construction or by the first accept, reset
                              // by close) and what close() keeps of it
  std::shared_ptr<Connection> ep_;
  std::string closed_peer_;
  bool closed_peer_ours_ = false;
  std::atomic<bool> closed_{false};
  std::atomic<bool> peer_closed_{false};  // the peer's close marker was read
  std::atomic<bool> publication_{false};  // carries a publication: send() and recv() refuse

  std::mutex send_mu_;  // one send at a time; guards the send state below
  FrameWriter writer_;  // the framing and the schema last sent
  // max_unreceived + 1 slots of 8 bytes for the first messages in flight: the slot of the next
  // one was used by a message the window no longer holds.
  at::Tensor credit_ring_;
  int64_t credits_sent_ = 0;
  bool at_message_boundary_ = true;  // false after a raw or failed send: no close marker then
  std::optional<Clock::time_point> send_deadline_;  // the running send's (PipeSendOptions)

  std::mutex recv_mu_;  // one recv at a time; guards the receive state below
  FrameReader reader_;  // the framing and the receive state (the last schema and its storage)

  Counters counters_;
  std::atomic<int64_t> last_recv_bytes_{0};

  // Event loops' wake-up (Pipe::event_fd): made on first use, watched on the worker while
  // `watchers_` > 0; closed by close(), or by the last unwatch after it.
  mutable std::mutex event_mu_;  // guards the fd, `watchers_` and `worker_`
  std::atomic<int> event_fd_{-1};
  std::atomic<int> watchers_{0};
};

/// The state behind a Pipe, for the library's own classes built on pipes (the server, which
/// makes them; publication, which takes their links).
struct PipeAccess {
  static Pipe make(std::shared_ptr<PipeImpl> impl) { return Pipe(std::move(impl)); }
  static PipeImpl& impl(const Pipe& pipe) { return *pipe.impl_; }
  static std::weak_ptr<PipeImpl> weak(const Pipe& pipe) { return pipe.impl_; }
};

/// One send() or recv(): counted in the process's pipe channel when done() and logged at info
/// (transfer_stats.h, log.h).
class Transfer {
 public:
  Transfer(PipeImpl& pipe, Connection& e, bool sent);
  void done() const;
  /// Bytes moved in its direction since it began, framing included.
  int64_t bytes() const;

 private:
  PipeImpl& pipe_;
  Connection& e_;
  const bool sent_;
  const int64_t start_;    // transfer_ticks()
  const int64_t bytes_;    // the pipe's byte counter when the call began
  const int64_t schemas_;  // and its schema counter
};

/// Logs (info) a connection made or accepted, with the UCX transports it uses.
void log_connected(Connection& e, const char* how);

}  // namespace tensordict::pipe::detail
