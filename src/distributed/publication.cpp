// Publication over a c10d group: the two ends of the exchange (src/wire/publication_*.cpp) over
// a group's tags (docs/wire-format.md §9.1), a thread per subscriber on the publisher.
#include "tensordict/distributed/publication.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <thread>

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
  pub::Kind kind = pub::Kind::kRequest;
};

const char* what_of(pub::Kind kind) {
  switch (kind) {
    case pub::Kind::kRequest: return "request";
    case pub::Kind::kOffer: return "offer";
    case pub::Kind::kSchema: return "schema";
    case pub::Kind::kData: return "data";
    case pub::Kind::kWatch: return "watch";
  }
  return "message";
}

// How long a wait runs before it looks at the link's watch.
constexpr auto kWatchSlice = std::chrono::milliseconds(100);

// One peer's messages on one channel's tags. Gloo matches a peer's messages on one tag in
// order, and a send moves only once its receive is posted (so a request's send completes once
// the publisher has taken it). Gloo fails a lost connection's posted receives, but not the one
// whose bytes it is reading, nor always a send: a receive kept posted on the channel's watch
// tag, on which nothing is sent, tells a lost peer to every wait within a slice.
class GroupLink final : public pub::Link {
 public:
  GroupLink(Group group, int rank, int64_t channel)
      : group_(std::move(group)), key_(group_), rank_(rank), channel_(channel) {
    const int tag = pub::tag_of(channel_, pub::Kind::kWatch);
    // Posted once per channel and peer (a Gloo receive cannot be withdrawn): an earlier link's
    // is taken over.
    watch_ = detail::LateMessages::get().take(key_, rank_, tag);
    if (!watch_) watch_ = post(pub::message_buffer(), tag, /*is_recv=*/true);
  }
  ~GroupLink() override { detail::LateMessages::get().park(key_, rank_, {watch_}); }

  pub::PendingPtr post_recv(const at::Tensor& buffer, pub::Kind kind) override {
    auto p = std::make_shared<GroupPending>();
    p->kind = kind;
    const int tag = pub::tag_of(channel_, kind);
    // A receive that an earlier publisher of this channel left posted gets the next request.
    if (kind == pub::Kind::kRequest) {
      if (auto parked = detail::LateMessages::get().take(key_, rank_, tag)) {
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
    p->kind = kind;
    p->message = post(buffer, pub::tag_of(channel_, kind), /*is_recv=*/false);
    return p;
  }

  bool wait(const pub::PendingPtr& pending, Clock::time_point deadline) override {
    auto& p = static_cast<GroupPending&>(*pending);
    while (!p.message->done) {
      const auto end = std::min(deadline, Clock::now() + kWatchSlice);
      try {
        if (detail::wait_until(p.message->work, end)) {
          p.message->done = true;
          break;
        }
      } catch (const std::exception& e) {
        detail::rethrow_lost(e, c10::str("the connection to ", peer()));
      }
      // Once a slice of waiting (a poll's waits of nothing cost no look).
      if (Clock::now() - looked_ >= kWatchSlice) look_at_watch();
      if (end >= deadline) return false;
    }
    TD_CHECK_PEER(!p.message->long_message(), peer(), " sent a publication ", what_of(p.kind),
                  " longer than the ", p.message->buffer.nbytes(),
                  " bytes announced (it ran into the room kept after them)");
    if (p.copy_to.defined()) {
      p.copy_to.copy_(p.message->buffer);
      p.copy_to = at::Tensor();
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
    detail::LateMessages::get().park(key_, rank_, messages);
  }

  std::string peer() const override { return c10::str("rank ", rank_); }

  std::string no_publisher() const override {
    return c10::str("no Publisher of channel ", channel_,
                    " runs there (none yet, or it runs the reference tensordict, which has "
                    "none)");
  }

 private:
  detail::MessagePtr post(const at::Tensor& buffer, int tag, bool is_recv) {
    auto m = std::make_shared<detail::PostedMessage>();
    m->buffer = buffer;
    m->tag = tag;
    m->is_recv = is_recv;
    // A receive buffer from recv_buffer() is posted with its room, a stamp at the room's start.
    std::vector<at::Tensor> tensors{
        is_recv ? detail::with_room(buffer, std::numeric_limits<int64_t>::max()) : buffer};
    if (tensors[0].nbytes() > buffer.nbytes()) {
      m->beyond.emplace(wire::stamp_beyond(tensors[0], static_cast<int64_t>(buffer.nbytes())));
    }
    m->work = is_recv ? group_.recv(tensors, rank_, tag) : group_.send(tensors, rank_, tag);
    return m;
  }

  // PeerLostError when Gloo failed the watch (the connection is lost); a message on it is a
  // peer that breaks the protocol.
  void look_at_watch() {
    looked_ = Clock::now();
    if (watch_->done) return;
    bool came = false;
    try {
      came = detail::wait_until(watch_->work, Clock::now());
    } catch (const std::exception& e) {
      detail::rethrow_lost(e, c10::str("the connection to ", peer()));
    }
    watch_->done = came;
    TD_CHECK_PEER(!came, peer(), " sent a message on channel ", channel_,
                  "'s watch tag, on which nothing is ever sent");
  }

  Group group_;
  detail::GroupKey key_;
  int rank_;
  int64_t channel_;
  detail::MessagePtr watch_;
  Clock::time_point looked_ = Clock::now();
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
  d.core = std::make_unique<pub::SubscriberCore>(
      std::make_shared<GroupLink>(d.peer.group, d.peer.rank, d.channel),
      c10::str("Subscriber.pull (rank ", d.peer.rank, ")"),
      detail::resolve_max_total_bytes(kCall, options.max_total_bytes));
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

}  // namespace tensordict::dist
