#include "tensordict/pipe/server.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <utility>

#include "connection.h"
#include "pipe_impl.h"
#include "ucx_endpoint.h"
#include "ucx_listener.h"
#include "ucx_worker.h"

namespace tensordict::pipe {
namespace detail {

// How often the accept thread looks at the stop flag while no client arrives (close() also
// wakes it at once by closing the listener).
constexpr Millis kAcceptSlice{200};
// Handler errors kept (the latest): a client that makes its handler fail on every reconnect
// must not grow the server.
constexpr size_t kMaxErrors = 1000;

struct ServerImpl {
  struct Client {
    Pipe pipe;
    std::thread thread;
    std::atomic<bool> done{false};
    explicit Client(Pipe p) : pipe(std::move(p)) {}
  };

  PipeOptions options;
  std::shared_ptr<Worker> worker;
  std::shared_ptr<Listener> listener;

  mutable std::mutex mu;      // guards what follows
  std::list<Client> clients;  // std::list: a Client never moves while its thread runs
  // Pipes handed out by accept(), closed by close(); not kept alive by the server (a pipe whose
  // last handle goes closes itself), and forgotten once closed.
  std::vector<std::weak_ptr<PipeImpl>> accepted;
  std::deque<std::exception_ptr> errors;  // the latest kMaxErrors
  std::thread acceptor;
  bool serving = false;
  std::atomic<bool> stopping{false};

  Pipe make_pipe(std::shared_ptr<Endpoint> ep) {
    log_connected(*ep, "accepted");
    return PipeAccess::make(
        std::make_shared<PipeImpl>(options, worker, std::move(ep), listener->port()));
  }

  // Joins the handlers that finished (called by the accept thread, so threads do not pile up).
  void reap() {
    std::list<Client> finished;
    {
      std::lock_guard<std::mutex> lk(mu);
      for (auto it = clients.begin(); it != clients.end();) {
        auto next = std::next(it);
        if (it->done.load()) finished.splice(finished.end(), clients, it);
        it = next;
      }
    }
    for (auto& c : finished) c.thread.join();
  }

  void accept_loop(const std::function<void(Pipe&)>& handler) {
    while (!stopping.load()) {
      reap();
      auto ep = listener->accept(kAcceptSlice);
      if (!ep) continue;
      std::lock_guard<std::mutex> lk(mu);
      clients.emplace_back(make_pipe(std::move(ep)));
      Client& c = clients.back();
      if (stopping.load()) {  // close() already closed the others; close this one too
        c.pipe.close();
        c.done = true;
        continue;
      }
      c.thread = std::thread([this, &c, handler] {
        try {
          handler(c.pipe);
        } catch (...) {
          // Errors caused by close() breaking the pipe, and the client's clean close, are the
          // expected ways to end.
          if (!stopping.load() && !c.pipe.peer_closed()) {
            std::lock_guard<std::mutex> lk(mu);
            errors.push_back(std::current_exception());
            if (errors.size() > kMaxErrors) errors.pop_front();
          }
        }
        c.pipe.close();
        c.done = true;
      });
    }
  }

  void close() noexcept {
    if (stopping.exchange(true)) return;
    if (listener) listener->close(options.timeout);
    if (acceptor.joinable()) acceptor.join();
    std::vector<Pipe> to_close;
    std::vector<std::shared_ptr<PipeImpl>> handed_out;
    {
      std::lock_guard<std::mutex> lk(mu);
      for (auto& c : clients) to_close.push_back(c.pipe);
      for (auto& w : accepted) {
        if (auto p = w.lock()) handed_out.push_back(std::move(p));
      }
    }
    for (auto& p : to_close) p.close();  // blocked handlers fail promptly
    for (auto& p : handed_out) p->close();
    handed_out.clear();
    for (auto& c : clients) {
      if (c.thread.joinable()) c.thread.join();
    }
    std::lock_guard<std::mutex> lk(mu);
    clients.clear();
    accepted.clear();
  }
};

}  // namespace detail

using detail::ServerImpl;

TensorDictServer::TensorDictServer(int port, const std::string& host, const PipeOptions& options)
    : impl_(std::make_unique<ServerImpl>()) {
  impl_->options = options;
  impl_->worker = detail::Worker::create(options.spin);
  impl_->listener = detail::Listener::create(impl_->worker, host, port, /*max_clients=*/0, options);
}

TensorDictServer::~TensorDictServer() { close(); }
TensorDictServer::TensorDictServer(TensorDictServer&&) noexcept = default;
TensorDictServer& TensorDictServer::operator=(TensorDictServer&& other) noexcept {
  if (this != &other) {
    close();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

int TensorDictServer::port() const { return impl_->listener->port(); }

std::optional<Pipe> TensorDictServer::accept(std::optional<std::chrono::milliseconds> timeout) {
  TORCH_CHECK(impl_ && !impl_->stopping.load(), "accept: the server is closed");
  auto ep = impl_->listener->accept(timeout.value_or(impl_->options.timeout));
  if (!ep) return std::nullopt;
  Pipe pipe = impl_->make_pipe(std::move(ep));
  std::lock_guard<std::mutex> lk(impl_->mu);
  std::erase_if(impl_->accepted, [](const std::weak_ptr<detail::PipeImpl>& w) {
    const auto p = w.lock();
    return !p || p->closed();
  });
  impl_->accepted.push_back(detail::PipeAccess::weak(pipe));
  return pipe;
}

void TensorDictServer::serve(std::function<void(Pipe&)> handler) {
  TORCH_CHECK_VALUE(handler != nullptr, "serve: the handler is empty");
  TORCH_CHECK(impl_ && !impl_->stopping.load(), "serve: the server is closed");
  std::lock_guard<std::mutex> lk(impl_->mu);
  TORCH_CHECK(!impl_->serving, "serve: the server is already serving");
  impl_->serving = true;
  impl_->acceptor = std::thread(
      [impl = impl_.get(), handler = std::move(handler)] { impl->accept_loop(handler); });
}

std::vector<std::exception_ptr> TensorDictServer::handler_errors() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return {impl_->errors.begin(), impl_->errors.end()};
}

int64_t TensorDictServer::clients() const { return impl_->listener->accepted(); }

void TensorDictServer::close() noexcept {
  if (!impl_) return;
  impl_->close();
  // Release UCX now (the worker goes with the last pipe handle a caller may still hold). The
  // closed listener object stays for port() and clients().
  impl_->worker.reset();
}

}  // namespace tensordict::pipe
