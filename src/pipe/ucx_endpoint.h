#pragma once
// A connected UCP endpoint of the pipe, speaking ucxx's endpoint protocol (docs/wire-format.md
// §6.6): a 16-byte peer-info exchange over the stream API when a connection opens, then one UCP
// tag message per frame, tagged with the tag the peer announced. Made by connect() or by a
// listener (ucx_listener.h) on a shared worker (ucx_worker.h); the pipe sees it as a Connection.

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

#include "connection.h"
#include "tensordict/pipe/pipe.h"
#include "ucx_worker.h"
#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {

// How long teardown steps (flush, close) may take: they wait for local UCX state and a healthy
// peer, so seconds mean something is badly wrong.
inline constexpr Millis kTeardownGrace{5000};

/// What a peer may leave at an endpoint unread (docs/pipe.md, "Limits and safety"): messages
/// that arrived before a receive took them, charged as UnreadCharge says, at most
/// `max_unread_bytes` together; and no single message longer than `max_message_bytes`.
struct UnreadLimits {
  size_t max_unread_bytes = size_t{64} << 20;
  size_t max_message_bytes = SIZE_MAX;
  /// A pipe's: PipeOptions::max_unread_bytes; the longest message any of its receives takes
  /// (the larger of its storage and metadata limits, or half the physical memory), plus slack.
  static UnreadLimits of(const PipeOptions& options);
};

/// What an unread message is charged against UnreadLimits::max_unread_bytes.
struct UnreadCharge {
  /// Above this length UCX may send a message by rendezvous: its bytes wait at the sender
  /// until a receive is posted for it (UCX's eager protocol goes up to about 267 KiB over TCP
  /// with the pipe's 256 KiB segments, docs/pipe.md "Speed").
  static constexpr size_t kEagerBytes = size_t{256} << 10;
  /// What UCX spends on a message beyond its bytes (its descriptor): about 4 KiB measured for
  /// 1 KiB to 200 KB messages over TCP, and a little more than 1/16 of the length as it grows.
  static constexpr size_t kOverhead = size_t{4} << 10;
  static size_t of(size_t length) { return length + length / 16 + kOverhead; }
};

/// A connected UCP endpoint (error mode "peer": a peer that leaves fails its operations) with
/// ucxx's tags. Sends go to the peer's tag; receives match this endpoint's own tag on the
/// shared worker. Blocking methods may be called from any thread, never from a callback.
///
/// Unread messages: the worker hands the endpoint every message to its tag that arrived before
/// a receive matched it (Inbox), and the endpoint keeps them in order, unreceived (UCX keeps
/// their bytes), in its stash, which every receive reads first. Each is charged (UnreadCharge):
/// its length plus UCX's overhead, except the oldest one longer than kEagerBytes, charged the
/// overhead only, since it may be a rendezvous, whose bytes stay at the sender (a peer of ours,
/// or ucxx's, has at most one in flight: its send waits for it). Beyond
/// UnreadLimits::max_unread_bytes, or for a message over UnreadLimits::max_message_bytes, the
/// endpoint breaks (MalformedPeerDataError naming the limit) and drops what it held.
class Endpoint final : public Connection, public Inbox {
 public:
  Endpoint(std::shared_ptr<Worker> worker, std::string peer, const UnreadLimits& limits);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  /// Connects to host:port, then exchanges the peer info (receiving first, as ucxx's
  /// connecting side does); waits up to `timeout`. RuntimeError when refused or on timeout.
  static std::shared_ptr<Endpoint> connect(std::shared_ptr<Worker> worker, const std::string& host,
                                           int port, Millis timeout, const UnreadLimits& limits);

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

  /// A message of the peer's is waiting unreceived (in the stash, where the worker puts it), or
  /// the endpoint is unusable; progresses the worker for up to `spin` until then.
  bool recv_would_not_wait(Micros spin) override;
  /// Looks ahead (Connection::look_ahead): the stash's messages are received into buffers of their
  /// own, in order, while those hold at most `stash_limit` bytes; recv() and recv_joined() read
  /// them first. A message over the limit stays unreceived, for the receive that posts its
  /// buffer.
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

  /// Inbox: a message of the peer's that no receive matched (the worker's collect_locked).
  void arrived_locked(ucp_tag_message_h message, size_t length) override;

