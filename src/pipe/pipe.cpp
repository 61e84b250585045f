// TensorDictPipe: the framing of docs/wire-format.md §6.1 / §6.2 on top of a UCP stream endpoint.
// Each logical message of the reference (flag byte, u64 length, JSON, storage, leaves) is sent
// in order on one stream, so the byte sequence equals the reference's message sequence.
#include "tensordict/pipe/pipe.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "core/bytes.h"
#include "pipe_impl.h"
#include "tensordict/consolidate.h"
#include "tensordict/errors.h"
#include "tensordict/log.h"
#include "tensordict/transfer_stats.h"
#include "ucx_endpoint.h"
#include "ucx_listener.h"
#include "ucx_worker.h"

namespace tensordict::pipe {
namespace detail {
namespace {

std::optional<at::Device> first_leaf_device(const TensorDict& td) {
  for (const auto& [key, value] : td.entries()) {  // a lazy stack's entries: its members
    if (value.is_tensor()) return value.tensor().device();
    if (value.is_tensordict()) {
      if (auto d = first_leaf_device(value.tensordict())) return d;
    }
  }
  return std::nullopt;
}

// The reference's _infer_device: the TensorDict's device, else its first leaf's, else the CPU.
at::Device infer_device(const TensorDict& td) {
  if (td.device()) return *td.device();
  return first_leaf_device(td).value_or(at::Device(at::kCPU));
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "send: ", what, " is on ", t.device(),
                    "; this build of the pipe moves CPU memory only");
}

// The pipe's endpoint as the FrameReader's message source: reads count in the stats; a fault
// breaks the endpoint.
class LinkSource final : public ByteSource {
 public:
  LinkSource(PipeImpl& pipe, Link& e) : pipe_(pipe), e_(e) {}
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
    const size_t got = e_.recv_joined(flag, flag_owner, data, n, owner, what,
                                      pipe_.options.timeout);
    pipe_.counted(e_, false, got, what);
    return got;
  }
  void fail(const std::string& why) override { e_.fail(why); }
  [[noreturn]] void peer_left() override { pipe_.peer_left(e_); }
  std::string peer() const override { return e_.peer(); }

 private:
  PipeImpl& pipe_;
  Link& e_;
};

// A PipeLink as the pipe's Link: each call goes to the caller's functions.
class UserLink final : public Link {
 public:
  explicit UserLink(PipeLink link) : link_(std::move(link)) {
    TORCH_CHECK_VALUE(link_.send && link_.recv, "Pipe::over: the link needs send and recv");
    if (link_.peer_tag) {
      // The peer's tag as the peer-info exchange gave it: our mark tells a peer of ours.
      uint8_t bytes[16];
      write_peer_info(*link_.peer_tag, bytes);
      info_ = read_peer_info(bytes);
    }
  }
  void send(const void* data, size_t n, const at::Tensor&, const char* what, Millis) override {
    check_open("send", what);
    link_.send(data, n);
  }
  void send_credit(const void* data, size_t n, const at::Tensor& owner, const char* what, size_t,
                   Millis timeout) override {
    send(data, n, owner, what, timeout);
  }
  void recv(void* data, size_t n, const at::Tensor&, const char* what, Millis) override {
    check_open("recv", what);
    link_.recv(data, n);
  }
  bool drain(Millis) override { return true; }
  void close(Millis) noexcept override {
    if (closed_.exchange(true) || !link_.close) return;
    try {
      link_.close();
    } catch (...) {
      // close() never throws; the link is gone either way
    }
  }
  bool peer_gone() const override { return false; }
  void fail(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (failure_.empty()) failure_ = why;
    }
    close(Millis(0));
  }
  const std::string& peer() const override { return link_.peer; }
  const PeerInfo& peer_info() const override { return info_; }
  std::string transports() override { return "the caller's link"; }

