#pragma once
// A connected UCP endpoint of the pipe, speaking ucxx's endpoint protocol (docs/wire-format.md
// §6.6): a 16-byte peer-info exchange over the stream API when a connection opens, then one UCP
// tag message per frame, tagged with the tag the peer announced. Made by connect() or by a
// listener (ucx_listener.h) on a shared worker (ucx_worker.h); the pipe sees it as a Link.

#include <ucp/api/ucp.h>

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "link.h"
#include "ucx_worker.h"
#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {

// How long teardown steps (flush, close) may take: they wait for local UCX state and a healthy
// peer, so seconds mean something is badly wrong.
inline constexpr Millis kTeardownGrace{5000};

/// A connected UCP endpoint (error mode "peer": a peer that leaves fails its operations) with
/// ucxx's tags. Sends go to the peer's tag; receives match this endpoint's own tag on the
/// shared worker. Blocking methods may be called from any thread, never from a callback.
class Endpoint final : public Link {
 public:
  Endpoint(std::shared_ptr<Worker> worker, std::string peer);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  /// Connects to host:port, then exchanges the peer info (receiving first, as ucxx's
  /// connecting side does); waits up to `timeout`. RuntimeError when refused or on timeout.
  static std::shared_ptr<Endpoint> connect(std::shared_ptr<Worker> worker, const std::string& host,
                                           int port, Millis timeout);

  /// Sends one tag message of `n` bytes at `data` (owned by `owner`) and waits until UCX is
  /// done with the buffer. `what` names the message for errors. A timeout breaks the endpoint.
  void send(const void* data, size_t n, const at::Tensor& owner, const char* what,
            Millis timeout) override;
  /// The first frame of a TensorDict, the flow control of docs/pipe.md: at most `window` of
  /// them may be unreceived by the peer. Some are sent synchronously (they complete once the
  /// peer has matched them: the caller keeps them alive in `owner`) and this returns at once;
  /// when too many of those are in flight it waits, up to `timeout`, for the oldest
  /// (TimeoutError, the endpoint intact: nothing was sent).
  void send_credit(const void* data, size_t n, const at::Tensor& owner, const char* what,
                   size_t window, Millis timeout) override;
  // send_credit's schedule: one first frame in `every` is a credit, at most `credits` of them in
  // flight.
  struct CreditPlan {
    size_t every, credits;
    explicit CreditPlan(size_t window);
  };
  /// Receives one tag message of exactly `n` bytes into `data`. A timeout breaks the endpoint;
  /// a message of another size is an error (MalformedPeerDataError) that breaks it too.
  void recv(void* data, size_t n, const at::Tensor& owner, const char* what,
            Millis timeout) override;
  bool joins_frames() const override { return peer_info_.joins_frames(); }
  /// One tag message of 1 or 1 + `n` bytes, scattered over `head` and `data` (a UCP IOV).
  size_t recv_joined(uint8_t* head, const at::Tensor& head_owner, void* data, size_t n,
                     const at::Tensor& owner, const char* what, Millis timeout) override;

  /// Publication's messages (src/pipe/publication.cpp), each posted, then waited on apart: a
  /// wait that gives up leaves the message posted and the endpoint as it was. A `sync` send
  /// completes once the peer has matched it. Throws as send()/recv() when the endpoint is
  /// unusable.
  std::shared_ptr<Op> post_message(bool recv, bool sync, void* data, size_t n,
                                   const at::Tensor& owner, const char* what);
  /// Waits until `op` (from post_message) completes, true, or `deadline` passes, false (still
  /// posted). A failed one throws as send()/recv() do: PeerLostError, PipeClosedError, and
  /// MalformedPeerDataError for a message longer than its buffer (which breaks the endpoint).
  bool wait_message(const std::shared_ptr<Op>& op, Clock::time_point deadline, bool recv,
                    const char* what);

