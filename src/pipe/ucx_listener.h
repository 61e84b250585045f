#pragma once
// A UCP listener of the pipe: it accepts connection requests and runs ucxx's peer-info exchange
// on them from the worker's callbacks, then hands out connected endpoints (ucx_endpoint.h).
// Used by listening pipes (one client) and by TensorDictServer (many).

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "link.h"
#include "ucx_endpoint.h"
#include "ucx_worker.h"

namespace tensordict::pipe::detail {

/// A UCP listener. Connection requests are accepted, and their peer-info exchange run, by the
/// worker's callbacks as they arrive (so a client's connect() completes even while nobody
/// waits in accept()); accept() hands the connected endpoints out.
class Listener : public std::enable_shared_from_this<Listener> {
 public:
  /// Binds host:port (port 0: a free one). `max_clients` > 0: later requests are rejected.
  /// `options`: the accepted pipes' (their endpoints' limits).
  static std::shared_ptr<Listener> create(std::shared_ptr<Worker> worker, const std::string& host,
                                          int port, int max_clients, const PipeOptions& options);
  ~Listener();

  int port() const { return port_; }
  /// The next connected endpoint; nullptr when `timeout` passes or the listener is closed.
  std::shared_ptr<Endpoint> accept(Millis timeout);
  /// Destroys the UCX listener and closes the endpoints not handed out. Idempotent.
  void close(Millis timeout) noexcept;
  int64_t accepted() const { return accepted_.load(); }

 private:
  Listener(std::shared_ptr<Worker> worker, int max_clients, const UnreadLimits& limits)
      : worker_(std::move(worker)), max_clients_(max_clients), limits_(limits) {}
  static void on_conn_request(ucp_conn_request_h request, void* arg);
  void accept_locked(ucp_conn_request_h request);
  void handshake_done_locked(const std::shared_ptr<Endpoint>& ep, ucs_status_t status);

  std::mutex close_mu_;             // guards worker_ for accept(), which runs without the UCX lock
  std::shared_ptr<Worker> worker_;  // null once closed
  const int max_clients_;
  const UnreadLimits limits_;
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

}  // namespace tensordict::pipe::detail
