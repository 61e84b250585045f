// Publication over the pipe: the two ends of the exchange (src/wire/publication_*.cpp) over a
// pipe's tag messages (docs/wire-format.md §9.7), each server client's thread serving it.
#include "tensordict/pipe/publication.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <mutex>

#include "pipe_impl.h"
#include "tensordict/errors.h"
#include "ucx_endpoint.h"
#include "wire/publication_publisher.h"
#include "wire/publication_subscriber.h"

namespace tensordict::pipe {
namespace pub = wire::publication;

namespace detail {
namespace {

const char* what_of(pub::Kind kind) {
  switch (kind) {
    case pub::Kind::kRequest: return "a publication request";
    case pub::Kind::kOffer: return "a publication offer";
    case pub::Kind::kSchema: return "a version's schema";
    case pub::Kind::kData: return "a version's data";
  }
  return "a publication message";
}

// The peer's close marker (docs/wire-format.md §6.7): 0xff, or eight of them (uncollated),
// received into `buffer`.
bool close_marker(const Op& op, const at::Tensor& buffer) {
  const auto* p = buffer.const_data_ptr<uint8_t>();
  if (op.length == 1) return p[0] == kCloseFlag;
  if (op.length != 8) return false;
  for (size_t i = 0; i < 8; ++i) {
    if (p[i] != kCloseFlag) return false;
  }
  return true;
}

struct PipePending final : pub::Pending {
  std::shared_ptr<Op> op;
  at::Tensor buffer;  // the Op lets go of its buffer once complete
  pub::Kind kind = pub::Kind::kRequest;
  bool recv = false;
};

// One pipe's messages, in order, on its tags (§6.6). A request goes as a synchronous send, which
// completes once the publisher has posted its receive.
class PipeLink final : public pub::Link {
 public:
  PipeLink(std::shared_ptr<Endpoint> ep, bool subscriber)
      : ep_(std::move(ep)), subscriber_(subscriber) {}

  pub::PendingPtr post_recv(const at::Tensor& buffer, pub::Kind kind) override {
    return post(buffer, kind, true);
  }
  pub::PendingPtr post_send(const at::Tensor& buffer, pub::Kind kind) override {
    return post(buffer, kind, false);
  }

  bool wait(const pub::PendingPtr& pending, Clock::time_point deadline) override {
    const auto& p = static_cast<const PipePending&>(*pending);
    if (!ep_->wait_message(p.op, deadline, p.recv, what_of(p.kind))) return false;
    const bool message = p.kind == pub::Kind::kRequest || p.kind == pub::Kind::kOffer;
    if (!p.recv || !message || p.op->length == pub::kMessageBytes) return true;
    if (close_marker(*p.op, p.buffer)) {
      if (subscriber_) {
        TD_THROW(NoPublisherError, "the Publisher on ", ep_->peer(), " closed (its pipe closed)");
      }
      TD_THROW(PeerClosedError, "the subscriber ", ep_->peer(), " closed its pipe");
    }
    const std::string why =
        c10::str("recv ", what_of(p.kind), ": peer ", ep_->peer(), " sent a message of ",
                 p.op->length, " bytes where ", pub::kMessageBytes, " were expected");
    ep_->fail(why);
    TD_THROW(MalformedPeerDataError, why);
  }

  bool short_message(const pub::PendingPtr& pending) const override {
    const auto& p = static_cast<const PipePending&>(*pending);
    return p.op->length < static_cast<size_t>(p.buffer.numel());
  }

  // The pipe is closed next (its server's thread ends): UCX cancels or delivers what is left.
  void keep(const std::vector<pub::PendingPtr>& /*posted*/) override {}

  std::string peer() const override { return ep_->peer(); }

  std::string no_publisher() const override {
    return "its server runs no Publisher (not yet, or it serves its pipes otherwise)";
  }

 private:
  pub::PendingPtr post(const at::Tensor& buffer, pub::Kind kind, bool recv) {
    auto p = std::make_shared<PipePending>();
    p->kind = kind;
    p->recv = recv;
    p->buffer = buffer;
    p->op = ep_->post_message(recv, kind == pub::Kind::kRequest, buffer.data_ptr(),
                              static_cast<size_t>(buffer.numel()), buffer, what_of(kind));
    return p;
  }

  std::shared_ptr<Endpoint> ep_;
  bool subscriber_;
};

// The endpoint of a pipe of ours (not over a caller's link), its client accepted: a
// publication's, once checked (then mark_publication). `call` names the caller in errors.
std::shared_ptr<Endpoint> publication_endpoint(const Pipe& pipe, const char* call) {
  auto ep = std::dynamic_pointer_cast<Endpoint>(PipeAccess::impl(pipe).publication_link(call));
  TORCH_CHECK_VALUE(ep != nullptr, call,
                    ": the pipe runs over a caller's link, whose messages "
                    "cannot be waited on apart; use a pipe of tensordict_cpp's own (connect, "
                    "listen, a TensorDictServer's)");
  return ep;
}

// From now on the pipe's own send() and recv() refuse.
void mark_publication(const Pipe& pipe) { PipeAccess::impl(pipe).carry_publication(); }

}  // namespace
}  // namespace detail

// ---- Publisher ------------------------------------------------------------------------------

struct Publisher::Impl {
  pub::PublisherCore core;
  std::mutex mutex;
  std::condition_variable idle;
  int serving = 0;  // clients whose thread is in core.serve()