  /// A tag message for this endpoint is waiting unreceived (ucp_tag_probe_nb), or the endpoint
  /// is unusable; progresses the worker for up to `spin` until then.
  bool recv_would_not_wait(Micros spin) override;
  /// Looks ahead (Link::look_ahead): messages are taken off the worker's unexpected queue
  /// (ucp_tag_probe_nb, removing them) and received into a stash of their own, in order, while
  /// the stash holds at most `stash_limit` bytes; recv() and recv_joined() read the stash first.
  /// A message over the limit stays in UCX's queue, for the receive that posts its buffer.
  Arrival look_ahead(const std::function<Arrival(MessagePeek&)>& decide, size_t stash_limit,
                     Micros spin) override;
  bool credit_available(size_t window, Micros spin) override;
  /// Waits up to `timeout` until every credit send has been received by the peer.
  bool drain(Millis timeout) override;
  /// Flushes and closes (bounded), then force-closes; idempotent, never throws. Pending calls
  /// fail.
  void close(Millis timeout) noexcept override;
  bool closed() const;
  /// The peer left or failed (UCX reported an error on the endpoint).
  bool peer_gone() const override;
  /// Breaks the endpoint on purpose (the message stream is out of step): records `why`,
  /// force-closes.
  void fail(const std::string& why) override;
  const std::string& peer() const override { return peer_; }
  const PeerInfo& peer_info() const override { return peer_info_; }
  /// The UCX transports of the endpoint's lanes ("tcp/lo, posix/memory, ..."), "" if unknown.
  std::string transports() override;

 private:
  friend class Listener;
  enum class Dir {
    kSend,
    kSyncSend,
    kRecv,
    kRecvJoined,
    kRecvMessage,
    kStreamSend,
    kStreamRecv,
    kFlush,
    kClose
  };
  // A message taken off UCX's queue by a look-ahead, received (or landing) into `data`.
  struct Stashed {
    std::shared_ptr<Op> op;
    at::Tensor data;
    size_t length = 0;
  };
  // A joined receive's first byte: where it goes, and what keeps that alive.
  struct Head {
    uint8_t* data;
    const at::Tensor& owner;
  };
  // Posts an operation (UCX lock held); `then` runs when it completes. kRecvJoined receives 1
  // byte into `head`, the rest into `data`; kRecvMessage receives `message` (a probed one).
  std::shared_ptr<Op> start(Dir dir, void* data, size_t n, const at::Tensor& owner,
                            std::function<void(ucs_status_t, size_t)> then = {},
                            const Head* head = nullptr, ucp_tag_message_h message = nullptr);
  // The i-th message not yet handed to a receive, stashing up to it (UCX lock held).
  Peeked peek_locked(size_t i, size_t stash_limit);
  // The oldest stashed message, taken out of the stash (nullopt when empty); throws when the
  // endpoint is closed or broken.
  std::optional<Stashed> take_stashed(const char* what);
  // Drops the stash (UCX lock held): this end closed or broke.
  void drop_stash_locked();
  // Posts a tag receive (kRecv or kRecvJoined) if the endpoint can still receive (UCX lock
  // taken here).
  std::shared_ptr<Op> post_recv(Dir dir, void* data, size_t n, const at::Tensor& owner,
                                const char* what, const Head* head = nullptr);
  // Waits for `op`, which moves `n` bytes (a joined receive: 1 or `n`).
  void wait_op(const std::shared_ptr<Op>& op, Dir dir, size_t n, const char* what, Millis timeout);
  void create_locked(const ucp_ep_params_t& params);
  void force_close_locked();
  void break_locked(const std::string& why);
  void discard_unread_locked();
  [[noreturn]] void throw_unusable(const char* op_name, const char* what);
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  std::shared_ptr<Worker> worker_;
  std::string peer_;
  PeerInfo peer_info_;
  uint64_t recv_tag_ = 0;  // ours, announced to the peer

  // UCX lock:
  ucp_ep_h ep_ = nullptr;
  std::string failure_;  // why the endpoint broke (peer error, timeout); "" when healthy
  bool closed_ = false;
  bool peer_gone_ = false;
  std::vector<std::shared_ptr<Op>> recvs_;  // posted receives (cancelled when it breaks)
  std::deque<Stashed> stash_;               // look-ahead's messages, oldest first
  size_t stash_bytes_ = 0;                  // their lengths' sum
  at::Tensor spare_;  // a small message's stash buffer, reused once its last user is done
  std::deque<std::shared_ptr<Op>> credits_;  // credit sends not yet matched by the peer
  uint64_t credit_count_ = 0;                // first frames sent (the send thread's)
  at::Tensor handshake_;                     // 32 bytes: our peer info, then the peer's
};

}  // namespace tensordict::pipe::detail
