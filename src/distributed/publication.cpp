// Publication over a c10d group: the two ends of the exchange (src/wire/publication_*.cpp) over
// a group's tags (docs/wire-format.md §9.1), a thread per subscriber on the publisher.
#include "tensordict/distributed/publication.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <thread>

#include "group_link.h"
#include "peer.h"
#include "remote.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/errors.h"
#include "wire/publication_publisher.h"
#include "wire/publication_subscriber.h"

namespace tensordict::dist {
namespace pub = wire::publication;
using detail::Clock;

namespace {

void check_channel(const char* call, int64_t channel) {
  TORCH_CHECK_VALUE(channel >= 0 && channel <= pub::kMaxChannel, call, ": channel must be in [0, ",
                    pub::kMaxChannel, "], got ", channel);
}

}  // namespace

// ---- Publisher ------------------------------------------------------------------------------

struct Publisher::Impl {
  std::shared_ptr<pub::PublisherCore> core;
  Group group;
  int64_t channel = 0;
  std::vector<std::thread> threads;  // one per subscriber
};

Publisher::Publisher(const PublisherOptions& options) : impl_(std::make_shared<Impl>()) {
  constexpr const char* kCall = "Publisher";
  check_group_member(options.group, kCall);
  Impl& d = *impl_;
  d.group = detail::resolve_group(options.group);
  TORCH_CHECK_VALUE(options.max_slots >= 1, kCall, ": max_slots must be at least 1, got ",
                    options.max_slots);
  check_channel(kCall, options.channel);
  d.channel = options.channel;
  const int me = d.group.rank();
  const int size = d.group.size();
  std::vector<int64_t> ranks = options.subscribers;
  if (ranks.empty()) {
    for (int r = 0; r < size; ++r) {
      if (r != me) ranks.push_back(r);
    }
  }
  for (const int64_t r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < size && r != me, kCall, ": subscriber rank ", r,
                      " is not another rank of the group (size ", size, ", this rank ", me, ")");
    TORCH_CHECK_VALUE(std::count(ranks.begin(), ranks.end(), r) == 1, kCall, ": subscriber rank ",
                      r, " is listed twice");
  }
  d.core = std::make_shared<pub::PublisherCore>(options.max_slots,
                                                pub::transport_of(kCall, options.transport),
                                                pub::routing_of(kCall, options.route));
  for (const int64_t r : ranks) {
    SubscriberStats stats;
    stats.rank = r;
    stats.peer = c10::str("rank ", r);
    pub::PublisherCore::Subscription* s = &d.core->add(std::move(stats));
    d.threads.emplace_back([core = d.core, s, group = d.group, r, channel = d.channel] {
      detail::GroupLink link(group, static_cast<int>(r), channel);
      core->serve(*s, link);
    });
  }
}

Publisher::~Publisher() { close(); }

void Publisher::close() {
  impl_->core->close();
  for (auto& t : impl_->threads) {
    if (t.joinable()) t.join();
  }
}

int64_t Publisher::publish(const TensorDict& td, std::optional<std::chrono::milliseconds> timeout,
                           const std::optional<std::string>& tensorclass_type) {
  return impl_->core->publish(td, timeout, tensorclass_type);
}

uint64_t Publisher::epoch() const { return impl_->core->epoch(); }
int64_t Publisher::version() const { return impl_->core->version(); }
std::vector<SubscriberStats> Publisher::stats() const { return impl_->core->stats(); }

void Publisher::wait_for_subscribers(std::chrono::milliseconds timeout,
                                     std::optional<size_t> count) const {
  constexpr const char* kCall = "wait_for_subscribers";
  const size_t subscribers = impl_->threads.size();
  TORCH_CHECK_VALUE(!count || *count <= subscribers, kCall, ": count is ", count.value_or(0),
                    ", above the ", subscribers, " subscribers of this Publisher");
  impl_->core->wait_for_subscribers(
      kCall, timeout, count.value_or(subscribers),
      c10::str("they run no Subscriber of channel ", impl_->channel,
               " (not yet, or they run the reference tensordict, which has none)"));
}

// ---- Subscriber -----------------------------------------------------------------------------

struct Subscriber::Impl {
  detail::Peer peer;
  int64_t channel = 0;
  std::unique_ptr<pub::SubscriberCore> core;
};

Subscriber::Subscriber(const SubscriberOptions& options) : impl_(std::make_unique<Impl>()) {
  constexpr const char* kCall = "Subscriber";
  detail::check_p2p_peer(options.src, options.group_src, options.group, "src", "group_src");
  Impl& d = *impl_;
  d.peer = detail::resolve_peer(kCall, options.src, options.group_src, options.group, "src",
                                "group_src", true);
  TORCH_CHECK_VALUE(d.peer.rank != d.peer.group.rank(), kCall,
                    ": the publisher's rank is this process's own");
  check_channel(kCall, options.channel);
  d.channel = options.channel;
  // Relayed pieces come from, and go to, other ranks of the group than the publisher and this one.
  pub::RelayLinks relays = [group = d.peer.group, publisher = d.peer.rank,
                            channel = d.channel](int64_t rank) -> std::shared_ptr<pub::Link> {
    TD_CHECK_PEER(rank >= 0 && rank < group.size() && rank != group.rank() && rank != publisher,
                  "Subscriber.pull (rank ", publisher, "): the route names rank ", rank,
                  ", not another subscriber of the group (size ", group.size(), ", this rank ",
                  group.rank(), ")");
    return std::make_shared<detail::GroupLink>(group, static_cast<int>(rank), channel);
  };
  d.core = std::make_unique<pub::SubscriberCore>(
      std::make_shared<detail::GroupLink>(d.peer.group, d.peer.rank, d.channel),
      c10::str("Subscriber.pull (rank ", d.peer.rank, ")"),
      detail::resolve_max_total_bytes(kCall, options.max_total_bytes),
      pub::transport_of(kCall, options.transport), std::move(relays));
  // What a destroyed Subscriber of this channel left (a pull in flight, or its refusal), so
  // that the publisher's messages always find their receives.
  d.core->adopt(std::static_pointer_cast<pub::Leftover>(detail::LateMessages::get().take_kept(
      detail::GroupKey(d.peer.group), d.peer.rank, d.channel)));
}

Subscriber::~Subscriber() {
  if (auto left = impl_->core->release()) {
    detail::LateMessages::get().keep(detail::GroupKey(impl_->peer.group), impl_->peer.rank,
                                     impl_->channel, std::move(left));
  }
}

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
std::vector<std::string> Subscriber::routed_around() const { return impl_->core->routed_around(); }
void Subscriber::release() { impl_->core->release_pin(); }

}  // namespace tensordict::dist