 private:
  void check_open(const char* op, const char* what) const {
    std::lock_guard<std::mutex> lk(mu_);
    TD_CHECK_AS(PeerLostError, failure_.empty(), op, " ", what, ": the pipe to ", link_.peer,
                " is broken: ", failure_);
    TD_CHECK_AS(PipeClosedError, !closed_.load(), op, " ", what, ": the pipe to ", link_.peer,
                " is closed");
  }
  PipeLink link_;
  PeerInfo info_;
  std::atomic<bool> closed_{false};
  mutable std::mutex mu_;
  std::string failure_;  // set by fail(), from the pipe's threads
};

}  // namespace

size_t Link::recv_joined(uint8_t*, const at::Tensor&, void*, size_t, const at::Tensor&,
                         const char*, Millis) {
  TORCH_INTERNAL_ASSERT(false, "recv_joined on a link that does not join frames");
}

void log_connected(Link& e, const char* how) {
  if (!log_enabled(LogLevel::kInfo)) return;
  log(LogLevel::kInfo, c10::str("pipe ", how, " ", e.peer(), " (",
                                e.peer_info().ours ? "a tensordict-cpp peer" : "a ucxx peer",
                                "), UCX transports: ", e.transports()));
}

Transfer::Transfer(PipeImpl& pipe, Link& e, bool sent)
    : pipe_(pipe), e_(e), sent_(sent), start_(::tensordict::detail::transfer_ticks()),
      bytes_(sent ? pipe.counters.bytes_sent.load() : pipe.counters.bytes_received.load()),
      schemas_(sent ? pipe.counters.schema_sends.load() : pipe.counters.schema_recvs.load()) {}

int64_t Transfer::bytes() const {
  const auto& c = pipe_.counters;
  return (sent_ ? c.bytes_sent.load() : c.bytes_received.load()) - bytes_;
}

void Transfer::done() const {
  const int64_t ticks = ::tensordict::detail::finish_transfer(Channel::kPipe, start_);
  if (!log_enabled(LogLevel::kInfo)) return;
  const std::string took = ::tensordict::detail::micros_text(ticks);
  const auto& c = pipe_.counters;
  const bool schema = (sent_ ? c.schema_sends.load() : c.schema_recvs.load()) > schemas_;
  log(LogLevel::kInfo,
      c10::str("pipe ", sent_ ? "send to " : "recv from ", e_.peer(), ": ",
               !pipe_.options.consolidated ? "uncollated" : schema ? "new schema" : "same schema",
               ", ", bytes(), " bytes in ", took));
}

PipeImpl::PipeImpl(PipeOptions opts, std::shared_ptr<Worker> w)
    : options(std::move(opts)),
      worker(std::move(w)),
      reader(FrameLimits{options.max_metadata_bytes, options.max_storage_bytes}) {
  TORCH_CHECK_VALUE(options.timeout.count() > 0, "pipe: timeout must be positive");
  TORCH_CHECK_VALUE(options.max_metadata_bytes > 0 && options.max_storage_bytes >= 0,
                    "pipe: the size caps must be positive");
  TORCH_CHECK_VALUE(options.max_unreceived >= 1 && options.max_unreceived <= (1 << 20),
                    "pipe: max_unreceived must be in [1, 2^20], got ", options.max_unreceived);
  TORCH_CHECK_VALUE(options.linger.count() >= 0, "pipe: linger must not be negative");
  send_scratch = bytes_tensor(16);
  credit_ring = bytes_tensor(static_cast<size_t>(options.max_unreceived + 1) * 8);
}

PipeImpl::~PipeImpl() {
  close();  // unwatched the worker, which it released
  if (event_fd.load() >= 0) ::close(event_fd.load());
}

void PipeImpl::signal_event() const {
  // Locked: close() may be closing the fd.
  std::lock_guard<std::mutex> lk(event_mu);
  if (watchers.load() == 0 || event_fd.load() < 0) return;
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(event_fd.load(), &one, sizeof(one));
}

