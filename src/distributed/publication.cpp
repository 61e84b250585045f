#include "tensordict/distributed/publication.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <type_traits>
#include <variant>

#include "core/metadata.h"
#include "peer.h"
#include "remote.h"
#include "tensordict/consolidate.h"
#include "tensordict/errors.h"
#include "tensordict/nested_key.h"
#include "tensordict/distributed/process_group.h"
#include "wire/leaf_order.h"
#include "wire/publication.h"

namespace tensordict::dist {
namespace pub = wire::publication;
using detail::Clock;
using detail::wait_until;

namespace {

// Waits are cut in slices, so that a closing publisher stops within one and an untimed pull
// never lets Gloo's own timeout (which closes the group) pass.
constexpr auto kSlice = std::chrono::milliseconds(100);
constexpr auto kLongSlice = std::chrono::seconds(10);

// Zeroed: a peer's short message leaves zeros, which the readers refuse or read as zeros.
at::Tensor message_buffer() {
  return at::zeros({static_cast<int64_t>(pub::kMessageBytes)}, at::kByte);
}

const uint8_t* bytes_of(const at::Tensor& t) { return t.data_ptr<uint8_t>(); }

WorkPtr post_recv(const Group& group, at::Tensor buffer, int rank, int tag) {
  std::vector<at::Tensor> tensors{std::move(buffer)};
  return group.recv(tensors, rank, tag);
}

WorkPtr post_send(const Group& group, at::Tensor buffer, int rank, int tag) {
  std::vector<at::Tensor> tensors{std::move(buffer)};
  return group.send(tensors, rank, tag);
}

// Waits for `work` until `deadline` in slices, giving up early when `stop` turns true.
bool wait_for(const WorkPtr& work, Clock::time_point deadline, const std::atomic<bool>* stop,
              std::chrono::milliseconds slice) {
  for (;;) {
    const auto now = Clock::now();
    if (stop != nullptr && stop->load()) return false;
    const auto end = std::min(deadline, now + slice);
    if (wait_until(work, end)) return true;
    if (end >= deadline) return false;
  }
}

Clock::time_point deadline_of(std::optional<std::chrono::milliseconds> timeout) {
  return timeout ? Clock::now() + *timeout : Clock::time_point::max();
}

// The leaves of `td` paired with those of `other` (same structure: both in wire order).
using Leaves = std::vector<std::pair<std::vector<std::string>, at::Tensor>>;

void copy_leaves(const Leaves& from, const Leaves& to) {
  at::NoGradGuard no_grad;  // a module's Parameters are written in place
  for (size_t i = 0; i < from.size(); ++i) {
    to[i].second.copy_(from[i].second);
  }
}

// Non-tensor entries of `from` written into `to`'s levels (the same structure).
void copy_non_tensors(const TensorDict& from, TensorDict to) {
  for (const auto& [key, value] : from.entries()) {
    if (value.is_non_tensor()) {
      to.set(NestedKey(key), value);
    } else if (value.is_tensordict()) {
      for (const auto& [k, v] : to.entries()) {
        if (k == key && v.is_tensordict()) {
          copy_non_tensors(value.tensordict(), v.tensordict());
          break;
        }
      }
    }
  }
}

bool has_non_tensors(const Metadata& m) {
  if (!m.non_tensors.empty()) return true;
  return std::any_of(m.children.begin(), m.children.end(),
                     [](const auto& c) { return has_non_tensors(c.second); });
}

uint64_t random_epoch() {
  std::random_device device;
  std::mt19937_64 mix((uint64_t{device()} << 32) ^ device() ^
                      static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  uint64_t e = 0;
  while (e == 0) e = mix();
  return e;
}

std::string rank_str(int rank) { return c10::str("rank ", rank); }

std::optional<std::string> tensorclass_of(const core::ValidatedMetadata& m) {
  const JsonScalar* v = pub::transport_field(m, "_tensorclass_type");
  if (v == nullptr || !std::holds_alternative<std::string>(*v)) return std::nullopt;
  return std::get<std::string>(*v);
}

}  // namespace

// ---- Publisher ------------------------------------------------------------------------------

struct Publisher::Impl {
  struct Slot {
    at::Tensor storage;   // 1-D uint8, at least `bytes` long
    int64_t version = 0;  // 0: never filled
    int64_t bytes = 0;
    std::shared_ptr<const std::string> json;  // the version's metadata JSON
    uint64_t schema = 0;
    int pins = 0;         // subscribers receiving it now
    bool writing = false; // a publish is copying into it
    // The slot's leaves as views, for the schema they were made for.
    Leaves views;
    uint64_t views_schema = 0;
  };
  struct Served {
    int rank = 0;
    SubscriberStats stats;
    bool asked = false;  // a request arrived
    std::thread thread;
  };

