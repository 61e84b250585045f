// A pipe end (pipe_impl.h): the framing of docs/wire-format.md §6 written by a FrameWriter and
// read by a FrameReader (src/wire/include/wire/pipe_frames.h), each message one tag message on the
// pipe's connection, with the flow control, the close marker, the counters and the event loops' fd.
#include "pipe_impl.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "tensordict/errors.h"
#include "tensordict/log.h"
#include "tensordict/transfer_stats.h"

namespace tensordict::pipe::detail {
namespace {

void check_cpu(const std::string& what, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "send: ", what, " is on ", t.device(),
                    "; this build of the pipe moves CPU memory only");
}

// The pipe's connection as the FrameReader's message source: reads count in the stats; a fault
// breaks the connection.
class ConnectionSource final : public ByteSource {
 public:
  ConnectionSource(PipeImpl& pipe, Connection& e) : pipe_(pipe), e_(e) {}
  void read(void* data, size_t n, const at::Tensor& owner, const char* what) override {
    pipe_.recv_bytes(e_, data, n, owner, what);
  }
  void read_first(void* data, size_t n, const at::Tensor& owner, const char* what) override {
    try {
      read(data, n, owner, what);
    } catch (const PeerLostError&) {
      // The reference has no close marker: its peer's disconnect between two TensorDicts, once
      // every message it sent was read, is its clean close. A peer of ours sends the marker.
      if (e_.peer_gone() && !e_.peer_info().ours) pipe_.peer_left(e_);
      throw;
    }
  }
  bool joins_frames() const override { return e_.joins_frames(); }
  size_t read_first_joined(uint8_t* flag, const at::Tensor& flag_owner, void* data, size_t n,
                           const at::Tensor& owner, const char* what) override {
    // Only a peer of ours joins frames, and it ends with the close marker: no disconnect rule.
    const size_t got =
        e_.recv_joined(flag, flag_owner, data, n, owner, what, pipe_.options().timeout);
    pipe_.counted(e_, false, got, what);
    return got;
  }
  void fail(const std::string& why) override { e_.fail(why); }
  [[noreturn]] void peer_left() override { pipe_.peer_left(e_); }
  std::string peer() const override { return e_.peer(); }

 private:
  PipeImpl& pipe_;
  Connection& e_;
};

void check_options(const PipeOptions& o) {
  TORCH_CHECK_VALUE(o.timeout.count() > 0, "pipe: timeout must be positive");
  TORCH_CHECK_VALUE(o.max_metadata_bytes > 0 && o.max_storage_bytes.value_or(0) >= 0,
                    "pipe: the size caps must be positive");
  TORCH_CHECK_VALUE(o.max_unreceived >= 1 && o.max_unreceived <= (1 << 20),
                    "pipe: max_unreceived must be in [1, 2^20], got ", o.max_unreceived);
  TORCH_CHECK_VALUE(o.linger.count() >= 0, "pipe: linger must not be negative");
  TORCH_CHECK_VALUE(o.max_unread_bytes > 0, "pipe: max_unread_bytes must be positive, got ",
                    o.max_unread_bytes);
}

const char* kPublicationOnly =
    "this pipe carries a publication (a Subscriber pulls on it, or a Publisher serves it) and "
    "moves nothing else";

}  // namespace

size_t Connection::recv_joined(uint8_t*, const at::Tensor&, void*, size_t, const at::Tensor&,
                               const char*, Millis) {
  TORCH_INTERNAL_ASSERT(false, "recv_joined on a link that does not join frames");
}

void log_connected(Connection& e, const char* how) {
  if (!log_enabled(LogLevel::kInfo)) return;
  log(LogLevel::kInfo, c10::str("pipe ", how, " ", e.peer(), " (",
                                e.peer_info().ours ? "a tensordict-cpp peer" : "a ucxx peer",
                                "), UCX transports: ", e.transports()));
}

// ---- Transfer -----------------------------------------------------------------------------------

