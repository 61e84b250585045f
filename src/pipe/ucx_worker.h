#pragma once
// The UCX layer of the pipe: a worker, its endpoints and listeners, speaking ucxx's endpoint
// protocol (docs/wire-format.md §6.6): a 16-byte peer-info exchange over the stream API when a
// connection opens, then one UCP tag message per frame, tagged with the tag the peer announced.
//
// Threads: every UCX call is made with the worker's UCX lock held (UCS_THREAD_MODE_SERIALIZED).
// A thread that waits for an operation progresses the worker itself for a bounded time (the
// spin), so a small message costs no thread wake-up; after that it sleeps, and the worker's
// progress thread drives UCX from the worker's event fd. The progress thread also serves
// connection requests and handshakes while nobody waits. Callbacks only record a status,
// notify, and queue follow-up work (defer); they never throw.

#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "frames.h"
#include "link.h"

namespace tensordict::pipe::detail {

using Clock = std::chrono::steady_clock;
using Micros = std::chrono::microseconds;

/// One UCX operation. UCX completes it from a callback on whichever thread progresses the
/// worker; `status` and `length` are written before `done` is set.
struct Op {
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  size_t length = 0;
  at::Tensor owner;          // keeps the buffer alive until UCX is done with it
  at::Tensor head_owner;     // and the head's, for a joined receive
  ucp_dt_iov_t iov[2]{};     // a joined receive's buffers (UCX reads them until it completes)
  void* request = nullptr;   // the UCX request while in flight (UCX lock)
  // Run (deferred, UCX lock held) with the status and length once the operation completes.
  std::function<void(ucs_status_t, size_t)> then;
};

/// What a request's completion callback needs: the operation (alive until UCX calls back, even
/// when the waiting thread gave up) and the worker to notify. Linked into the worker's list of
/// outstanding requests (UCX lock) until the callback frees it.
struct CallbackContext {
  std::shared_ptr<Op> op;
  class Worker* worker;
  CallbackContext* prev = nullptr;
  CallbackContext* next = nullptr;
};

/// A UCP context and worker, the UCX lock, and the progress thread. Shared (shared_ptr) by the
/// pipes, endpoints and listeners made on it; the last reference joins the thread and releases
/// UCX, so it must not be dropped inside a UCX callback.
class Worker {
 public:
  /// `spin`: how long a waiting thread progresses UCX itself before it sleeps.
  static std::shared_ptr<Worker> create(Micros spin);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// The UCX lock. Held for every UCX call and for the state that callbacks change.
  std::unique_lock<std::recursive_mutex> lock() { return std::unique_lock(ucx_mu_); }
  ucp_worker_h handle() const { return worker_; }  // UCX lock

  /// Queues `task` to run with the UCX lock held, after the progress call in which a callback
  /// asked for it (UCX calls are not made from inside callbacks). UCX lock.
  void defer(std::function<void()> task) { deferred_.push_back(std::move(task)); }

  /// Waits until `ready()` or `deadline`: progresses UCX for up to the spin, then sleeps until
  /// notify(). Returns ready(). `ready` is called without the UCX lock.
  bool wait_until(const std::function<bool()>& ready, Clock::time_point deadline);
  /// Progresses UCX from this thread, at least once, until `ready()` (called with the UCX lock
  /// held, so it may look at UCX), or until UCX has had nothing to do for `spin`, or
  /// `deadline`; never sleeps. Returns ready(). The progress thread stands aside meanwhile and
  /// is resumed when this returns false. wait_until's spin.
  bool spin_until(const std::function<bool()>& ready, Micros spin, Clock::time_point deadline);
  bool wait(const Op& op, Clock::time_point deadline) {
    return wait_until([&] { return op.done.load(); }, deadline);
  }
  /// Wakes the threads sleeping in wait_until (callbacks call it after completing something).
  void notify();

  /// Event loops' wake-ups (Pipe::event_fd): while watched, the eventfd `fd` is written after
  /// every progress call that did something (a message arrived, an operation completed), so
  /// that a loop waiting on it looks again. Thread-safe.
  void watch(int fd);
  void unwatch(int fd);

  /// Completes `op` (from a callback or an immediate completion) and notifies. UCX lock.
  void complete(Op& op, ucs_status_t status, size_t length);
  /// Links / unlinks and deletes the context of an outstanding request (UCX lock).
  void adopt(CallbackContext* ctx);
  void release(CallbackContext* ctx);

 private:
  explicit Worker(Micros spin) : spin_(spin) {}
  bool progress_locked();
  void loop();
  void wake_loop();

  const Micros spin_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int ucp_fd_ = -1;   // the worker's event fd (UCP_FEATURE_WAKEUP)
  int wake_fd_ = -1;  // our eventfd: wakes the progress thread from poll()