  Group group;
  int64_t channel = 0;
  uint64_t epoch = random_epoch();

  mutable std::mutex mutex;
  std::condition_variable changed;  // a version was published, a slot unpinned, or closing
  std::vector<Slot> slots;
  int newest = -1;
  int64_t version = 0;
  std::vector<std::unique_ptr<Served>> served;
  std::atomic<bool> closing{false};
  std::mutex publish_mutex;  // one publish copies at a time
  // The last version's metadata and JSON, reused while the structure stays the same.
  std::optional<Metadata> last_metadata;
  std::optional<std::string> last_tensorclass;
  std::shared_ptr<const std::string> last_json;
  uint64_t last_schema = 0;

  int tag(pub::Kind kind) const { return pub::tag_of(channel, kind); }
  void serve(Served& s);
  // Sends `offer` (and, for a new version, the schema and the data) to `s`; true once taken.
  bool answer(Served& s, const pub::Offer& offer, const at::Tensor& schema,
              const at::Tensor& data);
  void lose(Served& s, const std::string& error);
};

void Publisher::Impl::lose(Served& s, const std::string& error) {
  std::lock_guard<std::mutex> lock(mutex);
  s.stats.lost = true;
  s.stats.waiting = false;
  if (s.stats.error.empty()) s.stats.error = error;
}

bool Publisher::Impl::answer(Served& s, const pub::Offer& offer, const at::Tensor& schema,
                             const at::Tensor& data) {
  std::vector<detail::MessagePtr> posted;
  const auto post = [&](const at::Tensor& t, pub::Kind kind) {
    auto m = std::make_shared<detail::PostedMessage>();
    m->buffer = t;
    m->tag = tag(kind);
    m->is_recv = false;
    m->work = post_send(group, t, s.rank, m->tag);
    posted.push_back(std::move(m));
  };
  post(detail::bytes_tensor(pub::encode(offer)), pub::Kind::kOffer);
  if (offer.status == pub::Status::kNew) {
    if (offer.schema_bytes > 0) post(schema, pub::Kind::kSchema);
    post(data, pub::Kind::kData);
  }
  for (auto& m : posted) {
    try {
      if (!wait_for(m->work, Clock::time_point::max(), &closing, kSlice)) {
        // Closing while the subscriber has not taken everything: the sends stay queued, their
        // tensors kept, so that its connection is not harmed.
        detail::LateMessages::get().park(detail::group_key(group), s.rank, posted);
        return false;
      }
      m->done = true;
    } catch (const std::exception& e) {
      lose(s, e.what());
      return false;
    }
  }
  return true;
}

void Publisher::Impl::serve(Served& s) {
  const void* key = detail::group_key(group);
  const int req_tag = tag(pub::Kind::kRequest);
  at::Tensor request = message_buffer();
  WorkPtr work;
  // A receive that an earlier Publisher of this channel left posted gets the next request.
  if (auto parked = detail::LateMessages::get().take(key, s.rank, req_tag)) {
    request = parked->buffer;
    work = parked->work;
  } else {
    work = post_recv(group, request, s.rank, req_tag);
  }
  const auto who = c10::str("Publisher (", rank_str(s.rank), "'s request)");
  for (;;) {
    try {
      if (!wait_for(work, Clock::time_point::max(), &closing, kSlice)) break;  // closing
    } catch (const std::exception& e) {
      lose(s, e.what());
      return;
    }
    pub::Request r;
    try {
      r = pub::decode_request(who.c_str(), bytes_of(request));
    } catch (const c10::Error& e) {
      // Not a request: the peer's stream on this tag cannot be trusted any more.
      lose(s, e.msg());
      pub::Offer refused;
      refused.status = pub::Status::kRefused;
      answer(s, refused, {}, {});
      return;
    }
    request = message_buffer();
    work = post_recv(group, request, s.rank, req_tag);  // ready for the next one at once

    std::unique_lock<std::mutex> lock(mutex);
    s.asked = true;
    s.stats.waiting = true;
    changed.notify_all();  // wait_for_subscribers
    const auto eligible = [&] {
      if (closing.load()) return true;
      if (newest < 0) return false;
      const Slot& slot = slots[newest];
      if (slot.writing) return false;  // the only slot, being filled again (max_slots 1)
      const bool newer = r.epoch != epoch || slot.version > r.version;
      return newer && slot.version >= r.min_version;
    };
    if (r.wait_ms < 0) {
      changed.wait(lock, eligible);
    } else {
      changed.wait_until(lock, Clock::now() + std::chrono::milliseconds(r.wait_ms), eligible);
    }
    s.stats.waiting = false;
    pub::Offer offer;
    offer.seq = r.seq;
    offer.epoch = epoch;
    if (closing.load()) {
      offer.status = pub::Status::kClosed;
      lock.unlock();
      answer(s, offer, {}, {});
      break;
    }
    if (!eligible()) {
      offer.status = pub::Status::kNone;
      lock.unlock();
      if (!answer(s, offer, {}, {})) return;
      continue;
    }
    Slot& slot = slots[newest];
    ++slot.pins;
    s.stats.pinned = slot.version;
    offer.status = pub::Status::kNew;
    offer.version = slot.version;
    offer.data_bytes = slot.bytes;
    offer.schema = slot.schema;
    const bool reuse = r.epoch == epoch && r.schema == slot.schema;
    offer.schema_bytes = reuse ? 0 : static_cast<int64_t>(slot.json->size());
    const at::Tensor schema = reuse ? at::Tensor() : detail::bytes_tensor(*slot.json);
    const at::Tensor data = slot.storage.narrow(0, 0, slot.bytes);
    lock.unlock();

    const bool taken = answer(s, offer, schema, data);
    lock.lock();
    --slot.pins;
    s.stats.pinned.reset();
    if (taken) {
      s.stats.version = offer.version;
      ++s.stats.pulls;
    }
    changed.notify_all();
    if (!taken) return;
  }
  // Closing: the posted receive is kept (its buffer alive) for a later Publisher.
  auto m = std::make_shared<detail::PostedMessage>();
  m->work = work;
  m->buffer = request;
  m->tag = req_tag;
  detail::LateMessages::get().park(key, s.rank, {m});
}

Publisher::Publisher(const PublisherOptions& options) : impl_(std::make_shared<Impl>()) {
  constexpr const char* kCall = "Publisher";
  check_group_member(options.group, kCall);
  Impl& d = *impl_;
  d.group = detail::resolve_group(options.group);
  TORCH_CHECK_VALUE(options.max_slots >= 1, kCall, ": max_slots must be at least 1, got ",
                    options.max_slots);
  TORCH_CHECK_VALUE(options.channel >= 0 && options.channel <= pub::kMaxChannel, kCall,
                    ": channel must be in [0, ", pub::kMaxChannel, "], got ", options.channel);
  d.channel = options.channel;
  const int me = d.group.rank();
  const int size = d.group.size();
  std::vector<int64_t> ranks = options.subscribers;
  if (ranks.empty()) {
    for (int r = 0; r < size; ++r) {
      if (r != me) ranks.push_back(r);
    }
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int64_t r = ranks[i];
    TORCH_CHECK_VALUE(r >= 0 && r < size && r != me, kCall, ": subscriber rank ", r,
                      " is not another rank of the group (size ", size, ", this rank ", me, ")");
    TORCH_CHECK_VALUE(std::count(ranks.begin(), ranks.end(), r) == 1, kCall,
                      ": subscriber rank ", r, " is listed twice");
  }
  d.slots.resize(static_cast<size_t>(options.max_slots));
  for (const int64_t r : ranks) {
    auto s = std::make_unique<Impl::Served>();
    s->rank = static_cast<int>(r);
    s->stats.rank = r;
    d.served.push_back(std::move(s));
  }
  for (auto& s : d.served) {
    Impl::Served* served = s.get();
    s->thread = std::thread([impl = impl_, served] { impl->serve(*served); });
  }
}

Publisher::~Publisher() { close(); }

void Publisher::close() {
  Impl& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    d.closing.store(true);
    d.changed.notify_all();
  }
  for (auto& s : d.served) {
    if (s->thread.joinable()) s->thread.join();
  }
}

int64_t Publisher::publish(const TensorDict& td, std::optional<std::chrono::milliseconds> timeout,
                           const std::optional<std::string>& tensorclass_type) {
  constexpr const char* kCall = "publish";
  Impl& d = *impl_;
  TORCH_CHECK(!d.closing.load(), kCall, ": the Publisher is closed");
  TORCH_CHECK_VALUE(!timeout || timeout->count() >= 0, kCall,
                    ": timeout must not be negative");
  std::lock_guard<std::mutex> one(d.publish_mutex);
  const Leaves leaves = wire::leaves_in_order(td);
  std::vector<at::Tensor> tensors;
  tensors.reserve(leaves.size());
  for (const auto& l : leaves) tensors.push_back(l.second);
  detail::check_leaves(kCall, td, tensors);

  Metadata metadata = metadata_of(td);
  if (!d.last_metadata || !(*d.last_metadata == metadata) ||
      d.last_tensorclass != tensorclass_type) {
    const int64_t bytes = metadata_storage_bytes(metadata);
    TransportFields fields{{"_total_bytes", bytes}};
    if (tensorclass_type) fields.emplace_back("_tensorclass_type", *tensorclass_type);
    d.last_json = std::make_shared<const std::string>(metadata_to_json(metadata, false, fields));
    d.last_schema = pub::schema_hash(*d.last_json);
    d.last_metadata = std::move(metadata);
    d.last_tensorclass = tensorclass_type;
  }
  const int64_t bytes = metadata_storage_bytes(*d.last_metadata);

  // A slot nobody pins or fills, the oldest first; the newest last (while it is filled again,
  // pulls wait for the new version rather than take the old one).
  std::unique_lock<std::mutex> lock(d.mutex);
  const auto pick = [&]() -> int {
    int best = -1;
    const auto rank_of = [&](int i) {
      return std::pair{i == d.newest, d.slots[i].version};
    };
    for (int i = 0; i < static_cast<int>(d.slots.size()); ++i) {
      const auto& s = d.slots[i];
      if (s.pins > 0 || s.writing) continue;
      if (best < 0 || rank_of(i) < rank_of(best)) best = i;
    }
    return best;
  };
  int index = pick();
  if (index < 0) {
    const auto deadline = deadline_of(timeout);
    while ((index = pick()) < 0 && !d.closing.load()) {
      if (d.changed.wait_until(lock, deadline) == std::cv_status::timeout && pick() < 0) {
        std::string pinning;
        for (const auto& s : d.served) {
          if (!s->stats.pinned) continue;
          pinning += c10::str(pinning.empty() ? "" : ", ", rank_str(s->rank), " (version ",
                              *s->stats.pinned, ")");
        }
        TD_THROW(TimeoutError, kCall, ": every one of the ", d.slots.size(),
                 " slots is pinned by a subscriber still receiving it: ", pinning,
                 "; waited ", timeout ? timeout->count() : 0,
                 " ms. Raise max_slots, or find out why they do not take their data");
      }
    }
    TORCH_CHECK(!d.closing.load(), kCall, ": the Publisher was closed");
  }
  Impl::Slot& slot = d.slots[index];
  slot.writing = true;
  lock.unlock();
  try {
    if (!slot.storage.defined() || slot.storage.numel() < bytes) {
      slot.storage = at::empty({bytes}, at::kByte);
      slot.views_schema = 0;
    }
    if (slot.views_schema != d.last_schema) {
      slot.views = wire::leaves_in_order(rebuild(*d.last_metadata, slot.storage.narrow(0, 0, bytes)));
      slot.views_schema = d.last_schema;
    }
    copy_leaves(leaves, slot.views);
  } catch (...) {
    // Half written: the slot holds no version any more.
    std::lock_guard<std::mutex> relock(d.mutex);
    slot.writing = false;
    slot.version = 0;
    if (d.newest == index) d.newest = -1;
    d.changed.notify_all();
    throw;
  }
  lock.lock();
  slot.writing = false;
  slot.bytes = bytes;
  slot.json = d.last_json;
  slot.schema = d.last_schema;
  slot.version = ++d.version;
  d.newest = index;
  d.changed.notify_all();
  return slot.version;
}

uint64_t Publisher::epoch() const { return impl_->epoch; }

int64_t Publisher::version() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->version;
}

