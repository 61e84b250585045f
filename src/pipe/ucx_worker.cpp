#include "ucx_worker.h"

#include "tensordict/errors.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

namespace tensordict::pipe::detail {
namespace {

// How long teardown steps (flush, force close, listener destroy) may take: they only wait for
// the loop thread and the local UCX state, so seconds mean something is badly wrong.
constexpr Millis kTeardownGrace{5000};

// How many ucp_worker_progress calls the loop makes before it looks at posted tasks again.
constexpr int kProgressBurst = 64;

void check_ucs(ucs_status_t status, const char* what) {
  TORCH_CHECK(status == UCS_OK, "pipe: ", what, " failed: ", ucs_status_string(status));
}

int64_t to_ms(Millis m) { return static_cast<int64_t>(m.count()); }

// What a completion callback needs: the endpoint and the operation (kept alive until UCX calls
// back, even when the waiting thread gave up).
struct CallbackContext {
  std::shared_ptr<Endpoint> endpoint;
  std::shared_ptr<Op> op;
};

}  // namespace

// ---- Worker -----------------------------------------------------------------------------------

std::shared_ptr<Worker> Worker::create() {
  std::shared_ptr<Worker> w(new Worker());
  ucp_config_t* config = nullptr;
  check_ucs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
  const ucs_status_t st = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  check_ucs(st, "ucp_init");
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the loop thread touches it
  check_ucs(ucp_worker_create(w->context_, &wparams, &w->worker_), "ucp_worker_create");
  check_ucs(ucp_worker_get_efd(w->worker_, &w->ucp_fd_), "ucp_worker_get_efd");
  w->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  TORCH_CHECK(w->wake_fd_ >= 0, "pipe: eventfd failed: ", std::strerror(errno));
  w->thread_ = std::thread([raw = w.get()] { raw->loop(); });
  return w;
}

Worker::~Worker() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    const uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof(one));
    if (on_loop_thread()) {
      thread_.detach();  // cannot join itself; the owners guarantee this does not happen
    } else {
      thread_.join();
    }
  }
  // Every endpoint and listener was closed by its owner before the last reference went.
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Worker::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    tasks_.push_back(std::move(task));
  }
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof(one));
}

void Worker::call(const std::function<void()>& fn, Millis timeout, const char* what) {
  if (on_loop_thread()) {  // a destructor that ran on the loop: no need (and no way) to wait
    fn();
    return;
  }
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  post([state, fn] {
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lk(state->mu);
    state->error = error;
    state->done = true;
    state->cv.notify_all();
  });
  std::unique_lock<std::mutex> lk(state->mu);
  TD_CHECK_AS(TimeoutError, state->cv.wait_for(lk, timeout, [&] { return state->done; }),
              "pipe: ", what, " timed out after ", to_ms(timeout), " ms (UCX progress thread busy)");
  if (state->error) std::rethrow_exception(state->error);
}

void Worker::loop() {
  std::deque<std::function<void()>> batch;
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      batch.swap(tasks_);
    }
    for (auto& task : batch) task();
    batch.clear();
    // Bounded: while a peer streams faster than we read, UCX always has more to queue, and an
    // unbounded drain would starve the posted tasks (the receives that would consume it).
    bool idle = false;
    for (int i = 0; i < kProgressBurst && !idle; ++i) idle = ucp_worker_progress(worker_) == 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!tasks_.empty()) continue;
      if (stop_) break;
    }
    if (!idle) continue;
    // Sleep in the kernel until UCX or post() has something; the poll timeout only bounds the
    // cost of an event UCX might not signal.
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    pollfd fds[2] = {{ucp_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 2, 100);
    if (fds[1].revents & POLLIN) {
      uint64_t value = 0;
      [[maybe_unused]] auto n = ::read(wake_fd_, &value, sizeof(value));
    }
  }
}

// ---- addresses --------------------------------------------------------------------------------

SockAddr resolve(const std::string& host, int port, bool passive) {
  TORCH_CHECK_VALUE(port >= 0 && port <= 65535, "pipe: port must be in [0, 65535], got ", port);
  TORCH_CHECK_VALUE(!host.empty(), "pipe: empty host");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &result);
  TORCH_CHECK_VALUE(rc == 0 && result != nullptr, "pipe: cannot resolve host '", host,
                    "': ", gai_strerror(rc));
  SockAddr out;
  std::memcpy(&out.storage, result->ai_addr, result->ai_addrlen);
  out.length = result->ai_addrlen;
  ::freeaddrinfo(result);
  return out;
}

