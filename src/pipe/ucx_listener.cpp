#include "ucx_listener.h"

#include <c10/util/Exception.h>

#include <utility>

#include "ucx_address.h"
#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {
namespace {

// Connections whose peer-info exchange is under way; more are rejected (a flood of connection
// requests must not grow the listener without bound).
constexpr size_t kMaxHandshakes = 64;

}  // namespace

std::shared_ptr<Listener> Listener::create(std::shared_ptr<Worker> worker, const std::string& host,
                                           int port, int max_clients, const PipeOptions& options) {
  const SockAddr addr = resolve(host, port, /*passive=*/true);
  std::shared_ptr<Listener> l(new Listener(worker, max_clients, UnreadLimits::of(options)));
  auto lk = worker->lock();
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
  return l;
}

Listener::~Listener() { close(kTeardownGrace); }

void Listener::on_conn_request(ucp_conn_request_h request, void* arg) {
  // Inside a progress call: accept right after it. The listener outlives the task, since its
  // close() destroys the UCX listener (no more requests) with the UCX lock held.
  auto* self = static_cast<Listener*>(arg);
  self->worker_->defer([self, request] { self->accept_locked(request); });
}

void Listener::accept_locked(ucp_conn_request_h request) {
  if (listener_ == nullptr) return;  // closed: UCX dropped the request with the listener
  if (closed_ || handshaking_.size() >= kMaxHandshakes ||
      (max_clients_ > 0 && accepted_ + static_cast<int64_t>(handshaking_.size()) >= max_clients_)) {
    ucp_listener_reject(listener_, request);
    return;
  }
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string peer = "?";
  if (ucp_conn_request_query(request, &attr) == UCS_OK) peer = format_address(attr.client_address);
  auto ep = std::make_shared<Endpoint>(worker_, std::move(peer), limits_);
  try {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
    params.conn_request = request;
    ep->create_locked(params);
  } catch (const c10::Error&) {
    return;  // the client sees its connection fail; the listener goes on
  }
  handshaking_.push_back(ep);
  // ucxx's exchange, listener side: send our info, then receive the peer's; each step goes on
  // from the previous one's completion.
  write_peer_info(ep->recv_tag_, ep->handshake_.data_ptr<uint8_t>());
  std::weak_ptr<Listener> weak = weak_from_this();
  auto* info = ep->handshake_.data_ptr<uint8_t>();
  ep->start(Endpoint::Dir::kStreamSend, info, 16, ep->handshake_,
            [weak, ep, info](ucs_status_t sent, size_t) {
              auto self = weak.lock();
              if (!self) return;
              if (sent != UCS_OK) return self->handshake_done_locked(ep, sent);
              ep->start(Endpoint::Dir::kStreamRecv, info + 16, 16, ep->handshake_,
                        [weak, ep](ucs_status_t received, size_t length) {
                          auto self = weak.lock();
                          if (!self) return;
                          self->handshake_done_locked(ep, received == UCS_OK && length != 16
                                                              ? UCS_ERR_MESSAGE_TRUNCATED
                                                              : received);
                        });
            });
}

void Listener::handshake_done_locked(const std::shared_ptr<Endpoint>& ep, ucs_status_t status) {
  std::erase(handshaking_, ep);
  if (status == UCS_OK && !closed_) {
    try {
      ep->peer_info_ = read_peer_info(ep->handshake_.data_ptr<uint8_t>() + 16);
      ready_.push_back(ep);
      accepted_.fetch_add(1);
      ready_count_.fetch_add(1);
      worker_->notify();
      return;
    } catch (const c10::Error&) {
      // a bad checksum: not a ucxx peer; drop the connection as ucxx does
    }
  }
  ep->closed_ = true;
  ep->force_close_locked();
}

std::shared_ptr<Endpoint> Listener::accept(Millis timeout) {
  std::shared_ptr<Worker> worker;
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    worker = worker_;
  }
  if (!worker) return nullptr;  // closed
  worker->wait_until([&] { return closed_flag_.load() || ready_count_.load() > 0; },
                     Clock::now() + timeout);
  auto lk = worker->lock();
  if (closed_ || ready_.empty()) return nullptr;
  auto ep = std::move(ready_.front());
  ready_.pop_front();
  ready_count_.fetch_sub(1);
  return ep;
}

void Listener::close(Millis timeout) noexcept {
  std::shared_ptr<Worker> worker;
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    worker = worker_;
  }
  if (!worker) return;
  std::deque<std::shared_ptr<Endpoint>> unclaimed;
  {
    auto lk = worker->lock();
    if (closed_) return;
    closed_ = true;
    closed_flag_ = true;
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    listener_ = nullptr;  // no more requests: the callbacks below need no worker_ now
    unclaimed.swap(ready_);
    ready_count_ = 0;
    for (auto& ep : handshaking_) {
      ep->closed_ = true;
      ep->force_close_locked();
    }
    handshaking_.clear();
    // A closed listener holds no worker, so that its owner may release the worker while the
    // listener object stays (TensorDictServer keeps it for port() and clients()).
    std::lock_guard<std::mutex> lk2(close_mu_);
    worker_.reset();
  }
  worker->notify();
  for (auto& ep : unclaimed) ep->close(timeout);
}

}  // namespace tensordict::pipe::detail