std::vector<SubscriberStats> Publisher::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  std::vector<SubscriberStats> out;
  for (const auto& s : impl_->served) out.push_back(s->stats);
  return out;
}

void Publisher::wait_for_subscribers(std::chrono::milliseconds timeout) const {
  Impl& d = *impl_;
  std::unique_lock<std::mutex> lock(d.mutex);
  const auto all = [&] {
    return std::all_of(d.served.begin(), d.served.end(),
                       [](const auto& s) { return s->asked || s->stats.lost; });
  };
  if (d.changed.wait_for(lock, timeout, all)) return;
  std::string silent;
  for (const auto& s : d.served) {
    if (!s->asked && !s->stats.lost) silent += c10::str(silent.empty() ? "" : ", ", s->rank);
  }
  TD_THROW(TimeoutError, "wait_for_subscribers: no request from rank(s) ", silent, " within ",
           timeout.count(), " ms: they run no Subscriber of channel ", d.channel,
           " (not yet, or they run the reference tensordict, which has none)");
}

// ---- Subscriber -----------------------------------------------------------------------------

namespace {

// What the subscriber holds: the last version it applied.
struct HeldVersion {
  uint64_t epoch = 0;
  int64_t version = 0;
  uint64_t schema = 0;
  int64_t data_bytes = 0;
  std::shared_ptr<const core::ValidatedMetadata> metadata;
  std::optional<std::string> tensorclass_type;
};

// One pull's messages, from its request on; what a pull that timed out left, for the next.
struct Outstanding {
  uint64_t seq = 0;
  HeldVersion held;  // when the request was sent (what a reused schema refers to)
  at::Tensor request, offer_buffer;
  WorkPtr request_work, offer_work;
  Clock::time_point sent;
  bool request_taken = false;
  std::optional<pub::Offer> offer;
  std::shared_ptr<const core::ValidatedMetadata> metadata;  // the offer's, once read
  at::Tensor schema, data;
  WorkPtr schema_work, data_work;
  std::optional<detail::TailStamp> data_stamp;  // tells a data message shorter than announced
  bool schema_done = false, data_done = false;
};

// Pulls that a destroyed Subscriber left in flight, per (group, rank, channel): the next
// Subscriber there takes them over, so the publisher's messages always find their receives.
std::mutex abandoned_mutex;
std::map<std::tuple<const void*, int, int64_t>, std::shared_ptr<Outstanding>>& abandoned() {
  static auto* map = new std::map<std::tuple<const void*, int, int64_t>,
                                  std::shared_ptr<Outstanding>>;
  return *map;
}

}  // namespace