  explicit Impl(int64_t max_slots) : core(max_slots) {}
};

Publisher::Publisher(TensorDictServer& server, const PublisherOptions& options) {
  TORCH_CHECK_VALUE(options.max_slots >= 1, "Publisher: max_slots must be at least 1, got ",
                    options.max_slots);
  impl_ = std::make_shared<Impl>(options.max_slots);
  server.serve([impl = impl_](Pipe& pipe) {
    SubscriberStats stats;
    stats.peer = pipe.peer();
    pub::PublisherCore::Subscription& s = impl->core.add(std::move(stats));
    if (!pipe.peer_is_tensordict_cpp()) {
      impl->core.lose(s, c10::str("the client ", pipe.peer(),
                                  " is not a tensordict_cpp peer (the reference tensordict's "
                                  "pipe, which has no Subscriber): its pipe was closed"));
      return;
    }
    std::shared_ptr<detail::Endpoint> ep;
    try {
      ep = detail::publication_endpoint(pipe, "Publisher");
      detail::mark_publication(pipe);
    } catch (const std::exception& e) {
      impl->core.lose(s, e.what());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(impl->mutex);
      ++impl->serving;
    }
    detail::PipeLink link(std::move(ep), /*subscriber=*/false);
    impl->core.serve(s, link);
    std::lock_guard<std::mutex> lock(impl->mutex);
    --impl->serving;
    impl->idle.notify_all();
  });
}

Publisher::~Publisher() { close(); }

void Publisher::close() {
  impl_->core.close();
  // Each client's serve() sees it within a slice of its waits; bounded all the same, for a
  // thread stuck in UCX (its pipe closes with the server).
  std::unique_lock<std::mutex> lock(impl_->mutex);
  impl_->idle.wait_for(lock, detail::kTeardownGrace, [&] { return impl_->serving == 0; });
}

int64_t Publisher::publish(const TensorDict& td, std::optional<std::chrono::milliseconds> timeout,
                           const std::optional<std::string>& tensorclass_type) {
  return impl_->core.publish(td, timeout, tensorclass_type);
}

uint64_t Publisher::epoch() const { return impl_->core.epoch(); }
int64_t Publisher::version() const { return impl_->core.version(); }
std::vector<SubscriberStats> Publisher::stats() const { return impl_->core.stats(); }

void Publisher::wait_for_subscribers(size_t count, std::chrono::milliseconds timeout) const {
  impl_->core.wait_for_subscribers(
      "wait_for_subscribers", count, timeout,
      "clients that connect but never pull run no Subscriber on their pipe");
}

// ---- Subscriber -----------------------------------------------------------------------------

struct Subscriber::Impl {
  Pipe pipe;
  std::unique_ptr<pub::SubscriberCore> core;
};

Subscriber::Subscriber(Pipe pipe, const SubscriberOptions& options)
    : impl_(std::make_unique<Impl>(Impl{std::move(pipe), nullptr})) {
  constexpr const char* kCall = "Subscriber";
  const Pipe& p = impl_->pipe;
  const int64_t max_bytes = options.max_total_bytes.value_or(
      p.options().max_storage_bytes.value_or(default_storage_limit_bytes()));
  TORCH_CHECK_VALUE(max_bytes >= 0, kCall, ": max_total_bytes must not be negative, got ",
                    max_bytes);
  auto ep = detail::publication_endpoint(p, kCall);
  const std::string who = c10::str("Subscriber.pull (", ep->peer(), ")");
  TD_CHECK_AS(NoPublisherError, ep->peer_info().ours, who, ": the peer ", ep->peer(),
              " is not a tensordict_cpp peer (the reference tensordict's pipe, which has no "
              "Publisher)");
  detail::mark_publication(p);
  impl_->core = std::make_unique<pub::SubscriberCore>(
      std::make_shared<detail::PipeLink>(std::move(ep), /*subscriber=*/true), who, max_bytes);
}

Subscriber::~Subscriber() = default;

std::optional<int64_t> Subscriber::pull(TensorDict& td, const PullOptions& options) {
  return impl_->core->pull(td, options);
}

std::optional<Pulled> Subscriber::pull(const PullOptions& options) {
  return impl_->core->pull(options);
}

void Subscriber::interrupt(bool on) { impl_->core->interrupt(on); }
int64_t Subscriber::version() const { return impl_->core->version(); }
uint64_t Subscriber::epoch() const { return impl_->core->epoch(); }
bool Subscriber::publisher_closed() const { return impl_->core->publisher_closed(); }
const Pipe& Subscriber::pipe() const { return impl_->pipe; }

}  // namespace tensordict::pipe
