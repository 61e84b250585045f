#pragma once
// The UCX layer of the pipe: a worker driven by one event-loop thread, the endpoints and
// listeners on it. Every UCX call happens on that thread (the worker is UCS_THREAD_MODE_SINGLE),
// so UCX callbacks and our posting never race; user threads post tasks and wait on condition
// variables with deadlines. Callbacks only record a status and notify: they never throw.

#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace tensordict::pipe::detail {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

/// A UCP context and worker, plus the thread that progresses it. Shared (shared_ptr) by the
/// endpoints and listeners created on it; destroyed (thread joined, UCX released) with the last
/// reference, which must not be dropped on the loop thread itself.
class Worker {
 public:
  static std::shared_ptr<Worker> create();
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues `task` for the loop thread. Tasks must not throw (they are wrapped by call()).
  void post(std::function<void()> task);
  /// Runs `fn` on the loop thread and waits for it (bounded by `timeout`); an exception thrown
  /// by `fn` is rethrown here. RuntimeError on timeout.
  void call(const std::function<void()>& fn, Millis timeout, const char* what);
  bool on_loop_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  ucp_worker_h handle() const { return worker_; }  // loop thread only (and construction)

 private:
  Worker() = default;
  void loop();

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int ucp_fd_ = -1;   // the worker's event fd (UCP_FEATURE_WAKEUP)
  int wake_fd_ = -1;  // our eventfd: post() writes it so the loop leaves poll()
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

/// One stream operation's outcome, guarded by the owning Endpoint's mutex.
struct Op {
  bool done = false;
  ucs_status_t status = UCS_OK;
  size_t length = 0;
  at::Tensor owner;  // keeps the buffer alive until UCX is done with it
};

/// A UCP endpoint with the peer-error handling mode: a peer that disconnects fails pending and
/// later operations promptly. Blocking methods may be called from any thread but the loop's.
class Endpoint : public std::enable_shared_from_this<Endpoint> {
 public:
  Endpoint(Worker* worker, std::string peer) : worker_(worker), peer_(std::move(peer)) {}
  ~Endpoint();

  /// Creates a client endpoint to host:port (on the loop thread) and waits until the
  /// connection is up (a flush completes only after the wireup).
  static std::shared_ptr<Endpoint> connect(Worker* worker, const std::string& host, int port,
                                           Millis timeout);
  /// Loop thread: the endpoint of an accepted connection request.
  static std::shared_ptr<Endpoint> accept_on_loop(Worker* worker, ucp_conn_request_h request);

  /// Sends or receives exactly `n` bytes at `data` (owned by `owner`), waiting up to `timeout`.
  /// `what` names the message for errors. A timeout breaks the endpoint.
  void send(const void* data, size_t n, const at::Tensor& owner, const char* what, Millis timeout);
  void recv(void* data, size_t n, const at::Tensor& owner, const char* what, Millis timeout);

  /// Flushes (bounded), then force-closes; idempotent, never throws. Pending calls fail.
  void close(Millis timeout) noexcept;
  bool closed() const;
  /// Waits up to `timeout` until the endpoint fails (the peer left) or is closed.
  void wait_gone(Millis timeout);
  /// Breaks the endpoint on purpose (the stream is out of step): records `why`, force-closes.
  void fail(const std::string& why);
  const std::string& peer() const { return peer_; }

 private:
  enum class Dir { kSend, kRecv, kFlush, kClose };
  void transfer(Dir dir, void* data, size_t n, const at::Tensor& owner, const char* what,
                Millis timeout);
  void start_on_loop(const std::shared_ptr<Op>& op, Dir dir, void* data, size_t n);
  void finish(Op& op, ucs_status_t status, size_t length);
  void force_close_on_loop();
  void create_on_loop(const ucp_ep_params_t& params);
  [[noreturn]] void throw_unusable(const char* op_name, const char* what);

  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void on_send(void* request, ucs_status_t status, void* user_data);
  static void on_recv(void* request, ucs_status_t status, size_t length, void* user_data);

  Worker* worker_;
  std::string peer_;
  ucp_ep_h ep_ = nullptr;  // loop thread only

  mutable std::mutex mu_;  // guards what follows; never held across a UCX call
  std::condition_variable cv_;
  std::string failure_;  // why the endpoint broke (peer error, timeout); "" when healthy
  bool closed_ = false;
  bool ep_gone_ = false;  // the UCX endpoint is closed (operations can no longer start)

  friend class Listener;
};

/// A UCP listener. Connection requests are accepted on the loop thread as they arrive (so a
/// client's connect() completes even while nobody waits in accept()); accept() hands them out.
class Listener : public std::enable_shared_from_this<Listener> {
 public:
  /// Binds host:port (port 0: a free one). `max_clients` > 0: later requests are rejected.
  static std::shared_ptr<Listener> create(Worker* worker, const std::string& host, int port,
                                          int max_clients, Millis timeout);
  ~Listener();

  int port() const { return port_; }
  /// The next accepted endpoint; nullptr when `timeout` passes or the listener is closed.
  std::shared_ptr<Endpoint> accept(Millis timeout);
  /// Destroys the UCX listener and closes endpoints not yet handed out. Idempotent.
  void close(Millis timeout) noexcept;
  int64_t accepted() const;

 private:
  explicit Listener(Worker* worker, int max_clients) : worker_(worker), max_clients_(max_clients) {}
  static void on_conn_request(ucp_conn_request_h request, void* arg);

  Worker* worker_;
  int max_clients_;
  int port_ = 0;
  ucp_listener_h listener_ = nullptr;  // loop thread only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Endpoint>> ready_;
  int64_t accepted_ = 0;
  bool closed_ = false;
};

/// Resolves host:port to a socket address (numeric or by name); ValueError on failure.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
};
SockAddr resolve(const std::string& host, int port, bool passive);
std::string format_address(const sockaddr_storage& addr);

}  // namespace tensordict::pipe::detail