std::shared_ptr<Link> PipeImpl::endpoint(const char* op) {
  std::lock_guard<std::mutex> lk(ep_mu);
  TD_CHECK_AS(PipeClosedError, !closed.load(), "Cannot ", op, " on a closed pipe.");
  TD_CHECK_AS(PeerClosedError, !peer_closed.load(), op, ": the peer closed the pipe");
  TORCH_CHECK(!publication.load(), op, ": this pipe carries a publication (a Subscriber pulls "
              "on it, or a Publisher serves it) and moves nothing else");
  if (ep) return ep;
  TORCH_INTERNAL_ASSERT(listener != nullptr);
  ep = listener->accept(options.timeout);
  TD_CHECK_AS(PipeClosedError, !closed.load(), "Cannot ", op, " on a closed pipe.");
  TORCH_CHECK(ep != nullptr, op, ": no client connected to port ", port, " within ",
              options.timeout.count(), " ms");
  log_connected(*ep, "accepted");
  return ep;
}

std::shared_ptr<Link> PipeImpl::endpoint_if_connected() {
  std::lock_guard<std::mutex> lk(ep_mu);
  TORCH_CHECK(!publication.load(), "this pipe carries a publication (a Subscriber pulls on it, "
              "or a Publisher serves it) and moves nothing else");
  if (ep || !listener || closed.load()) return ep;
  ep = listener->accept(Millis(0));
  if (ep) log_connected(*ep, "accepted");
  return ep;
}

Millis PipeImpl::send_wait() const {
  if (!send_deadline) return options.timeout;
  const auto left = std::chrono::duration_cast<Millis>(*send_deadline - Clock::now());
  return std::clamp(left, Millis(0), options.timeout);
}

void PipeImpl::send_bytes(Link& e, const void* data, size_t n, const at::Tensor& owner,
                          const char* what) {
  e.send(data, n, owner, what, send_wait());
  counted(e, true, n, what);
}

void PipeImpl::send_first(Link& e, const void* data, size_t n, const char* what) {
  auto* slot = credit_ring.data_ptr<uint8_t>() + (credits_sent % (options.max_unreceived + 1)) * 8;
  std::memcpy(slot, data, n);
  send_credit(e, slot, n, credit_ring, what);
}

void PipeImpl::send_credit(Link& e, const void* data, size_t n, const at::Tensor& owner,
                           const char* what) {
  e.send_credit(data, n, owner, what, static_cast<size_t>(options.max_unreceived), send_wait());
  ++credits_sent;
  counted(e, true, n, what);
}

void PipeImpl::recv_bytes(Link& e, void* data, size_t n, const at::Tensor& owner,
                          const char* what) {
  e.recv(data, n, owner, what, options.timeout);
  counted(e, false, n, what);
}

void PipeImpl::counted(Link& e, bool sent, size_t n, const char* what) {
  const auto bytes = static_cast<int64_t>(n);
  count(sent ? &Counters::bytes_sent : &Counters::bytes_received, bytes);
  ::tensordict::detail::count_messages(Channel::kPipe, sent, 1, bytes);
  if (log_enabled(LogLevel::kDebug)) {
    log(LogLevel::kDebug, c10::str("pipe ", sent ? "send to " : "recv from ", e.peer(), ": ", what,
                                   ", ", n, " bytes"));
  }
}

// ---- consolidated mode (§6.1) -----------------------------------------------------------------

void PipeImpl::send_consolidated(Link& e, const TensorDict& td) {
  const TensorDict tdc =
      is_consolidated(td) ? td : consolidate(td, {.device = infer_device(td)});
  const auto state = tdc.consolidated_state();
  TORCH_INTERNAL_ASSERT(state && state->metadata);
  const at::Tensor& storage = state->storage;
  check_cpu(storage, "the consolidated storage");
  // The schema is the sorted JSON text itself rather than its SHA-256 (the reference's
  // _metadata_hash): comparing the text is exact, and no cheaper to get wrong. The state makes
  // it once and keeps it; it is compared only when the metadata object changes (a consolidated
  // TensorDict keeps the same one).
  bool new_schema = false;
  if (state->metadata != last_sent_metadata) {
    const std::string& schema = state->sorted_json();
    new_schema = schema != last_sent_schema;
    last_sent_metadata = state->metadata;
    last_sent_schema = schema;
  }
  new_schema = new_schema || !sent_once;
  auto* scratch = send_scratch.data_ptr<uint8_t>();
  if (new_schema) {
    // Insertion order with the transport keys last, as 0.15.3's json.dumps writes it (the
    // schema is compared on the sorted form above).
    const std::string json = metadata_to_json(
        *state->metadata, /*sort_keys=*/false,
        {{"_total_bytes", storage.numel()}, {"_device", storage.device().str()}});
    scratch[0] = kNewSchemaFlag;
    core::put_le(scratch + 8, json.size());
    send_first(e, scratch, 1, "the flag byte");
    send_bytes(e, scratch + 8, 8, send_scratch, "the metadata length");
    const at::Tensor json_bytes = bytes_tensor(json);
    send_bytes(e, json_bytes.data_ptr(), json.size(), json_bytes, "the metadata");
  } else if (e.joins_frames() && storage.numel() <= kMaxJoinedStorage) {
    send_joined(e, storage);
    return;
  } else {
    scratch[0] = kSameSchemaFlag;
    send_first(e, scratch, 1, "the flag byte");
  }
  sent_once = true;
  send_bytes(e, storage.data_ptr(), static_cast<size_t>(storage.numel()), storage, "the storage");
  count(&Counters::schema_sends, new_schema ? 1 : 0);
}