struct Subscriber::Impl {
  detail::Peer peer;
  int64_t channel = 0;
  int64_t max_total_bytes = 0;
  HeldVersion held;
  uint64_t seq = 0;
  std::shared_ptr<Outstanding> out;
  at::Tensor stage;  // where data lands; kept between pulls
  // The stage's leaves as views, for the schema they were made for.
  Leaves stage_views;
  const void* stage_views_for = nullptr;
  uint64_t stage_views_schema = 0;

  int tag(pub::Kind kind) const { return pub::tag_of(channel, kind); }
  std::string from() const { return c10::str("Subscriber.pull (", rank_str(peer.rank), ")"); }

  // `start`: when the pull began (the request counts as sent then, for NoPublisherError).
  void send_request(const PullOptions& options, Clock::time_point start);
  // Runs the pull's messages until a version is in; false when the deadline passed first.
  bool advance(Clock::time_point start, Clock::time_point deadline, const PullOptions& options);
  bool wait(const WorkPtr& work, Clock::time_point deadline, const char* what);
};

bool Subscriber::Impl::wait(const WorkPtr& work, Clock::time_point deadline, const char* what) {
  try {
    return wait_for(work, deadline, nullptr, kLongSlice);
  } catch (const std::exception& e) {
    out.reset();
    detail::rethrow_lost(e, c10::str(from(), ": lost the connection while waiting for ", what));
  }
}