Transfer::Transfer(PipeImpl& pipe, Connection& e, bool sent)
    : pipe_(pipe),
      e_(e),
      sent_(sent),
      start_(::tensordict::detail::transfer_ticks()),
      bytes_(sent ? pipe.counters().bytes_sent.load() : pipe.counters().bytes_received.load()),
      schemas_(sent ? pipe.counters().schema_sends.load() : pipe.counters().schema_recvs.load()) {}

int64_t Transfer::bytes() const {
  const auto& c = pipe_.counters();
  return (sent_ ? c.bytes_sent.load() : c.bytes_received.load()) - bytes_;
}

void Transfer::done() const {
  const int64_t ticks = ::tensordict::detail::finish_transfer(Channel::kPipe, start_);
  if (!log_enabled(LogLevel::kInfo)) return;
  const std::string took = ::tensordict::detail::micros_text(ticks);
  const auto& c = pipe_.counters();
  const bool schema = (sent_ ? c.schema_sends.load() : c.schema_recvs.load()) > schemas_;
  log(LogLevel::kInfo, c10::str("pipe ", sent_ ? "send to " : "recv from ", e_.peer(), ": ",
                                !pipe_.options().consolidated ? "uncollated"
                                : schema                      ? "new schema"
                                                              : "same schema",
                                ", ", bytes(), " bytes in ", took));
}

// ---- construction, connections -----------------------------------------------------------------

PipeImpl::PipeImpl(PipeOptions options, std::shared_ptr<Worker> worker,
                   std::shared_ptr<Listener> listener)
    : PipeImpl(std::move(options), std::move(worker), nullptr, 0) {
  port_ = listener->port();
  listener_ = std::move(listener);
}

PipeImpl::PipeImpl(PipeOptions options, std::shared_ptr<Worker> worker,
                   std::shared_ptr<Connection> link, int port)
    : options_((check_options(options), std::move(options))),
      worker_(std::move(worker)),
      port_(port),
      ep_(std::move(link)),
      writer_(options_.consolidated),
      credit_ring_(bytes_tensor(static_cast<size_t>(options_.max_unreceived + 1) * 8)),
      reader_(FrameLimits{options_.max_metadata_bytes,
                          options_.max_storage_bytes.value_or(default_storage_limit_bytes())}) {}

PipeImpl::~PipeImpl() {
  close();  // unwatched the worker, which it released
  if (event_fd_.load() >= 0) ::close(event_fd_.load());
}

std::shared_ptr<Connection> PipeImpl::link(const char* op) {
  std::lock_guard<std::mutex> lk(ep_mu_);
  TD_CHECK_AS(PipeClosedError, !closed_.load(), "Cannot ", op, " on a closed pipe.");
  TD_CHECK_AS(PeerClosedError, !peer_closed_.load(), op, ": the peer closed the pipe");
  TORCH_CHECK(!publication_.load(), op, ": ", kPublicationOnly);
  if (ep_) return ep_;
  TORCH_INTERNAL_ASSERT(listener_ != nullptr);
  ep_ = listener_->accept(options_.timeout);
  TD_CHECK_AS(PipeClosedError, !closed_.load(), "Cannot ", op, " on a closed pipe.");
  TORCH_CHECK(ep_ != nullptr, op, ": no client connected to port ", port_, " within ",
              options_.timeout.count(), " ms");
  log_connected(*ep_, "accepted");
  return ep_;
}

std::shared_ptr<Connection> PipeImpl::link_if_connected() {
  std::lock_guard<std::mutex> lk(ep_mu_);
  TORCH_CHECK(!publication_.load(), kPublicationOnly);
  if (ep_ || !listener_ || closed_.load()) return ep_;
  ep_ = listener_->accept(Millis(0));
  if (ep_) log_connected(*ep_, "accepted");
  return ep_;
}

// ---- messages -----------------------------------------------------------------------------------

Millis PipeImpl::send_wait() const {
  if (!send_deadline_) return options_.timeout;
  const auto left = std::chrono::duration_cast<Millis>(*send_deadline_ - Clock::now());
  return std::clamp(left, Millis(0), options_.timeout);
}

void PipeImpl::send_frame(Connection& e, const OutFrame& f) {
  e.send(f.data, f.n, f.owner, f.what, send_wait());
  counted(e, true, f.n, f.what);
}

