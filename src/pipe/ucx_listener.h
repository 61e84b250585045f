#pragma once
// A UCP listener of the pipe: it accepts connection requests and runs ucxx's peer-info exchange
// on them from the worker's callbacks, then hands out connected endpoints (ucx_endpoint.h).
// Used by listening pipes (one client) and by TensorDictServer (many).

#include <sys/types.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "connection.h"
#include "ucx_address.h"
#include "ucx_endpoint.h"
#include "ucx_worker.h"

namespace tensordict::pipe::detail {

/// A UCP listener. Connection requests are accepted, and their peer-info exchange run, by the
/// worker's callbacks as they arrive (so a client's connect() completes even while nobody
/// waits in accept()); accept() hands the connected endpoints out.
///
/// What a client costs before it is handed out is bounded (docs/pipe.md, "Limits and safety"):
/// a TCP connection that brought more bytes than a UCX connection request holds, or has not
/// become one within the pipe's timeout, is reset (UCX's TCP connection manager would hold it,
/// and may spin on it, for ever: docs/pipe.md, "Known UCX issues"); at most kMaxPending such
/// connections, and none while the process's descriptors are within a reserve of RLIMIT_NOFILE,
/// when requests are refused too; a peer-info exchange has the pipe's timeout too. Each
/// refusal is logged (info).
class Listener : public std::enable_shared_from_this<Listener> {
 public:
  /// Binds host:port (port 0: a free one). `max_clients` > 0: later requests are rejected.
  /// `options`: the accepted pipes' (their endpoints' limits, the peer-info exchange's timeout).
  static std::shared_ptr<Listener> create(std::shared_ptr<Worker> worker, const std::string& host,
                                          int port, int max_clients, const PipeOptions& options);
  ~Listener();

  int port() const { return port_; }
  /// The next connected endpoint; nullptr when `timeout` passes or the listener is closed.
  std::shared_ptr<Endpoint> accept(Millis timeout);
  /// Destroys the UCX listener and closes the endpoints not handed out. Idempotent.
  void close(Millis timeout) noexcept;
  int64_t accepted() const { return accepted_.load(); }
  /// Connections reset or requests refused to keep the process whole (see the class comment).
  int64_t refused() const { return refused_.load(); }

  /// Connections not yet requests, at most; the oldest are reset beyond it.
  static constexpr size_t kMaxPending = 64;
  /// Requests whose peer-info exchange is under way, at most; later ones are refused.
  static constexpr size_t kMaxHandshakes = 64;
  /// Endpoints not handed out yet (nobody calls accept), at most; later requests are refused.
  static constexpr size_t kMaxUnclaimed = 1024;

 private:
  Listener(std::shared_ptr<Worker> worker, int max_clients, const PipeOptions& options);
  static void on_conn_request(ucp_conn_request_h request, void* arg);
  void accept_locked(ucp_conn_request_h request);
  void refuse_locked(ucp_conn_request_h request, const std::string& peer, const char* why);
  void handshake_done_locked(const std::shared_ptr<Endpoint>& ep, ucs_status_t status);
  /// The worker's periodic task: the connections of this listener's port that UCX has not made
  /// requests of, reset as the class comment says, and peer-info exchanges past the timeout.
  void sweep();
  void expire_handshakes(Worker& worker);

  std::mutex close_mu_;             // guards worker_ for accept(), which runs without the UCX lock
  std::shared_ptr<Worker> worker_;  // null once closed
  const int max_clients_;
  const UnreadLimits limits_;
  const Millis handshake_timeout_;
  int port_ = 0;
  SockAddr bound_;  // the listening address, as bound

  // UCX lock:
  ucp_listener_h listener_ = nullptr;
  std::vector<std::pair<std::shared_ptr<Endpoint>, Clock::time_point>> handshaking_;
  std::deque<std::shared_ptr<Endpoint>> ready_;
  bool closed_ = false;
  std::atomic<int64_t> accepted_{0};
  std::atomic<int64_t> refused_{0};
  // What accept() waits on, read without the UCX lock (wait_until's rule).
  std::atomic<int64_t> ready_count_{0};
  std::atomic<bool> closed_flag_{false};

  // The connections UCX made requests of, by peer address, and when (requested_mu_): the
  // sweep leaves them to UCX.
  std::mutex requested_mu_;
  std::unordered_map<std::string, Clock::time_point> requested_;
  // The sweep's own (progress thread): connections not yet requests, by socket inode.
  struct Pending {
    Clock::time_point since;
  };
  std::unordered_map<ino_t, Pending> pending_;
  std::atomic<bool> sweeping_{false};  // registered with the worker (create, until close)
};

}  // namespace tensordict::pipe::detail