std::string format_address(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  } else {
    return "?";
  }
  return c10::str(host, ":", port);
}

namespace {
int port_of(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  }
  return 0;
}
}  // namespace

// ---- Endpoint ---------------------------------------------------------------------------------

Endpoint::~Endpoint() {
  // Owners close() first; this covers an endpoint dropped without it (on the loop thread only
  // when the last reference was a finished callback's, where ep_ is already gone).
  if (ep_ != nullptr && worker_->on_loop_thread()) force_close_on_loop();
}

void Endpoint::create_on_loop(const ucp_ep_params_t& params) {
  ucp_ep_params_t p = params;
  p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &Endpoint::on_error;
  p.err_handler.arg = this;
  const ucs_status_t st = ucp_ep_create(worker_->handle(), &p, &ep_);
  if (st != UCS_OK) ep_ = nullptr;
  TORCH_CHECK(st == UCS_OK, "pipe: cannot create an endpoint to ", peer_, ": ",
              ucs_status_string(st));
}

std::shared_ptr<Endpoint> Endpoint::connect(Worker* worker, const std::string& host, int port,
                                            Millis timeout) {
  const SockAddr addr = resolve(host, port, /*passive=*/false);
  auto ep = std::make_shared<Endpoint>(worker, c10::str(host, ":", port));
  worker->call(
      [&] {
        ucp_ep_params_t params{};
        params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
        params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr.storage);
        params.sockaddr.addrlen = addr.length;
        ep->create_on_loop(params);
      },
      kTeardownGrace, "connect");
  // A flush completes once the wireup with the server is done, and fails when it is refused.
  try {
    ep->transfer(Dir::kFlush, nullptr, 1, {}, "connect", timeout);
  } catch (...) {
    ep->close(timeout);
    throw;
  }
  return ep;
}

std::shared_ptr<Endpoint> Endpoint::accept_on_loop(Worker* worker, ucp_conn_request_h request) {
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string peer = "?";
  if (ucp_conn_request_query(request, &attr) == UCS_OK) peer = format_address(attr.client_address);
  auto ep = std::make_shared<Endpoint>(worker, std::move(peer));
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  params.conn_request = request;
  ep->create_on_loop(params);
  return ep;
}

void Endpoint::send(const void* data, size_t n, const at::Tensor& owner, const char* what,
                    Millis timeout) {
  transfer(Dir::kSend, const_cast<void*>(data), n, owner, what, timeout);
}

void Endpoint::recv(void* data, size_t n, const at::Tensor& owner, const char* what,
                    Millis timeout) {
  transfer(Dir::kRecv, data, n, owner, what, timeout);
}

bool Endpoint::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return closed_;
}

void Endpoint::wait_gone(Millis timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return !failure_.empty() || ep_gone_ || closed_; });
}

void Endpoint::throw_unusable(const char* op_name, const char* what) {
  // Called with mu_ held by the caller's scope.
  if (closed_) TD_THROW(PipeClosedError, op_name, " ", what, ": the pipe to ", peer_, " is closed");
  TD_THROW(PeerLostError, op_name, " ", what, ": the pipe to ", peer_, " is broken: ", failure_);
}