 private:
  friend class Listener;
  enum class Dir { kSend, kSyncSend, kRecv, kRecvJoined, kStreamSend, kStreamRecv, kFlush, kClose };
  // A message of the peer's that no receive has taken yet: still UCX's (`message`), or received
  // (landing, then landed) into `data` by a look-ahead (`op`).
  struct Stashed {
    ucp_tag_message_h message = nullptr;
    std::shared_ptr<Op> op;
    at::Tensor data;
    size_t length = 0;
    size_t charge = 0;  // against max_unread_bytes
  };
  // A joined receive's first byte: where it goes, and what keeps that alive.
  struct Head {
    uint8_t* data;
    const at::Tensor& owner;
  };
  // Posts an operation (UCX lock held); `then` runs when it completes. kRecvJoined receives 1
  // byte into `head`, the rest into `data`; a tag receive with a `message` receives that one (a
  // stashed one) instead of matching the next.
  std::shared_ptr<Op> start(Dir dir, void* data, size_t n, const at::Tensor& owner,
                            std::function<void(ucs_status_t, size_t)> then = {},
                            const Head* head = nullptr, ucp_tag_message_h message = nullptr);
  // The i-th message not yet handed to a receive, received into the stash if it fits the
  // look-ahead's `stash_limit` (UCX lock held).
  Peeked peek_locked(size_t i, size_t stash_limit);
  // Receives stashed message `s` into a buffer of the stash's own (UCX lock held).
  void land_locked(Stashed& s);
  // The oldest stashed message, handed to a receive into `data` (and `head`): a message still
  // UCX's is received straight into them, a landed one copied once it has landed (UCX lock).
  std::shared_ptr<Op> take_stashed_locked(Dir dir, void* data, size_t n, const at::Tensor& owner,
                                          const Head* head);
  // The charge of the oldest message over kEagerBytes left in the stash, recomputed after it
  // changed (UCX lock held).
  void recharge_locked();
  // Breaks the endpoint with MalformedPeerDataError as what later calls throw (UCX lock held).
  void refuse_locked(const std::string& why);
  // Drops the stash (UCX lock held): this end closed or broke.
  void drop_stash_locked();
  // Posts a tag receive (kRecv or kRecvJoined), the stash's oldest message first, if the
  // endpoint can still receive (UCX lock taken here).
  std::shared_ptr<Op> post_recv(Dir dir, void* data, size_t n, const at::Tensor& owner,
                                const char* what, const Head* head = nullptr);
  // Waits for `op`, which moves `n` bytes (a joined receive: 1 or `n`).
  void wait_op(const std::shared_ptr<Op>& op, Dir dir, size_t n, const char* what, Millis timeout);
  void create_locked(const ucp_ep_params_t& params);
  void force_close_locked();
  void break_locked(const std::string& why);
  [[noreturn]] void throw_unusable(const char* op_name, const char* what);
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  std::shared_ptr<Worker> worker_;
  std::string peer_;
  PeerInfo peer_info_;
  uint64_t recv_tag_ = 0;  // ours, announced to the peer
  const UnreadLimits limits_;

  // UCX lock:
  ucp_ep_h ep_ = nullptr;
  std::string failure_;     // why the endpoint broke (peer error, timeout); "" when healthy
  bool malformed_ = false;  // it broke on the peer's data: later calls throw MalformedPeerDataError
  bool closed_ = false;
  bool peer_gone_ = false;
  // What a task deferred by on_error holds instead of the endpoint (see there).
  std::shared_ptr<Endpoint*> token_ = std::make_shared<Endpoint*>(this);
  std::vector<std::shared_ptr<Op>> recvs_;  // posted receives (cancelled when it breaks)
  std::deque<Stashed> stash_;               // the peer's unread messages, oldest first
  size_t landed_bytes_ = 0;  // the lengths of those received into the stash (look-ahead)
  size_t unread_bytes_ = 0;  // the charges of all (UnreadLimits::max_unread_bytes)
  at::Tensor spare_;         // a small message's stash buffer, reused once its last user is done
  std::deque<std::shared_ptr<Op>> credits_;  // credit sends not yet matched by the peer
  uint64_t credit_count_ = 0;                // first frames sent (the send thread's)
  at::Tensor handshake_;                     // 32 bytes: our peer info, then the peer's
};

}  // namespace tensordict::pipe::detail