Pipe::SendAttempt PipeImpl::sends_without_waiting(Link& e, const TensorDict& td,
                                                   Micros spin) {
  // One joined credit message is copied and handed to UCX: only the window can make it wait.
  using Attempt = Pipe::SendAttempt;
  if (!options.consolidated || !e.joins_frames() || !sent_once || !is_consolidated(td)) {
    return Attempt::kWouldWait;
  }
  const auto state = td.consolidated_state();
  const at::Tensor& storage = state->storage;
  if (!storage.device().is_cpu() || storage.numel() > kMaxJoinedStorage) {
    return Attempt::kWouldWait;
  }
  if (state->metadata != last_sent_metadata && state->sorted_json() != last_sent_schema) {
    return Attempt::kWouldWait;
  }
  return e.credit_available(static_cast<size_t>(options.max_unreceived), spin)
             ? Attempt::kSent
             : Attempt::kWindowFull;
}

void PipeImpl::send_locked(Link& e, const TensorDict& td) {
  const Transfer transfer(*this, e, /*sent=*/true);
  at_message_boundary = false;
  if (options.consolidated) {
    send_consolidated(e, td);
  } else {
    send_uncollated(e, td);
  }
  at_message_boundary = true;
  count(&Counters::sends, 1);
  transfer.done();
}

void PipeImpl::send_joined(Link& e, const at::Tensor& storage) {
  // A copy, as the credit ring's: a credit send may still be in flight when send() returns,
  // while the caller may write its storage at once. The staging buffer is reused unless a send
  // in flight still holds it (its Op's reference).
  const auto n = static_cast<size_t>(storage.numel());
  if (!joined_staging.defined() || joined_staging.use_count() > 1) {
    joined_staging = bytes_tensor(1 + kMaxJoinedStorage);
  }
  auto* out = joined_staging.data_ptr<uint8_t>();
  out[0] = kSameSchemaFlag;
  if (n > 0) std::memcpy(out + 1, storage.const_data_ptr(), n);
  send_credit(e, out, 1 + n, joined_staging, "the flag byte and the storage");
}

TensorDict PipeImpl::recv_consolidated(Link& e, const std::optional<TensorDict>& td,
                                       std::optional<at::Device> device) {
  LinkSource src(*this, e);
  bool new_schema = false;
  TensorDict out = reader.recv_consolidated(src, td, device, &new_schema);
  count(&Counters::schema_recvs, new_schema ? 1 : 0);
  return out;
}

// ---- uncollated mode (§6.2, in the form tensordict 0.15.3 sends) -----------------------------
// The header and leaves of wire/pipe_frames.h's UncollatedFrame, after the header's length. A
// receiver that knows only keys/dtypes/shapes reads the top-level case; ours reads both forms.