void Subscriber::Impl::send_request(const PullOptions& options, Clock::time_point start) {
  auto o = std::make_shared<Outstanding>();
  o->seq = ++seq;
  o->held = held;
  pub::Request r;
  r.seq = o->seq;
  r.epoch = held.epoch;
  r.version = held.version;
  r.min_version = options.min_version.value_or(0);
  r.wait_ms = options.timeout ? options.timeout->count() : -1;
  r.schema = held.schema;
  // The offer's receive first: a Gloo send moves only once its receive is posted, so the
  // publisher never waits on this subscriber to answer it.
  o->offer_buffer = message_buffer();
  o->offer_work = post_recv(peer.group, o->offer_buffer, peer.rank, tag(pub::Kind::kOffer));
  o->request = detail::bytes_tensor(pub::encode(r));
  o->request_work = post_send(peer.group, o->request, peer.rank, tag(pub::Kind::kRequest));
  o->sent = start;
  out = std::move(o);
}

bool Subscriber::Impl::advance(Clock::time_point start, Clock::time_point deadline,
                               const PullOptions& options) {
  const std::string who = from();
  for (;;) {
    if (!out) send_request(options, start);
    Outstanding& o = *out;
    if (!o.request_taken) {
      if (!wait(o.request_work, deadline, "the publisher to take the request")) {
        const auto waited = Clock::now() - o.sent;
        const auto asked = options.timeout.value_or(std::chrono::milliseconds(0));
        const auto least = asked.count() > 0 ? asked : std::chrono::milliseconds(1000);
        TD_CHECK_AS(NoPublisherError, waited < least, who, ": ", rank_str(peer.rank),
                    " has taken no request in ",
                    std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
                    " ms: no Publisher of channel ", channel,
                    " runs there (none yet, or it runs the reference tensordict, which has "
                    "none). The request stays queued for when one starts");
        return false;
      }
      o.request_taken = true;
    }
    if (!o.offer) {
      if (!wait(o.offer_work, deadline, "the publisher's offer")) return false;
      try {
        o.offer = pub::decode_offer(who.c_str(), bytes_of(o.offer_buffer));
      } catch (...) {
        out.reset();  // what follows on these tags cannot be trusted to fit
        throw;
      }
      switch (o.offer->status) {
        case pub::Status::kNone:
          out.reset();
          if (Clock::now() >= deadline) return false;
          continue;
        case pub::Status::kClosed:
          out.reset();
          TD_THROW(NoPublisherError, who, ": the Publisher of channel ", channel, " on ",
                   rank_str(peer.rank), " closed");
        case pub::Status::kRefused:
          out.reset();
          TD_THROW(MalformedPeerDataError, who, ": the Publisher on ", rank_str(peer.rank),
                   " refused this subscriber's request as malformed and serves it no more");
        case pub::Status::kNew:
          break;
      }
      pub::Held h;
      h.seq = o.seq;
      h.epoch = o.held.epoch;
      h.version = o.held.version;
      h.schema = o.held.schema;
      h.data_bytes = o.held.data_bytes;
      h.max_data_bytes = max_total_bytes;
      try {
        pub::check_offer(who.c_str(), *o.offer, h);
      } catch (...) {
        out.reset();  // what follows on these tags cannot be trusted to fit
        throw;
      }
      if (o.offer->schema_bytes > 0) {
        o.schema = at::empty({o.offer->schema_bytes}, at::kByte);
        o.schema_work = post_recv(peer.group, o.schema, peer.rank, tag(pub::Kind::kSchema));
      } else {
        o.metadata = o.held.metadata;
      }
      const int64_t n = o.offer->data_bytes;
      // The stage, unless a pull into a new TensorDict took it (or it is too small).
      if (!stage.defined() || stage.numel() < n) {
        stage = at::empty({std::max<int64_t>(n, 1)}, at::kByte);
      }
      o.data = stage.narrow(0, 0, n);
      o.data_stamp.emplace(o.data);
      o.data_work = post_recv(peer.group, o.data, peer.rank, tag(pub::Kind::kData));
    }
    if (o.schema_work && !o.schema_done) {
      if (!wait(o.schema_work, deadline, "the version's schema")) return false;
      o.schema_done = true;
      const std::string_view text(reinterpret_cast<const char*>(bytes_of(o.schema)),
                                  static_cast<size_t>(o.schema.numel()));
      try {
        o.metadata = std::make_shared<core::ValidatedMetadata>(
            pub::read_schema(who.c_str(), *o.offer, text));
      } catch (...) {
        // The data still comes: drain it before giving up, so the tags stay in step.
        try {
          wait_for(o.data_work, Clock::time_point::max(), nullptr, kLongSlice);
        } catch (...) {
        }
        out.reset();
        throw;
      }
    }
    if (!o.data_done) {
      if (!wait(o.data_work, deadline, "the version's data")) return false;
      o.data_done = true;
      if (o.data_stamp->short_message()) {
        const int64_t announced = o.offer->data_bytes;
        out.reset();  // `o` with it
        TD_THROW(MalformedPeerDataError, who, ": the version's data stopped short of the ",
                 announced, " bytes its offer announced");
      }
    }
    return true;
  }
}