void PipeImpl::send_first(Connection& e, const OutFrame& f) {
  OutFrame first = f;
  if (f.n <= 8) {  // a joined message is a buffer of its own already (FrameWriter)
    auto* slot =
        credit_ring_.data_ptr<uint8_t>() + (credits_sent_ % (options_.max_unreceived + 1)) * 8;
    std::memcpy(slot, f.data, f.n);
    first = {slot, f.n, credit_ring_, f.what};
  }
  e.send_credit(first.data, first.n, first.owner, first.what,
                static_cast<size_t>(options_.max_unreceived), send_wait());
  ++credits_sent_;
  counted(e, true, first.n, first.what);
}

void PipeImpl::recv_bytes(Connection& e, void* data, size_t n, const at::Tensor& owner,
                          const char* what) {
  e.recv(data, n, owner, what, options_.timeout);
  counted(e, false, n, what);
}

void PipeImpl::counted(Connection& e, bool sent, size_t n, const char* what) {
  const auto bytes = static_cast<int64_t>(n);
  counters_.add(sent ? &Counters::bytes_sent : &Counters::bytes_received, bytes);
  ::tensordict::detail::count_messages(Channel::kPipe, sent, 1, bytes);
  if (log_enabled(LogLevel::kDebug)) {
    log(LogLevel::kDebug, c10::str("pipe ", sent ? "send to " : "recv from ", e.peer(), ": ", what,
                                   ", ", n, " bytes"));
  }
}

// ---- send ---------------------------------------------------------------------------------------

void PipeImpl::send_locked(Connection& e, const TensorDict& td) {
  const Transfer transfer(*this, e, /*sent=*/true);
  at_message_boundary_ = false;
  bool new_schema = false;
  const std::vector<OutFrame> frames = writer_.write(td, e.joins_frames(), check_cpu, &new_schema);
  send_first(e, frames.front());
  for (size_t i = 1; i < frames.size(); ++i) send_frame(e, frames[i]);
  at_message_boundary_ = true;
  counters_.add(&Counters::schema_sends, new_schema ? 1 : 0);
  counters_.add(&Counters::sends, 1);
  transfer.done();
}

void PipeImpl::send(const TensorDict& td, const PipeSendOptions& send_options) {
  std::lock_guard<std::mutex> lk(send_mu_);
  auto e = link("send");
  if (send_options.deadline) {
    TD_CHECK_AS(TimeoutError, Clock::now() < *send_options.deadline,
                "send: the deadline passed before the send could start (queued behind earlier "
                "sends to ",
                e->peer(), "); nothing was sent");
  }
  send_deadline_ = send_options.deadline;
  try {
    send_locked(*e, td);
  } catch (...) {
    send_deadline_.reset();
    throw;
  }
  send_deadline_.reset();
}

Pipe::SendAttempt PipeImpl::try_send(const TensorDict& td, Micros spin) {
  using Attempt = Pipe::SendAttempt;
  std::unique_lock<std::mutex> lk(send_mu_, std::try_to_lock);
  // Another send running, a closed pipe, no client yet: send() waits, or throws.
  if (!lk.owns_lock() || closed_.load()) return Attempt::kWouldWait;
  auto e = link_if_connected();
  // One joined credit message is copied and handed to UCX: only the window can make it wait.
  if (!e || !e->joins_frames() || !writer_.writes_joined(td)) return Attempt::kWouldWait;
  if (!e->credit_available(static_cast<size_t>(options_.max_unreceived), spin)) {
    return Attempt::kWindowFull;
  }
  send_locked(*e, td);
  return Attempt::kSent;
}

void PipeImpl::send_raw(const void* data, size_t n) {
  std::lock_guard<std::mutex> lk(send_mu_);
  auto e = link("send");
  at_message_boundary_ = false;  // the framing is the caller's now
  const at::Tensor copy = bytes_tensor(std::string_view(static_cast<const char*>(data), n));
  send_frame(*e, {copy.data_ptr(), n, copy, "raw bytes"});
}

// ---- receive ------------------------------------------------------------------------------------