void PipeImpl::send_uncollated(Link& e, const TensorDict& td) {
  const UncollatedFrame frame = uncollated_frame(td, [](const NestedKey& key, const at::Tensor& t) {
    check_cpu(t, c10::str("leaf ", key.str()).c_str());
  });
  const std::string& header = frame.header;
  auto* scratch = send_scratch.data_ptr<uint8_t>();
  core::put_le(scratch, header.size());
  send_first(e, scratch, 8, "the header length");
  const at::Tensor header_bytes = bytes_tensor(header);
  send_bytes(e, header_bytes.data_ptr(), header.size(), header_bytes, "the header");
  for (const at::Tensor& t : frame.leaves) send_bytes(e, t.data_ptr(), t.nbytes(), t, "a leaf");
}

TensorDict PipeImpl::recv_uncollated(Link& e, std::optional<at::Device> device) {
  LinkSource src(*this, e);
  return reader.recv_uncollated(src, device);
}

// ---- lifecycle ----------------------------------------------------------------------------------

void PipeImpl::peer_left(Link& e) {
  peer_closed = true;
  e.close(options.timeout);
  TD_THROW(PeerClosedError, "recv: the peer ", e.peer(), " closed the pipe");
}

void PipeImpl::say_goodbye(Link& e) noexcept {
  // A send in flight (another thread) or a partial one would put the marker mid-message.
  std::unique_lock<std::mutex> send_lk(send_mu, std::try_to_lock);
  if (!send_lk.owns_lock()) return;
  // The reference reads any flag byte but 0x00 as the same-schema flag: no marker for it.
  if (e.peer_info().ours && at_message_boundary) {
    try {
      std::memset(send_scratch.data_ptr(), kCloseFlag, 8);
      e.send(send_scratch.data_ptr(), options.consolidated ? 1 : 8, send_scratch,
             "the close marker", options.timeout);
    } catch (...) {
      return;  // the peer is gone already
    }
  }
  if (options.linger.count() > 0) e.drain(std::min(options.linger, options.timeout));
}

void PipeImpl::close() noexcept {
  if (closed.exchange(true)) return;
  // Set once before close (listen), reset only below: read without ep_mu, which an accept()
  // waiting for a client holds until this wakes it.
  if (listener) listener->close(options.timeout);
  std::shared_ptr<Link> e;
  std::shared_ptr<Listener> l;
  {
    std::lock_guard<std::mutex> lk(ep_mu);
    e = ep;
  }
  if (e) {
    if (!peer_closed.load()) say_goodbye(*e);
    e->close(options.timeout);
  }
  {
    // Released now rather than with the last handle: a closed pipe, healthy or broken, keeps
    // no endpoint, worker, thread or descriptor (calls still running hold their own
    // references, and release them as they fail).
    std::lock_guard<std::mutex> lk(ep_mu);
    if (ep) {
      closed_peer = ep->peer();
      closed_peer_ours = ep->peer_info().ours;
    }
    ep.reset();
    l = std::move(listener);
  }
  std::shared_ptr<Worker> w;
  {
    std::lock_guard<std::mutex> lk(event_mu);
    const int fd = event_fd.load();
    if (fd >= 0) {
      const uint64_t one = 1;  // a loop waiting on this pipe looks again, and finds it closed
      [[maybe_unused]] auto n = ::write(fd, &one, sizeof(one));
      if (watchers.load() > 0 && worker) worker->unwatch(fd);
      if (watchers.load() == 0) {  // else the last unwatch closes it
        ::close(fd);
        event_fd = -1;
      }
    }
    w = std::move(worker);
  }
  e.reset();
  l.reset();
  w.reset();  // the last reference joins the progress thread and releases UCX
}

}  // namespace detail

// ---- Pipe -------------------------------------------------------------------------------------

using detail::PipeImpl;

Pipe::Pipe(std::shared_ptr<PipeImpl> impl) : impl_(std::move(impl)) {}

Pipe Pipe::listen(int port, const std::string& host, const PipeOptions& options) {
  auto impl = std::make_shared<PipeImpl>(options, detail::Worker::create(options.spin));
  impl->listener = detail::Listener::create(impl->worker, host, port, /*max_clients=*/1);
  impl->port = impl->listener->port();
  return Pipe(std::move(impl));
}