Subscriber::Subscriber(const SubscriberOptions& options) : impl_(std::make_unique<Impl>()) {
  constexpr const char* kCall = "Subscriber";
  detail::check_p2p_peer(options.src, options.group_src, options.group, "src", "group_src");
  Impl& d = *impl_;
  d.peer = detail::resolve_peer(kCall, options.src, options.group_src, options.group, "src",
                                "group_src", true);
  TORCH_CHECK_VALUE(d.peer.rank != d.peer.group.rank(), kCall,
                    ": the publisher's rank is this process's own");
  TORCH_CHECK_VALUE(options.channel >= 0 && options.channel <= pub::kMaxChannel, kCall,
                    ": channel must be in [0, ", pub::kMaxChannel, "], got ", options.channel);
  d.channel = options.channel;
  d.max_total_bytes = detail::resolve_max_total_bytes(kCall, options.max_total_bytes);
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  auto& left = abandoned();
  const auto it = left.find({detail::group_key(d.peer.group), d.peer.rank, d.channel});
  if (it != left.end()) {
    d.out = std::move(it->second);  // finished by the first pull, then dropped
    d.seq = d.out->seq;
    left.erase(it);
  }
}

Subscriber::~Subscriber() {
  if (!impl_->out) return;
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  abandoned()[{detail::group_key(impl_->peer.group), impl_->peer.rank, impl_->channel}] =
      std::move(impl_->out);
}