TensorDict PipeImpl::recv_locked(Connection& e, const std::optional<TensorDict>& td,
                                 std::optional<at::Device> device) {
  const Transfer transfer(*this, e, /*sent=*/false);
  ConnectionSource src(*this, e);
  bool new_schema = false;
  TensorDict out = options_.consolidated ? reader_.recv_consolidated(src, td, device, &new_schema)
                                         : reader_.recv_uncollated(src, device);
  counters_.add(&Counters::schema_recvs, new_schema ? 1 : 0);
  counters_.add(&Counters::recvs, 1);
  last_recv_bytes_ = transfer.bytes();
  transfer.done();
  signal_event();  // a loop that found this receive running looks again
  return out;
}

TensorDict PipeImpl::recv(const std::optional<TensorDict>& td, std::optional<at::Device> device) {
  std::lock_guard<std::mutex> lk(recv_mu_);
  auto e = link("recv");
  return recv_locked(*e, td, device);
}

std::optional<TensorDict> PipeImpl::try_recv(Pipe::RecvAttempt* attempt,
                                             const std::optional<TensorDict>& td,
                                             std::optional<at::Device> device, Micros spin) {
  using Attempt = Pipe::RecvAttempt;
  TORCH_CHECK_VALUE(attempt != nullptr, "try_recv: attempt must not be null");
  std::unique_lock<std::mutex> lk(recv_mu_, std::try_to_lock);
  if (!lk.owns_lock()) {  // another receive running would take what is seen
    *attempt = Attempt::kWouldWait;
    return std::nullopt;
  }
  if (closed_.load() || peer_closed_.load()) link("recv");  // throws
  auto e = link_if_connected();
  if (!e) {  // a listening pipe without its client: its connection is an event too
    *attempt = Attempt::kNotArrived;
    return std::nullopt;
  }
  const bool consolidated = options_.consolidated;
  const Arrival arrival =
      e->look_ahead([&](MessagePeek& peek) { return reader_.arrival(peek, consolidated); },
                    Pipe::kTryRecvStashBytes, spin);
  if (arrival != Arrival::kWhole) {
    *attempt = arrival == Arrival::kIncomplete ? Attempt::kNotArrived : Attempt::kWouldWait;
    return std::nullopt;
  }
  *attempt = Attempt::kReceived;
  return recv_locked(*e, td, device);
}

