// Pipe: a handle that forwards each call to its PipeImpl (pipe_impl.h), which owns the state and
// its invariants; here only the ways to make one.
#include "tensordict/pipe/pipe.h"

#include "caller_connection.h"
#include "pipe_impl.h"
#include "ucx_endpoint.h"
#include "ucx_listener.h"
#include "ucx_worker.h"

namespace tensordict::pipe {

using detail::PipeImpl;

Pipe::Pipe(std::shared_ptr<PipeImpl> impl) : impl_(std::move(impl)) {}

Pipe Pipe::listen(int port, const std::string& host, const PipeOptions& options) {
  auto worker = detail::Worker::create(options.spin);
  auto listener = detail::Listener::create(worker, host, port, /*max_clients=*/1, options);
  return Pipe(std::make_shared<PipeImpl>(options, std::move(worker), std::move(listener)));
}

Pipe Pipe::connect(const std::string& host, int port, const PipeOptions& options) {
  auto worker = detail::Worker::create(options.spin);
  auto ep = detail::Endpoint::connect(worker, host, port, options.timeout,
                                      detail::UnreadLimits::of(options));
  detail::log_connected(*ep, "connected to");
  return Pipe(std::make_shared<PipeImpl>(options, std::move(worker), std::move(ep), port));
}

Pipe Pipe::over(CallerTransport link, const PipeOptions& options) {
  return Pipe(std::make_shared<PipeImpl>(
      options, nullptr, std::make_shared<detail::CallerConnection>(std::move(link)), 0));
}

void Pipe::send(const TensorDict& td, const PipeSendOptions& o) { impl_->send(td, o); }
Pipe::SendAttempt Pipe::try_send(const TensorDict& td, std::chrono::microseconds spin) {
  return impl_->try_send(td, spin);
}
TensorDict Pipe::recv(const std::optional<TensorDict>& td, std::optional<at::Device> device) {
  return impl_->recv(td, device);
}
std::optional<TensorDict> Pipe::try_recv(RecvAttempt* attempt, const std::optional<TensorDict>& td,
                                         std::optional<at::Device> device,
                                         std::chrono::microseconds spin) {
  return impl_->try_recv(attempt, td, device, spin);
}
bool Pipe::recv_ready(std::chrono::microseconds spin) { return impl_->recv_ready(spin); }
int64_t Pipe::last_recv_bytes() const { return impl_->last_recv_bytes(); }
int Pipe::event_fd() { return impl_->event_fd(); }
void Pipe::watch(bool on) { impl_->watch(on); }
void Pipe::accept() { impl_->accept(); }
void Pipe::close() noexcept { impl_->close(); }
bool Pipe::closed() const { return impl_->closed(); }
bool Pipe::peer_closed() const { return impl_->peer_closed(); }
int Pipe::port() const { return impl_->port(); }
std::string Pipe::transports() const { return impl_->transports(); }
bool Pipe::peer_is_tensordict_cpp() const { return impl_->peer_is_tensordict_cpp(); }
std::string Pipe::peer() const { return impl_->peer(); }
const PipeOptions& Pipe::options() const { return impl_->options(); }
PipeStats Pipe::stats() const { return impl_->stats(); }
void Pipe::send_raw(const TestKey& /*key*/, const void* data, size_t n) {
  impl_->send_raw(data, n);
}
std::string Pipe::recv_raw(const TestKey& /*key*/, size_t n) { return impl_->recv_raw(n); }

}  // namespace tensordict::pipe