namespace {

// The first difference between `have` (the target's leaves) and `want` (the version's).
void check_same_leaves(const std::string& who, const Leaves& have, const Leaves& want) {
  for (size_t i = 0; i < std::max(have.size(), want.size()); ++i) {
    if (i >= have.size()) {
      TD_THROW(SchemaMismatchError, who, ": the version has key ", NestedKey(want[i].first).str(),
               ", which this TensorDict lacks");
    }
    if (i >= want.size() || have[i].first != want[i].first) {
      TD_THROW(SchemaMismatchError, who, ": this TensorDict has key ",
               NestedKey(have[i].first).str(), ", which the version ",
               i >= want.size() ? "lacks" : c10::str("has not here (it has ",
                                                     NestedKey(want[i].first).str(), ")"));
    }
    const at::Tensor& a = have[i].second;
    const at::Tensor& b = want[i].second;
    if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
      TD_THROW(SchemaMismatchError, who, ": key ", NestedKey(have[i].first).str(), " is ",
               a.scalar_type(), " of shape ", a.sizes(), " here and ", b.scalar_type(),
               " of shape ", b.sizes(), " in the version");
    }
  }
}

void check_pull(const PullOptions& options) {
  TORCH_CHECK_VALUE(!options.timeout || options.timeout->count() >= 0,
                    "Subscriber.pull: timeout must not be negative");
  TORCH_CHECK_VALUE(options.min_version.value_or(0) >= 0,
                    "Subscriber.pull: min_version must not be negative, got ",
                    options.min_version.value_or(0));
}