bool PipeImpl::recv_ready(Micros spin) {
  if (closed_.load() || peer_closed_.load()) return true;  // recv() throws at once
  // Another receive running would take the message seen: not ready (it signals when done).
  std::unique_lock<std::mutex> lk(recv_mu_, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  auto e = link_if_connected();
  return e && e->recv_would_not_wait(spin);
}

std::string PipeImpl::recv_raw(size_t n) {
  std::lock_guard<std::mutex> lk(recv_mu_);
  auto e = link("recv");
  const at::Tensor buf = bytes_tensor(n);
  recv_bytes(*e, buf.data_ptr(), n, buf, "raw bytes");
  return std::string(static_cast<const char*>(buf.const_data_ptr()), n);
}

// ---- the peer, the counters, events -------------------------------------------------------------

std::string PipeImpl::peer() const {
  std::lock_guard<std::mutex> lk(ep_mu_);
  return ep_ ? ep_->peer() : closed_peer_;
}

std::string PipeImpl::transports() const {
  std::shared_ptr<Connection> e;
  {
    std::lock_guard<std::mutex> lk(ep_mu_);
    e = ep_;
  }
  return e ? e->transports() : std::string();
}

bool PipeImpl::peer_is_tensordict_cpp() const {
  std::lock_guard<std::mutex> lk(ep_mu_);
  return ep_ ? ep_->peer_info().ours : closed_peer_ours_;
}

PipeStats PipeImpl::stats() const {
  const auto& c = counters_;
  return {c.sends.load(),        c.schema_sends.load(), c.recvs.load(),
          c.schema_recvs.load(), c.bytes_sent.load(),   c.bytes_received.load()};
}

void PipeImpl::signal_event() const {
  // Locked: close() may be closing the fd.
  std::lock_guard<std::mutex> lk(event_mu_);
  if (watchers_.load() == 0 || event_fd_.load() < 0) return;
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(event_fd_.load(), &one, sizeof(one));
}

int PipeImpl::event_fd() {
  std::lock_guard<std::mutex> lk(event_mu_);
  if (event_fd_.load() < 0) {
    // A closed pipe released its fd (or never had one): none is made again.
    TD_CHECK_AS(PipeClosedError, !closed_.load(), "Cannot recv on a closed pipe.");
    const int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    TORCH_CHECK(fd >= 0, "pipe: eventfd failed: ", std::strerror(errno));
    event_fd_ = fd;
  }
  return event_fd_.load();
}

void PipeImpl::watch(bool on) {
  if (on) event_fd();  // made on first use (throws once a closed pipe released it)
  std::lock_guard<std::mutex> lk(event_mu_);
  const int fd = event_fd_.load();
  if (fd < 0) return;
  const int before = watchers_.load();
  const int after = std::max(0, before + (on ? 1 : -1));
  watchers_ = after;
  if (after == 0 && closed_.load()) {  // the last watcher of a closed pipe: release it
    ::close(fd);
    event_fd_ = -1;
    return;
  }
  // No worker: a caller's link (only the pipe's own events write the fd), or a closed pipe.
  if (!worker_) return;
  if (before == 0 && after == 1) worker_->watch(fd);
  if (before == 1 && after == 0) worker_->unwatch(fd);
}

// ---- lifecycle ----------------------------------------------------------------------------------

void PipeImpl::peer_left(Connection& e) {
  peer_closed_ = true;
  e.close(options_.timeout);
  TD_THROW(PeerClosedError, "recv: the peer ", e.peer(), " closed the pipe");
}

void PipeImpl::say_goodbye(Connection& e) noexcept {
  // A send in flight (another thread) or a partial one would put the marker mid-message.
  std::unique_lock<std::mutex> send_lk(send_mu_, std::try_to_lock);
  if (!send_lk.owns_lock()) return;
  // The reference reads any flag byte but 0x00 as the same-schema flag: no marker for it.
  if (e.peer_info().ours && at_message_boundary_) {
    try {  // not a transfer's message: the counters leave it out
      const OutFrame f = writer_.close_marker();
      e.send(f.data, f.n, f.owner, f.what, options_.timeout);
    } catch (...) {
      return;  // the peer is gone already
    }
  }
  if (options_.linger.count() > 0) e.drain(std::min(options_.linger, options_.timeout));
}

void PipeImpl::close() noexcept {
  if (closed_.exchange(true)) return;
  // Set once before close (listen), reset only below: read without ep_mu_, which an accept()
  // waiting for a client holds until this wakes it.
  if (listener_) listener_->close(options_.timeout);
  std::shared_ptr<Connection> e;
  std::shared_ptr<Listener> l;
  {
    std::lock_guard<std::mutex> lk(ep_mu_);
    e = ep_;
  }
  if (e) {
    if (!peer_closed_.load()) say_goodbye(*e);
    e->close(options_.timeout);
  }
  {
    // Released now rather than with the last handle: a closed pipe, healthy or broken, keeps
    // no link, worker, thread or descriptor (calls still running hold their own references,
    // and release them as they fail).
    std::lock_guard<std::mutex> lk(ep_mu_);
    if (ep_) {
      closed_peer_ = ep_->peer();
      closed_peer_ours_ = ep_->peer_info().ours;
    }
    ep_.reset();
    l = std::move(listener_);
  }
  std::shared_ptr<Worker> w;
  {
    std::lock_guard<std::mutex> lk(event_mu_);
    const int fd = event_fd_.load();
    if (fd >= 0) {
      const uint64_t one = 1;  // a loop waiting on this pipe looks again, and finds it closed
      [[maybe_unused]] auto n = ::write(fd, &one, sizeof(one));
      if (watchers_.load() > 0 && worker_) worker_->unwatch(fd);
      if (watchers_.load() == 0) {  // else the last unwatch closes it
        ::close(fd);
        event_fd_ = -1;
      }
    }
    w = std::move(worker_);
  }
  e.reset();
  l.reset();
  w.reset();  // the last reference joins the progress thread and releases UCX
}

}  // namespace tensordict::pipe::detail