Pipe Pipe::connect(const std::string& host, int port, const PipeOptions& options) {
  auto impl = std::make_shared<PipeImpl>(options, detail::Worker::create(options.spin));
  impl->ep = detail::Endpoint::connect(impl->worker, host, port, options.timeout);
  impl->port = port;
  detail::log_connected(*impl->ep, "connected to");
  return Pipe(std::move(impl));
}

Pipe Pipe::over(PipeLink link, const PipeOptions& options) {
  auto impl = std::make_shared<PipeImpl>(options, nullptr);
  impl->ep = std::make_shared<detail::UserLink>(std::move(link));
  return Pipe(std::move(impl));
}

void Pipe::send(const TensorDict& td, const PipeSendOptions& send_options) {
  std::lock_guard<std::mutex> lk(impl_->send_mu);
  auto e = impl_->endpoint("send");
  if (send_options.deadline) {
    TD_CHECK_AS(TimeoutError, detail::Clock::now() < *send_options.deadline,
                "send: the deadline passed before the send could start (queued behind earlier "
                "sends to ", e->peer(), "); nothing was sent");
  }
  impl_->send_deadline = send_options.deadline;
  try {
    impl_->send_locked(*e, td);
  } catch (...) {
    impl_->send_deadline.reset();
    throw;
  }
  impl_->send_deadline.reset();
}

Pipe::SendAttempt Pipe::try_send(const TensorDict& td, std::chrono::microseconds spin) {
  std::unique_lock<std::mutex> lk(impl_->send_mu, std::try_to_lock);
  // Another send running, a closed pipe, no client yet: send() waits, or throws.
  if (!lk.owns_lock() || impl_->closed.load()) return SendAttempt::kWouldWait;
  auto e = impl_->endpoint_if_connected();
  if (!e) return SendAttempt::kWouldWait;
  const SendAttempt attempt = impl_->sends_without_waiting(*e, td, spin);
  if (attempt == SendAttempt::kSent) impl_->send_locked(*e, td);
  return attempt;
}

TensorDict detail::PipeImpl::recv_locked(detail::Link& e, const std::optional<TensorDict>& td,
                                         std::optional<at::Device> device) {
  const detail::Transfer transfer(*this, e, /*sent=*/false);
  TensorDict out = options.consolidated ? recv_consolidated(e, td, device)
                                        : recv_uncollated(e, device);
  count(&detail::Counters::recvs, 1);
  last_recv_bytes = transfer.bytes();
  transfer.done();
  signal_event();  // a loop that found this receive running looks again
  return out;
}

TensorDict Pipe::recv(const std::optional<TensorDict>& td, std::optional<at::Device> device) {
  std::lock_guard<std::mutex> lk(impl_->recv_mu);
  auto e = impl_->endpoint("recv");
  return impl_->recv_locked(*e, td, device);
}

std::optional<TensorDict> Pipe::try_recv(RecvAttempt* attempt, const std::optional<TensorDict>& td,
                                         std::optional<at::Device> device,
                                         std::chrono::microseconds spin) {
  TORCH_CHECK_VALUE(attempt != nullptr, "try_recv: attempt must not be null");
  std::unique_lock<std::mutex> lk(impl_->recv_mu, std::try_to_lock);
  if (!lk.owns_lock()) {  // another receive running would take what is seen
    *attempt = RecvAttempt::kWouldWait;
    return std::nullopt;
  }
  if (impl_->closed.load() || impl_->peer_closed.load()) impl_->endpoint("recv");  // throws
  auto e = impl_->endpoint_if_connected();
  if (!e) {  // a listening pipe without its client: its connection is an event too
    *attempt = RecvAttempt::kNotArrived;
    return std::nullopt;
  }
  const bool consolidated = impl_->options.consolidated;
  const detail::Arrival arrival = e->look_ahead(
      [&](detail::MessagePeek& peek) { return impl_->reader.arrival(peek, consolidated); },
      kTryRecvStashBytes, spin);
  if (arrival != detail::Arrival::kWhole) {
    *attempt = arrival == detail::Arrival::kIncomplete ? RecvAttempt::kNotArrived
                                                       : RecvAttempt::kWouldWait;
    return std::nullopt;
  }
  *attempt = RecvAttempt::kReceived;
  return impl_->recv_locked(*e, td, device);
}


