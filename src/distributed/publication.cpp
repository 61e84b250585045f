// Publication over a c10d group: the two ends of the exchange (src/wire/publication_*.cpp) over
// a group's tags (docs/wire-format.md §9.1), a thread per subscriber on the publisher.
#include "tensordict/distributed/publication.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "peer.h"
#include "remote.h"
#include "tensordict/distributed/process_group.h"
#include "wire/publication_publisher.h"
#include "wire/publication_subscriber.h"

namespace tensordict::dist {
namespace pub = wire::publication;
using detail::Clock;

namespace {

// A message posted on the group, as a timed-out call's are (late.h), so that a closing
// publisher can park it.
struct GroupPending final : pub::Pending {
  detail::MessagePtr message;
  at::Tensor copy_to;  // a parked receive taken over: its bytes go here once it completes
  std::optional<detail::TailStamp> stamp;  // a data receive's, telling a short message
};

// One peer's messages on one channel's tags. Gloo matches a peer's messages on one tag in
// order, and a send moves only once its receive is posted (so a request's send completes once
// the publisher has taken it).
class GroupLink final : public pub::Link {
 public:
  GroupLink(Group group, int rank, int64_t channel)
      : group_(std::move(group)), rank_(rank), channel_(channel) {}

  pub::PendingPtr post_recv(const at::Tensor& buffer, pub::Kind kind) override {
    auto p = std::make_shared<GroupPending>();
    const int tag = pub::tag_of(channel_, kind);
    // A receive that an earlier publisher of this channel left posted gets the next request.
    if (kind == pub::Kind::kRequest) {
      if (auto parked = detail::LateMessages::get().take(key(), rank_, tag)) {
        p->message = std::move(parked);
        p->copy_to = buffer;
        return p;
      }
    }
    if (kind == pub::Kind::kData) p->stamp.emplace(buffer);
    p->message = post(buffer, tag, /*is_recv=*/true);
    return p;
  }

  pub::PendingPtr post_send(const at::Tensor& buffer, pub::Kind kind) override {
    auto p = std::make_shared<GroupPending>();
    p->message = post(buffer, pub::tag_of(channel_, kind), /*is_recv=*/false);
    return p;
  }

  bool wait(const pub::PendingPtr& pending, Clock::time_point deadline) override {
    auto& p = static_cast<GroupPending&>(*pending);
    if (!p.message->done) {
      try {
        if (!detail::wait_until(p.message->work, deadline)) return false;
      } catch (const std::exception& e) {
        detail::rethrow_lost(e, c10::str("the connection to ", peer()));
      }
      p.message->done = true;
      if (p.copy_to.defined()) p.copy_to.copy_(p.message->buffer);
    }
    return true;
  }

  bool short_message(const pub::PendingPtr& pending) const override {
    const auto& p = static_cast<const GroupPending&>(*pending);
    return p.stamp && p.stamp->short_message();
  }

  void keep(const std::vector<pub::PendingPtr>& posted) override {
    std::vector<detail::MessagePtr> messages;
    for (const auto& p : posted) messages.push_back(static_cast<GroupPending&>(*p).message);
    detail::LateMessages::get().park(key(), rank_, messages);
  }

  std::string peer() const override { return c10::str("rank ", rank_); }

  std::string no_publisher() const override {
    return c10::str("no Publisher of channel ", channel_,
                    " runs there (none yet, or it runs the reference tensordict, which has "
                    "none)");
  }

 private:
  const void* key() const { return detail::group_key(group_); }

  detail::MessagePtr post(const at::Tensor& buffer, int tag, bool is_recv) {
    auto m = std::make_shared<detail::PostedMessage>();
    m->buffer = buffer;
    m->tag = tag;
    m->is_recv = is_recv;
    std::vector<at::Tensor> tensors{buffer};
    m->work = is_recv ? group_.recv(tensors, rank_, tag) : group_.send(tensors, rank_, tag);
    return m;
  }

  Group group_;
  int rank_;
  int64_t channel_;
};

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
  d.core = std::make_shared<pub::PublisherCore>(options.max_slots);
  for (const int64_t r : ranks) {
    SubscriberStats stats;
    stats.rank = r;
    stats.peer = c10::str("rank ", r);
    pub::PublisherCore::Subscription* s = &d.core->add(std::move(stats));
    d.threads.emplace_back([core = d.core, s, group = d.group, r, channel = d.channel] {
      GroupLink link(group, static_cast<int>(r), channel);
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

void Publisher::wait_for_subscribers(std::chrono::milliseconds timeout) const {
  impl_->core->wait_for_subscribers(
      "wait_for_subscribers", impl_->threads.size(), timeout,
      c10::str("they run no Subscriber of channel ", impl_->channel,
               " (not yet, or they run the reference tensordict, which has none)"));
}

// ---- Subscriber -----------------------------------------------------------------------------

namespace {

// Pulls that a destroyed Subscriber left in flight, per (group, rank, channel): the next
// Subscriber there takes them over, so the publisher's messages always find their receives.
std::mutex abandoned_mutex;
std::map<std::tuple<const void*, int, int64_t>, std::shared_ptr<pub::InFlight>>& abandoned() {
  static auto* map =
      new std::map<std::tuple<const void*, int, int64_t>, std::shared_ptr<pub::InFlight>>;
  return *map;
}

}  // namespace

struct Subscriber::Impl {
  detail::Peer peer;
  int64_t channel = 0;
  std::unique_ptr<pub::SubscriberCore> core;

  std::tuple<const void*, int, int64_t> key() const {
    return {detail::group_key(peer.group), peer.rank, channel};
  }
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
  d.core = std::make_unique<pub::SubscriberCore>(
      std::make_shared<GroupLink>(d.peer.group, d.peer.rank, d.channel),
      c10::str("Subscriber.pull (rank ", d.peer.rank, ")"),
      detail::resolve_max_total_bytes(kCall, options.max_total_bytes));
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  auto& left = abandoned();
  const auto it = left.find(d.key());
  if (it != left.end()) {
    d.core->adopt(std::move(it->second));
    left.erase(it);
  }
}

Subscriber::~Subscriber() {
  auto in_flight = impl_->core->release();
  if (!in_flight) return;
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  abandoned()[impl_->key()] = std::move(in_flight);
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

}  // namespace tensordict::dist