  std::recursive_mutex ucx_mu_;
  std::vector<std::function<void()>> deferred_;  // UCX lock
  // Requests UCX has not called back yet (UCX lock). One still outstanding when the worker is
  // destroyed (a close that timed out on a peer that stopped reading) never will be: its
  // context, with the operation and the buffer it holds, is freed then.
  CallbackContext* outstanding_ = nullptr;

  std::mutex watch_mu_;
  std::vector<int> watched_;              // watch_mu_
  std::atomic<int> watched_count_{0};     // watched_.size(), read on every progress
  void signal_watchers();

  std::atomic<int> spinners_{0};  // threads progressing UCX in wait_until
  std::atomic<int> sleepers_{0};  // threads asleep in wait_until
  std::mutex cv_mu_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

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
  static std::shared_ptr<Endpoint> connect(std::shared_ptr<Worker> worker,
                                           const std::string& host, int port, Millis timeout);

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

  /// A tag message for this endpoint is waiting unreceived (ucp_tag_probe_nb), or the endpoint
  /// is unusable; progresses the worker for up to `spin` until then.
  bool recv_would_not_wait(Micros spin) override;
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
  enum class Dir { kSend, kSyncSend, kRecv, kRecvJoined, kStreamSend, kStreamRecv, kFlush,
                   kClose };
  // A joined receive's first byte: where it goes, and what keeps that alive.
  struct Head {
    uint8_t* data;
    const at::Tensor& owner;
  };
  // Posts an operation (UCX lock held); `then` runs when it completes. kRecvJoined receives 1
  // byte into `head`, the rest into `data`.
  std::shared_ptr<Op> start(Dir dir, void* data, size_t n, const at::Tensor& owner,
                            std::function<void(ucs_status_t, size_t)> then = {},
                            const Head* head = nullptr);
  // Posts a tag receive (kRecv or kRecvJoined) if the endpoint can still receive (UCX lock
  // taken here).
  std::shared_ptr<Op> post_recv(Dir dir, void* data, size_t n, const at::Tensor& owner,
                                const char* what, const Head* head = nullptr);
  // Waits for `op`, which moves `n` bytes (a joined receive: 1 or `n`).
  void wait_op(const std::shared_ptr<Op>& op, Dir dir, size_t n, const char* what,
               Millis timeout);
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
  std::vector<std::shared_ptr<Op>> recvs_;     // posted receives (cancelled when it breaks)
  std::deque<std::shared_ptr<Op>> credits_;    // credit sends not yet matched by the peer
  uint64_t credit_count_ = 0;                  // first frames sent (the send thread's)
  at::Tensor handshake_;                       // 32 bytes: our peer info, then the peer's
};

/// A UCP listener. Connection requests are accepted, and their peer-info exchange run, by the
/// worker's callbacks as they arrive (so a client's connect() completes even while nobody
/// waits in accept()); accept() hands the connected endpoints out.
class Listener : public std::enable_shared_from_this<Listener> {
 public:
  /// Binds host:port (port 0: a free one). `max_clients` > 0: later requests are rejected.
  static std::shared_ptr<Listener> create(std::shared_ptr<Worker> worker, const std::string& host,
                                          int port, int max_clients);
  ~Listener();

  int port() const { return port_; }
  /// The next connected endpoint; nullptr when `timeout` passes or the listener is closed.
  std::shared_ptr<Endpoint> accept(Millis timeout);
  /// Destroys the UCX listener and closes the endpoints not handed out. Idempotent.
  void close(Millis timeout) noexcept;
  int64_t accepted() const { return accepted_.load(); }

 private:
  Listener(std::shared_ptr<Worker> worker, int max_clients)
      : worker_(std::move(worker)), max_clients_(max_clients) {}
  static void on_conn_request(ucp_conn_request_h request, void* arg);
  void accept_locked(ucp_conn_request_h request);
  void handshake_done_locked(const std::shared_ptr<Endpoint>& ep, ucs_status_t status);

  std::mutex close_mu_;  // guards worker_ for accept(), which runs without the UCX lock
  std::shared_ptr<Worker> worker_;  // null once closed
  const int max_clients_;
  int port_ = 0;

  // UCX lock:
  ucp_listener_h listener_ = nullptr;
  std::vector<std::shared_ptr<Endpoint>> handshaking_;
  std::deque<std::shared_ptr<Endpoint>> ready_;
  bool closed_ = false;
  std::atomic<int64_t> accepted_{0};
  // What accept() waits on, read without the UCX lock (wait_until's rule).
  std::atomic<int64_t> ready_count_{0};
  std::atomic<bool> closed_flag_{false};
};

/// Resolves host:port to a socket address (numeric or by name); ValueError on failure.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
};
SockAddr resolve(const std::string& host, int port, bool passive);
std::string format_address(const sockaddr_storage& addr);

}  // namespace tensordict::pipe::detail
