// Publication over the pipe: the two ends of the exchange (src/wire/publication_*.cpp) over a
// pipe's tag messages (docs/wire-format.md §9.7), each server client's thread serving it.
#include "tensordict/pipe/publication.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <mutex>

#include "pipe_link.h"
#include "tensordict/errors.h"
#include "ucx_endpoint.h"
#include "wire/publication_publisher.h"
#include "wire/publication_subscriber.h"

namespace tensordict::pipe {
namespace pub = wire::publication;

// ---- Publisher ------------------------------------------------------------------------------

struct Publisher::Impl {
  pub::PublisherCore core;
  std::mutex mutex;
  std::condition_variable idle;
  int serving = 0;  // clients whose thread is in core.serve()

  Impl(int64_t max_slots, pub::Transport transport) : core(max_slots, transport) {}
};

Publisher::Publisher(TensorDictServer& server, const PublisherOptions& options) {
  TORCH_CHECK_VALUE(options.max_slots >= 1, "Publisher: max_slots must be at least 1, got ",
                    options.max_slots);
  impl_ =
      std::make_shared<Impl>(options.max_slots, pub::transport_of("Publisher", options.transport));
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
    std::shared_ptr<detail::PipeLink> link;
    try {
      link = detail::pipe_link(pipe, "Publisher");
      detail::carry_publication(pipe);
    } catch (const c10::Error& e) {
      impl->core.lose(s, e.what_without_backtrace());
      return;
    } catch (const std::exception& e) {
      impl->core.lose(s, e.what());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(impl->mutex);
      ++impl->serving;
    }
    impl->core.serve(s, *link);
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

void Publisher::wait_for_subscribers(std::chrono::milliseconds timeout,
                                     std::optional<size_t> count) const {
  constexpr const char* kCall = "wait_for_subscribers";
  TORCH_CHECK_VALUE(count.has_value(), kCall,
                    ": a server's Publisher needs count=, the number of clients to wait for "
                    "(clients connect at any time)");
  impl_->core.wait_for_subscribers(
      kCall, timeout, count, "clients that connect but never pull run no Subscriber on their pipe");
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
  const pub::Transport transport = pub::transport_of(kCall, options.transport);
  const int64_t max_bytes = options.max_total_bytes.value_or(
      p.options().max_storage_bytes.value_or(default_storage_limit_bytes()));
  TORCH_CHECK_VALUE(max_bytes >= 0, kCall, ": max_total_bytes must not be negative, got ",
                    max_bytes);
  auto link = detail::pipe_link(p, kCall);
  const std::string who = c10::str("Subscriber.pull (", link->peer(), ")");
  TD_CHECK_AS(NoPublisherError, link->peer_is_ours(), who, ": the peer ", link->peer(),
              " is not a tensordict_cpp peer (the reference tensordict's pipe, which has no "
              "Publisher)");
  detail::carry_publication(p);
  impl_->core = std::make_unique<pub::SubscriberCore>(std::move(link), who, max_bytes, transport);
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
std::string Subscriber::transport() const { return impl_->core->transport(); }
std::vector<std::string> Subscriber::routed_around() const { return {}; }
void Subscriber::release() { impl_->core->release_pin(); }
const Pipe& Subscriber::pipe() const { return impl_->pipe; }

}  // namespace tensordict::pipe