// Pulls until a version of at least min_version is in, or the deadline passes: apply(o) puts
// each version where it goes (it may throw, the version then not held) and makes the result.
template <typename Apply>
auto pull_with(Subscriber::Impl& d, const PullOptions& options, Apply&& apply)
    -> std::optional<std::invoke_result_t<Apply&, Outstanding&>> {
  check_pull(options);
  const auto start = Clock::now();
  const auto deadline = deadline_of(options.timeout);
  for (;;) {
    if (!d.advance(start, deadline, options)) return std::nullopt;
    const std::shared_ptr<Outstanding> o = std::move(d.out);
    auto result = apply(*o);
    const pub::Offer& offer = *o->offer;
    d.held = HeldVersion{offer.epoch, offer.version, offer.schema, offer.data_bytes,
                         o->metadata, tensorclass_of(*o->metadata)};
    if (offer.version >= options.min_version.value_or(0)) return result;
    if (Clock::now() >= deadline) return std::nullopt;
  }
}

}  // namespace

std::optional<int64_t> Subscriber::pull(TensorDict& td, const PullOptions& options) {
  Impl& d = *impl_;
  return pull_with(d, options, [&](Outstanding& o) {
    const auto& metadata = *o.metadata;
    // The version's leaves as views of the data, made once per schema and stage.
    if (d.stage_views_for != o.data.data_ptr() || d.stage_views_schema != o.offer->schema) {
      d.stage_views = wire::leaves_in_order(core::rebuild_validated(metadata, o.data));
      d.stage_views_for = o.data.data_ptr();
      d.stage_views_schema = o.offer->schema;
    }
    const Leaves target = wire::leaves_in_order(td);
    check_same_leaves(d.from(), target, d.stage_views);
    copy_leaves(d.stage_views, target);
    if (has_non_tensors(metadata.metadata())) {
      copy_non_tensors(core::rebuild_validated(metadata, o.data), td);
    }
    return o.offer->version;
  });
}

std::optional<Pulled> Subscriber::pull(const PullOptions& options) {
  Impl& d = *impl_;
  return pull_with(d, options, [&](Outstanding& o) {
    // The new TensorDict keeps the stage as its storage; the next pull makes another.
    Pulled pulled{core::rebuild_validated(*o.metadata, o.data), o.offer->version,
                  tensorclass_of(*o.metadata)};
    d.stage = at::Tensor();
    d.stage_views_for = nullptr;
    return pulled;
  });
}

int64_t Subscriber::version() const { return impl_->held.version; }
uint64_t Subscriber::epoch() const { return impl_->held.epoch; }

}  // namespace tensordict::dist