bool Pipe::recv_ready(std::chrono::microseconds spin) {
  if (impl_->closed.load() || impl_->peer_closed.load()) return true;  // recv() throws at once
  // Another receive running would take the message seen: not ready (it signals when done).
  std::unique_lock<std::mutex> lk(impl_->recv_mu, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  auto e = impl_->endpoint_if_connected();
  return e && e->recv_would_not_wait(spin);
}

int64_t Pipe::last_recv_bytes() const { return impl_->last_recv_bytes.load(); }

int Pipe::event_fd() {
  std::lock_guard<std::mutex> lk(impl_->event_mu);
  if (impl_->event_fd.load() < 0) {
    // A closed pipe released its fd (or never had one): none is made again.
    TD_CHECK_AS(PipeClosedError, !impl_->closed.load(), "Cannot recv on a closed pipe.");
    const int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    TORCH_CHECK(fd >= 0, "pipe: eventfd failed: ", std::strerror(errno));
    impl_->event_fd = fd;
  }
  return impl_->event_fd.load();
}

void Pipe::watch(bool on) {
  if (on) event_fd();  // made on first use (throws once a closed pipe released it)
  std::lock_guard<std::mutex> lk(impl_->event_mu);
  const int fd = impl_->event_fd.load();
  if (fd < 0) return;
  const int before = impl_->watchers.load();
  const int after = std::max(0, before + (on ? 1 : -1));
  impl_->watchers = after;
  if (after == 0 && impl_->closed.load()) {  // the last watcher of a closed pipe: release it
    ::close(fd);
    impl_->event_fd = -1;
    return;
  }
  // No worker: a caller's link (only the pipe's own events write the fd), or a closed pipe.
  if (!impl_->worker) return;
  if (before == 0 && after == 1) impl_->worker->watch(fd);
  if (before == 1 && after == 0) impl_->worker->unwatch(fd);
}

void Pipe::accept() { impl_->endpoint("accept"); }

void Pipe::close() noexcept { impl_->close(); }
bool Pipe::closed() const { return impl_->closed.load(); }
bool Pipe::peer_closed() const { return impl_->peer_closed.load(); }
int Pipe::port() const { return impl_->port; }

std::string Pipe::transports() const {
  std::shared_ptr<detail::Link> e;
  {
    std::lock_guard<std::mutex> lk(impl_->ep_mu);
    e = impl_->ep;
  }
  return e ? e->transports() : std::string();
}

bool Pipe::peer_is_tensordict_cpp() const {
  std::lock_guard<std::mutex> lk(impl_->ep_mu);
  return impl_->ep ? impl_->ep->peer_info().ours : impl_->closed_peer_ours;
}

std::string Pipe::peer() const {
  std::lock_guard<std::mutex> lk(impl_->ep_mu);
  return impl_->ep ? impl_->ep->peer() : impl_->closed_peer;
}

const PipeOptions& Pipe::options() const { return impl_->options; }

PipeStats Pipe::stats() const {
  const auto& c = impl_->counters;
  return {c.sends.load(), c.schema_sends.load(), c.recvs.load(), c.schema_recvs.load(),
          c.bytes_sent.load(), c.bytes_received.load()};
}

void Pipe::send_raw(const TestKey& /*key*/, const void* data, size_t n) {
  std::lock_guard<std::mutex> lk(impl_->send_mu);
  auto e = impl_->endpoint("send");
  impl_->at_message_boundary = false;  // the framing is the caller's now
  const at::Tensor copy = detail::bytes_tensor(std::string(static_cast<const char*>(data), n));
  impl_->send_bytes(*e, copy.data_ptr(), n, copy, "raw bytes");
}

std::string Pipe::recv_raw(const TestKey& /*key*/, size_t n) {
  std::lock_guard<std::mutex> lk(impl_->recv_mu);
  auto e = impl_->endpoint("recv");
  const at::Tensor buf = detail::bytes_tensor(n);
  impl_->recv_bytes(*e, buf.data_ptr(), n, buf, "raw bytes");
  return std::string(static_cast<const char*>(buf.const_data_ptr()), n);
}

}  // namespace tensordict::pipe