void Endpoint::transfer(Dir dir, void* data, size_t n, const at::Tensor& owner, const char* what,
                        Millis timeout) {
  if (n == 0) return;  // a stream has no empty messages; both ends skip them alike
  const char* op_name = dir == Dir::kRecv   ? "recv"
                        : dir == Dir::kSend ? "send"
                        : dir == Dir::kClose ? "close"
                                             : "connect";
  auto op = std::make_shared<Op>();
  op->owner = owner;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (closed_ || ep_gone_ || !failure_.empty()) {
      throw_unusable(op_name, what);
    }
  }
  worker_->post([self = shared_from_this(), op, dir, data, n] {
    self->start_on_loop(op, dir, data, n);
  });
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return op->done; })) {
    // The stream is now out of step: break the endpoint, which also completes the operation.
    if (failure_.empty()) {
      failure_ = c10::str(op_name, " ", what, " (", n, " bytes) timed out after ", to_ms(timeout),
                          " ms");
    }
    lk.unlock();
    worker_->post([self = shared_from_this()] { self->force_close_on_loop(); });
    lk.lock();
    cv_.wait_for(lk, kTeardownGrace, [&] { return op->done; });
    TD_THROW(TimeoutError, op_name, " ", what, ": peer ", peer_, ": ", failure_);
  }
  if (op->status == UCS_OK) {
    // WAITALL fills the buffer or fails; a short completion must not pass as a full one.
    TORCH_CHECK(dir != Dir::kRecv || op->length == n, op_name, " ", what, ": peer ", peer_,
                " delivered ", op->length, " of ", n, " bytes");
    return;
  }
  if (closed_ && failure_.empty()) {
    TD_THROW(PipeClosedError, op_name, " ", what, ": the pipe to ", peer_, " was closed");
  }
  if (!failure_.empty()) {
    TD_THROW(PeerLostError, op_name, " ", what, " (", n, " bytes): the pipe to ", peer_,
             " is broken: ", failure_);
  }
  TD_THROW(PeerLostError, op_name, " ", what, " (", n, " bytes): peer ", peer_, ": ",
           ucs_status_string(op->status));
}

void Endpoint::start_on_loop(const std::shared_ptr<Op>& op, Dir dir, void* data, size_t n) {
  if (ep_ == nullptr) {
    finish(*op, UCS_ERR_NOT_CONNECTED, 0);
    return;
  }
  auto* ctx = new CallbackContext{shared_from_this(), op};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = ctx;
  size_t length = n;
  ucs_status_ptr_t req = nullptr;
  switch (dir) {
    case Dir::kSend:
      param.cb.send = &Endpoint::on_send;
      req = ucp_stream_send_nbx(ep_, data, n, &param);
      break;
    case Dir::kFlush:
      param.cb.send = &Endpoint::on_send;
      req = ucp_ep_flush_nbx(ep_, &param);
      break;
    case Dir::kClose:  // the orderly close: UCX flushes, then tells the peer
      param.cb.send = &Endpoint::on_send;
      req = ucp_ep_close_nbx(ep_, &param);
      ep_ = nullptr;
      {
        std::lock_guard<std::mutex> lk(mu_);
        ep_gone_ = true;
      }
      break;
    case Dir::kRecv:
      param.cb.recv_stream = &Endpoint::on_recv;
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_STREAM_RECV_FLAG_WAITALL;
      req = ucp_stream_recv_nbx(ep_, data, n, &length, &param);
      break;
  }
  if (!UCS_PTR_IS_PTR(req)) {  // completed (or failed) at once: no callback will come
    delete ctx;
    finish(*op, UCS_PTR_STATUS(req), UCS_PTR_STATUS(req) == UCS_OK ? length : 0);
    return;
  }
}

void Endpoint::finish(Op& op, ucs_status_t status, size_t length) {
  std::lock_guard<std::mutex> lk(mu_);
  op.done = true;
  op.status = status;
  op.length = length;
  op.owner = at::Tensor();
  cv_.notify_all();
}

void Endpoint::on_send(void* request, ucs_status_t status, void* user_data) {
  auto* ctx = static_cast<CallbackContext*>(user_data);
  ctx->endpoint->finish(*ctx->op, status, 0);
  ucp_request_free(request);
  delete ctx;
}

void Endpoint::on_recv(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* ctx = static_cast<CallbackContext*>(user_data);
  ctx->endpoint->finish(*ctx->op, status, length);
  ucp_request_free(request);
  delete ctx;
}

void Endpoint::on_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* self = static_cast<Endpoint*>(arg);
  {
    std::lock_guard<std::mutex> lk(self->mu_);
    if (self->failure_.empty()) {
      self->failure_ = c10::str("the peer disconnected or failed (", ucs_status_string(status), ")");
    }
    self->cv_.notify_all();
  }
  // UCX wants a failed endpoint closed with force; that also fails the operations still
  // waiting. (UCX 1.13 discards the failed endpoint's unread stream bytes: see docs/pipe.md.)
  self->worker_->post([s = self->shared_from_this()] { s->force_close_on_loop(); });
}

void Endpoint::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) failure_ = why;
    cv_.notify_all();
  }
  try {
    worker_->call([this] { force_close_on_loop(); }, kTeardownGrace, "close");
  } catch (...) {
  }
}

void Endpoint::force_close_on_loop() {
  if (ep_ == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  param.cb.send = [](void* request, ucs_status_t, void*) { ucp_request_free(request); };
  // A forced close completes every outstanding operation of the endpoint with an error.
  ucp_ep_close_nbx(ep_, &param);
  ep_ = nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  ep_gone_ = true;
  cv_.notify_all();
}

void Endpoint::close(Millis timeout) noexcept {
  bool flush;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    flush = failure_.empty() && !ep_gone_;
  }
  // A healthy endpoint closes in flush mode (what was sent is delivered, the peer sees an
  // orderly disconnect); bounded, as every wait. Otherwise, or if that fails, by force.
  if (flush) {
    try {
      transfer(Dir::kClose, nullptr, 1, {}, "close", std::min(timeout, kTeardownGrace));
    } catch (...) {
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  try {
    worker_->call([this] { force_close_on_loop(); }, kTeardownGrace, "close");
  } catch (...) {
  }
}

// ---- Listener ---------------------------------------------------------------------------------

std::shared_ptr<Listener> Listener::create(Worker* worker, const std::string& host, int port,
                                           int max_clients, Millis timeout) {
  const SockAddr addr = resolve(host, port, /*passive=*/true);
  std::shared_ptr<Listener> l(new Listener(worker, max_clients));
  worker->call(
      [&] {
        ucp_listener_params_t params{};
        params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
        params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr.storage);
        params.sockaddr.addrlen = addr.length;
        params.conn_handler.cb = &Listener::on_conn_request;
        params.conn_handler.arg = l.get();
        const ucs_status_t st = ucp_listener_create(worker->handle(), &params, &l->listener_);
        if (st != UCS_OK) l->listener_ = nullptr;
        TORCH_CHECK(st == UCS_OK, "listen: cannot listen on ", host, ":", port, ": ",
                    ucs_status_string(st));
        ucp_listener_attr_t attr{};
        attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
        check_ucs(ucp_listener_query(l->listener_, &attr), "ucp_listener_query");
        l->port_ = port_of(attr.sockaddr);
      },
      std::max(timeout, kTeardownGrace), "listen");
  return l;
}

Listener::~Listener() { close(kTeardownGrace); }

void Listener::on_conn_request(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<Listener*>(arg);
  // Accept outside UCX's callback, on the next loop turn.
  self->worker_->post([weak = self->weak_from_this(), request] {
    auto l = weak.lock();
    if (!l || l->listener_ == nullptr) return;
    bool refuse;
    {
      std::lock_guard<std::mutex> lk(l->mu_);
      refuse = l->closed_ || (l->max_clients_ > 0 && l->accepted_ >= l->max_clients_);
    }
    if (refuse) {
      ucp_listener_reject(l->listener_, request);
      return;
    }
    std::shared_ptr<Endpoint> ep;
    try {
      ep = Endpoint::accept_on_loop(l->worker_, request);
    } catch (...) {
      return;  // the client sees its connection fail; the listener goes on
    }
    std::lock_guard<std::mutex> lk(l->mu_);
    l->ready_.push_back(std::move(ep));
    ++l->accepted_;
    l->cv_.notify_all();
  });
}

std::shared_ptr<Endpoint> Listener::accept(Millis timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return closed_ || !ready_.empty(); });
  if (closed_ || ready_.empty()) return nullptr;
  auto ep = std::move(ready_.front());
  ready_.pop_front();
  return ep;
}

int64_t Listener::accepted() const {
  std::lock_guard<std::mutex> lk(mu_);
  return accepted_;
}

void Listener::close(Millis timeout) noexcept {
  std::deque<std::shared_ptr<Endpoint>> unclaimed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    unclaimed.swap(ready_);
    cv_.notify_all();
  }
  try {
    worker_->call(
        [this] {
          if (listener_ != nullptr) ucp_listener_destroy(listener_);
          listener_ = nullptr;
        },
        kTeardownGrace, "listener close");
  } catch (...) {
  }
  for (auto& ep : unclaimed) ep->close(timeout);
}

}  // namespace tensordict::pipe::detail
