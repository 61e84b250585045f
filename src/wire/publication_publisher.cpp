#include "wire/publication_publisher.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "core/byte_tensor.h"
#include "core/bytes.h"
#include "core/env.h"
#include "shm/segment.h"
#include "tensordict/errors.h"
#include "tensordict/leaf.h"
#include "tensordict/nested_key.h"
#include "wire/leaf_order.h"
#include "wire/publication_shm.h"

namespace tensordict::wire::publication {
namespace {

// Waits are cut in slices, so that a closing publisher stops within one.
constexpr auto kSlice = std::chrono::milliseconds(100);
// How often a subscriber on shared memory is looked at (whether its process exited).
constexpr auto kShmWatch = std::chrono::milliseconds(20);
// Versions from this size are sent to one subscriber at a time, each for at most its turn (twice
// the last such send's time, within these bounds) before the next may start alongside.
constexpr int64_t kBigVersion = int64_t{8} << 20;
constexpr auto kMinTurn = std::chrono::milliseconds(5);
constexpr auto kMaxTurn = std::chrono::milliseconds(100);
// Relayed pieces (§9.9): a chain of n subscribers takes about (B/C + n - 1)(C/bw + a) for B
// bytes in pieces of C at bw bytes/s, a the cost of one more message; the best C is
// sqrt(B a bw / (n - 1)) (benchmarks/route_model.py), within [kMinPieceBytes, kMaxPieceBytes].
// Two trees take about (B/C + K)(C/bw + a), K twice a tree's depth: C = sqrt(B a bw / K).
// bw is the last relayed version's, measured on its first link; before one, kFirstRate.
constexpr double kPieceCost = 50e-6;
constexpr double kFirstRate = 1.25e9;
constexpr int64_t kRateFrom = int64_t{16} << 20;
// How long a route waits for the subscribers that may relay and have not asked yet.
constexpr auto kGather = std::chrono::milliseconds(50);
// Smaller versions are not worth the wait: sent whole, they cost the publisher little.
constexpr int64_t kGatherFrom = int64_t{1} << 20;
// An answer's messages in flight at once; a paused answer looks this often whether it may go on.
constexpr size_t kSendsAhead = 16;
constexpr auto kPausedLook = std::chrono::milliseconds(5);

using Leaves = std::vector<std::pair<std::vector<std::string>, at::Tensor>>;

// The parent of position i (1 to n) in a binary tree over 1..n laid out in order, its root the
// largest power of two within n: the odd positions are its leaves, about half; 0 for the root.
// A place beyond n is passed through to its own parent.
int64_t tree_parent(int64_t i, int64_t n) {
  int64_t root = 1;
  while (root * 2 <= n) root *= 2;
  if (i == root) return 0;
  for (int64_t b = i & -i;; b *= 2) {
    const int64_t p = (i & (2 * b)) != 0 ? i - b : i + b;
    if (p <= n) return p;
    i = p;
  }
}

// The second tree's position of the member at position i of the first (1 to n): the first's
// leaves (odd) are the second's inner positions (even), so that every member forwards in one
// tree at most (n odd: the last is a leaf of both).
int64_t second_position(int64_t i, int64_t n) { return n % 2 == 0 ? n + 1 - i : i % n + 1; }

uint64_t random_epoch() {
  std::random_device device;
  std::mt19937_64 mix((uint64_t{device()} << 32) ^ device() ^
                      static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  uint64_t e = 0;
  while (e == 0) e = mix();
  return e;
}

// A subscriber's stats keep the lost ones beyond those serving, up to this many (the oldest
// go first): a server's clients come and go without end.
constexpr size_t kMaxLostKept = 64;

// An error's text for stats(): its message, without a C++ backtrace.
std::string text_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return c10_error->what_without_backtrace();
  }
  return e.what();
}

// What the subscriber's message after `answering` says of it: a refusal ends the subscription;
// another request before the answer was taken is out of step (an honest subscriber has one
// request in flight).
std::string next_message(const char* who, const at::Tensor& buffer, const Offer& answering) {
  const Request next = decode_request(who, buffer.data_ptr<uint8_t>());
  if (next.refusal == Refusal::kNone) {
    return c10::str(who, ": request ", next.seq, " came before request ", answering.seq,
                    " was answered (a subscriber has one request in flight)");
  }
  return c10::str("the subscriber refused ",
                  answering.status == Status::kNew ? c10::str("version ", answering.version)
                                                   : std::string("the answer"),
                  " (request ", next.seq, "): ", refusal_text(next.refusal));
}

}  // namespace

struct PublisherCore::Slot {
  at::Tensor storage;   // 1-D uint8, at least `bytes` long
  int64_t version = 0;  // 0: never filled
  int64_t bytes = 0;
  std::shared_ptr<const std::string> json;  // the version's metadata JSON
  uint64_t schema = 0;
  int pins = 0;          // subscribers receiving it now
  bool writing = false;  // a publish is copying into it
  Leaves views;          // the slot's leaves as views, for the schema they were made for
  uint64_t views_schema = 0;
};

namespace L = shm_layout;

// The shared memory of a publisher whose transport is not kSocket: the slots segment (made at
// the first publish, replaced by a larger one when a version outgrows it) and the pins segment.
struct PublisherCore::Shm {
  std::shared_ptr<shm::Segment> slots, pins;
  std::array<uint8_t, 16> token{};
  uint64_t json_cap = 0, data_cap = 0;
  std::string failed;  // why there is none (kAuto, the kernel refused)
  std::vector<bool> used = std::vector<bool>(L::kEntries, false);
  // The process of each entry's subscriber, watched once it wrote its pid.
  std::vector<std::unique_ptr<shm::Process>> process =
      std::vector<std::unique_ptr<shm::Process>>(L::kEntries);

  uint8_t* header() const { return slots->data(); }
  uint8_t* record(int i) const { return header() + L::record_at(static_cast<uint32_t>(i)); }
  uint8_t* entry(int e) const { return pins->data() + L::entry_at(static_cast<uint32_t>(e)); }
  std::atomic<uint64_t>& state(int i) const { return L::word<uint64_t>(record(i), L::kStateAt); }
  void wake() const {
    L::word<uint32_t>(header(), L::kChangesAt).fetch_add(1);
    shm::futex_wake(&L::word<uint32_t>(header(), L::kChangesAt));
  }
};

struct PublisherCore::Subscription {
  SubscriberStats stats;
  std::optional<Request> relay_request{};  // while it waits with a request that may be relayed
  bool demoted = false;                    // routed around: a leaf of later routes
  bool relays = false;                     // it asked to relay before
  uint64_t host = 0;                       // its network host (Request::host); 0: not said
  SlotsPlace slots{};    // its slots for its host's subscribers (Request::host_slots), if any
  bool paused = false;   // routed around for slowness: its pieces wait for the one that left it
  int entry = -1;        // in the pins segment, while it maps the slots
  bool asked = false;    // a request arrived
  bool ready = false;    // asked or lost: counted in ready_
  bool serving = false;  // in serve(): kept in the list whatever happens
  Offer last{};          // the last answer sent whole
  std::optional<int64_t> version_before{};  // stats.version before `last` was counted
};

// The route of one version (§9.9): its subscribers' places, and the version framed in pieces
// (each piece message as it travels: header, bytes, the last padded), which every relayed
// answer and resume sends from, so that no slot stays pinned while pieces move.
struct PublisherCore::Plan {
  int64_t version = 0;
  int64_t bytes = 0;
  uint64_t schema = 0;
  std::shared_ptr<const std::string> json;
  int64_t piece_bytes = 0;
  int64_t pieces = 0;
  at::Tensor framed;
  std::vector<uint64_t> checksums;
  bool ready = false;  // framed
  int64_t split = 0;   // the second lane's first piece (route "tree"); 0: one lane
  struct Place {
    int64_t parent = -1;
    std::vector<int64_t> children;
    Route::Lane second;        // in the second lane (split > 0)
    bool host_source = false;  // writes the version into its slots for its host
    SlotsPlace host_parent{};  // reads it from the parent's slots (pid 0: pieces)
  };
  std::map<const Subscription*, Place> places;
  std::set<const Subscription*> answered;  // members whose threads took their place

  int64_t message_bytes() const { return kPieceHeaderBytes + piece_bytes; }
  // A root of the route's lanes (a reader of slots is none, whatever its lanes' fields).
  bool first_relay(const Subscription* t) const {
    const auto it = places.find(t);
    return it != places.end() && it->second.host_parent.pid == 0 &&
           (it->second.parent < 0 || (split > 0 && it->second.second.parent < 0));
  }
  // The lane of piece `i`: 0, or 1 from the split on.
  int lane_of(int64_t i) const { return split > 0 && i >= split ? 1 : 0; }
  int64_t lane_end(int lane) const { return lane == 0 && split > 0 ? split : pieces; }
  // The offer (status relay) of this version answering request `seq`.
  Offer offer(uint64_t seq, uint64_t epoch) const {
    Offer o;
    o.status = Status::kRelay;
    o.seq = seq;
    o.epoch = epoch;
    o.version = version;
    o.data_bytes = bytes;
    o.schema = schema;
    return o;
  }
  // The route for `t`: its place's (its parent, its parent's children sharing that link), or,
  // for a resume, from this publisher at piece `first`; its children either way.
  Route route(const Subscription* t, uint64_t seq, uint64_t epoch, int64_t rate, bool resume,
              int64_t first) const {
    Route r;
    r.seq = seq;
    r.epoch = epoch;
    r.version = version;
    r.piece_bytes = piece_bytes;
    r.first = first;
    r.rate = rate;
    r.checksums = checksums;
    r.split = split;
    const auto it = places.find(t);
    if (it == places.end()) return r;
    r.host_source = it->second.host_source;
    if (resume) return r;  // its lane from here; the subscriber keeps its children
    r.children = it->second.children;
    r.parent = it->second.parent;
    r.host_parent = it->second.host_parent;
    if (split > 0) r.second = it->second.second;
    // The children sharing the parent's link in each lane: the publisher's, its lanes' roots.
    const auto sharing = [&](int64_t parent, int lane) {
      int64_t n = 0;
      for (const auto& [other, place] : places) {
        if (parent < 0) {
          n += (lane == 0 ? place.parent : place.second.parent) < 0 && place.host_parent.pid == 0;
        } else if (other->stats.rank == parent) {
          // A reader of the parent's slots is none of its children.
          n = static_cast<int64_t>(lane == 0 ? place.children.size()
                                             : place.second.children.size());
        }
      }
      return std::max<int64_t>(1, n);
    };
    r.siblings = sharing(r.parent, 0);
    if (split > 0 && r.host_parent.pid == 0) r.second.siblings = sharing(r.second.parent, 1);
    return r;
  }
  at::Tensor piece(int64_t i) const {
    return framed.narrow(0, i * message_bytes(), message_bytes());
  }
  // Pieces [from, lane's end) of the lane of `from`, each as it travels on that lane's tag.
  void pieces_of(int64_t from, std::vector<std::pair<at::Tensor, Kind>>& out) const {
    const int lane = lane_of(from);
    for (int64_t i = from; i < lane_end(lane); ++i) {
      out.emplace_back(piece(i), piece_kind(lane));
    }
  }
};

PublisherCore::PublisherCore(int64_t max_slots, Transport transport, Routing routing)
    : epoch_(random_epoch()),
      transport_(transport),
      routing_(routing),
      slots_(static_cast<size_t>(max_slots)) {
  if (transport_ == Transport::kSocket) return;
  shm_ = std::make_unique<Shm>();
  TORCH_CHECK_VALUE(max_slots <= L::kMaxSlots, "Publisher: max_slots is ", max_slots,
                    "; shared memory takes at most ", L::kMaxSlots);
  try {
    shm_->token = shm::random_token();
    shm_->pins = L::create_pins("tensordict-pub-pins", shm_->token);
  } catch (const std::exception& e) {
    TORCH_CHECK(transport_ != Transport::kShm,
                "Publisher: transport=\"shm\", but no shared memory can be made: ", e.what());
    shm_->failed = c10::str("the publisher could make no shared memory: ", e.what());
    shm_->pins.reset();
  }
}

PublisherCore::~PublisherCore() = default;

bool PublisherCore::shm_pinned_locked(int i, int64_t version) const {
  if (!shm_ || !shm_->pins || version <= 0) return false;
  const uint64_t pin = L::pin_of(static_cast<uint32_t>(i), version);
  for (uint32_t e = 0; e < L::kEntries; ++e) {
    if (!shm_->used[e]) continue;
    if (L::pins(shm_->entry(static_cast<int>(e)), pin)) return true;
  }
  return false;
}

void PublisherCore::reap_dead_locked() {
  if (!shm_ || !shm_->pins) return;
  for (uint32_t e = 0; e < L::kEntries; ++e) {
    if (!shm_->used[e]) continue;
    uint8_t* q = shm_->entry(static_cast<int>(e));
    const auto pid = static_cast<pid_t>(L::word<uint32_t>(q, L::kEntryPidAt).load());
    if (pid <= 0) continue;
    auto& process = shm_->process[e];
    if (!process || process->pid() != pid) process = std::make_unique<shm::Process>(pid);
    if (!process->alive()) {
      L::word<uint64_t>(q, L::kReadingAt).store(0);
      L::word<uint64_t>(q, L::kHeldAt).store(0);
    }
  }
}

// What a subscriber on shared memory wrote of itself into its entry (its last version and its
// pulls), kept in its stats before the entry is cleared.
static void fold_entry(SubscriberStats& stats, uint8_t* q) {
  const auto version = static_cast<int64_t>(L::word<uint64_t>(q, L::kEntryVersionAt).load());
  if (version > 0) stats.version = version;
  stats.pulls += static_cast<int64_t>(L::word<uint64_t>(q, L::kPullsAt).load() & INT64_MAX);
  L::word<uint64_t>(q, L::kEntryVersionAt).store(0);
  L::word<uint64_t>(q, L::kPullsAt).store(0);
}

bool PublisherCore::mapped_entry(const Subscription& s) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return s.entry >= 0;
}

std::optional<std::string> PublisherCore::subscriber_exited(const Subscription& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (s.entry < 0 || !shm_ || !shm_->pins) return std::nullopt;
  const auto pid =
      static_cast<pid_t>(L::word<uint32_t>(shm_->entry(s.entry), L::kEntryPidAt).load());
  if (pid <= 0) return std::nullopt;
  auto& process = shm_->process[s.entry];
  if (!process || process->pid() != pid) process = std::make_unique<shm::Process>(pid);
  if (process->alive()) return std::nullopt;
  return c10::str("the subscriber's process (pid ", pid, ") exited");
}

void PublisherCore::release_entry_locked(Subscription& s) {
  if (s.entry < 0 || !shm_ || !shm_->pins) return;
  uint8_t* q = shm_->entry(s.entry);
  fold_entry(s.stats, q);
  L::word<uint64_t>(q, L::kReadingAt).store(0);
  L::word<uint64_t>(q, L::kHeldAt).store(0);
  L::word<uint32_t>(q, L::kEntryPidAt).store(0);
  shm_->used[s.entry] = false;
  shm_->process[s.entry].reset();
  s.entry = -1;
  changed_.notify_all();  // a publish waiting for a slot
}

void PublisherCore::mark_locked(uint32_t flag) {
  if (!shm_ || !shm_->slots) return;
  L::word<uint32_t>(shm_->header(), L::kFlagsAt).fetch_or(flag);
  shm_->wake();
}

bool PublisherCore::ensure_segment_locked(int64_t bytes, size_t json) {
  if (!shm_ || !shm_->pins) return false;
  const auto round = [](uint64_t n) { return (n + L::kPage - 1) / L::kPage * L::kPage; };
  if (shm_->slots && static_cast<uint64_t>(bytes) <= shm_->data_cap && json <= shm_->json_cap) {
    return true;
  }
  const auto count = static_cast<uint32_t>(slots_.size());
  const uint64_t json_cap = round(std::max<uint64_t>(json + json / 2, L::kPage));
  const uint64_t data_cap = round(std::max<uint64_t>(static_cast<uint64_t>(bytes), 1));
  const size_t total = L::slot_at(count, json_cap, data_cap, count);
  std::shared_ptr<shm::Segment> segment;
  try {
    segment =
        L::create_slots("tensordict-pub-slots", count, json_cap, data_cap, shm_->token, epoch_);
  } catch (const std::exception& e) {
    TORCH_CHECK(transport_ != Transport::kShm, "publish: transport=\"shm\", but no ", total,
                " bytes of shared memory can be had: ", e.what());
    shm_->failed =
        c10::str("the publisher could make no shared memory of ", total, " bytes: ", e.what());
    mark_locked(L::kMoved);  // its subscribers come back to the link
    shm_->slots.reset();
    shm_->pins.reset();
    for (auto& slot : slots_) {
      const int pins = slot.pins;  // sends in flight keep their storage alive
      slot = Slot{};
      slot.pins = pins;
    }
    newest_ = -1;
    return false;
  }
  uint8_t* h = segment->data();
  // The old segment's subscribers map the new one (§9.8 "moved"); what they view of the old
  // stays theirs, never rewritten.
  mark_locked(L::kMoved);
  shm_->slots = segment;
  shm_->json_cap = json_cap;
  shm_->data_cap = data_cap;
  for (uint32_t i = 0; i < count; ++i) {
    Slot& slot = slots_[i];
    // A slot still being sent over a link keeps its old storage alive through the send.
    const int pins = slot.pins;
    slot = Slot{};
    slot.pins = pins;
    uint8_t* data = h + L::slot_at(count, json_cap, data_cap, i) + json_cap;
    slot.storage =
        at::from_blob(data, {static_cast<int64_t>(data_cap)}, [segment](void*) {}, at::kByte);
  }
  newest_ = -1;
  return true;
}

std::optional<Offer> PublisherCore::shm_offer_locked(Subscription& s, const Request& r) {
  if (!shm_ || !shm_->slots) return std::nullopt;
  if (s.entry < 0) {
    for (uint32_t e = 0; e < L::kEntries && s.entry < 0; ++e) {
      if (!shm_->used[e]) s.entry = static_cast<int>(e);
    }
    if (s.entry < 0) return std::nullopt;
    shm_->used[s.entry] = true;
  }
  uint8_t* q = shm_->entry(s.entry);
  fold_entry(s.stats, q);
  for (size_t at = 0; at < L::kEntryRecord; at += 8) L::word<uint64_t>(q, at).store(0);
  Offer o;
  o.status = Status::kShm;
  o.seq = r.seq;
  o.epoch = epoch_;
  o.pid = static_cast<uint32_t>(::getpid());
  o.entry = static_cast<uint32_t>(s.entry);
  o.slots_fd = static_cast<uint32_t>(shm_->slots->fd());
  o.pins_fd = static_cast<uint32_t>(shm_->pins->fd());
  o.token = shm_->token;
  return o;
}

PublisherCore::Subscription& PublisherCore::add(SubscriberStats stats) {
  std::lock_guard<std::mutex> lock(mutex_);
  prune_locked(nullptr);
  subscriptions_.push_back(Subscription{std::move(stats)});
  ++added_;
  return subscriptions_.back();
}

void PublisherCore::prune_locked(const Subscription* keep) {
  size_t lost = 0;
  for (const auto& s : subscriptions_) lost += s.stats.lost && !s.serving && &s != keep;
  for (auto it = subscriptions_.begin(); lost > kMaxLostKept && it != subscriptions_.end();) {
    if (it->stats.lost && !it->serving && &*it != keep) {
      it = subscriptions_.erase(it);
      --lost;
    } else {
      ++it;
    }
  }
}

void PublisherCore::lose(Subscription& s, const std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  s.stats.lost = true;
  s.stats.waiting = false;
  release_entry_locked(s);
  if (s.stats.error.empty()) s.stats.error = error;
  if (!std::exchange(s.ready, true)) ++ready_;
  changed_.notify_all();  // wait_for_subscribers
}

PublisherCore::Sent PublisherCore::answer(Subscription& s, Link& link, const Offer& offer,
                                          const at::Tensor& schema, const at::Tensor& data,
                                          NextRequest& next) {
  std::vector<std::pair<at::Tensor, Kind>> then;
  if (offer.status == Status::kNew) {
    if (offer.schema_bytes > 0) then.emplace_back(schema, Kind::kSchema);
    then.emplace_back(data, Kind::kData);
  }
  return answer(s, link, offer, then, next);
}

PublisherCore::Sent PublisherCore::answer(Subscription& s, Link& link, const Offer& offer,
                                          const std::vector<std::pair<at::Tensor, Kind>>& then,
                                          NextRequest& next, bool pausable) {
  // Sent kSendsAhead at a time, so that a relay routed around for its slowness can be paused
  // while the subscriber that left it takes the publisher's pieces (§9.9).
  std::vector<PendingPtr> posted;  // in flight, the oldest first
  size_t sent = 0;                 // of `then`
  const auto post_more = [&] {
    while (sent < then.size() && posted.size() < kSendsAhead) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (pausable && s.paused) return;
      }
      posted.push_back(link.post_send(then[sent].first, then[sent].second));
      ++sent;
    }
  };
  try {
    posted.push_back(link.post_send(core::bytes_tensor(encode(offer)), Kind::kOffer));
    post_more();
    bool looked = !next.pending;  // at the subscriber's next message
    while (!posted.empty() || sent < then.size()) {
      if (posted.empty()) {  // paused
        if (closing_.load()) return Sent::kClosing;
        std::this_thread::sleep_for(kPausedLook);
        post_more();
        continue;
      }
      const PendingPtr p = posted.front();
      for (;;) {
        // Closing, a send already taken counts; one that is not stays posted, so that the
        // subscriber's connection is not harmed.
        const bool closing = closing_.load();
        if (link.wait(p, closing ? Clock::now() : Clock::now() + kSlice)) break;
        if (closing) {
          link.keep(posted);
          return Sent::kClosing;
        }
        // The subscriber's next message, looked at once a slice while a send takes longer: a
        // refusal means the rest will never be taken (an honest next request only means the
        // subscriber had all of it before this side saw the send complete; serve() reads it).
        if (looked || !link.wait(next.pending, Clock::now())) continue;
        looked = true;
        const std::string who = c10::str("Publisher (", link.peer(), "'s request)");
        if (decode_request(who.c_str(), next.buffer.data_ptr<uint8_t>()).refusal !=
            Refusal::kNone) {
          next.pending = nullptr;  // read: nothing of it is left to keep
          link.keep(posted);
          lose(s, next_message(who.c_str(), next.buffer, offer));
          return Sent::kLost;
        }
      }
      posted.erase(posted.begin());
      post_more();
    }
  } catch (const std::exception& e) {
    link.keep(posted);
    lose(s, text_of(e));
    return Sent::kLost;
  }
  return Sent::kTaken;
}

void PublisherCore::serve(Subscription& s, Link& link) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    s.serving = true;
  }
  serve_requests(s, link);
  std::lock_guard<std::mutex> lock(mutex_);
  s.serving = false;
  // The others that left meanwhile are forgotten now, not at the next add(): the last clients
  // of a burst would stay otherwise. `s` itself stays until then: its caller still holds it.
  prune_locked(&s);
}

void PublisherCore::serve_requests(Subscription& s, Link& link) {
  NextRequest next{message_buffer(), nullptr};
  const std::string who = c10::str("Publisher (", link.peer(), "'s request)");
  try {
    next.pending = link.post_recv(next.buffer, Kind::kRequest);
    for (;;) {
      // A subscriber on shared memory sends nothing in the steady state: while its next message
      // is awaited, its process is looked at every 20 ms, so that the pins of one that was
      // killed are cleared within that even when its transport is slow to tell (a pipe).
      bool arrived = false;
      std::optional<std::string> exited;
      while (!closing_.load() && !exited) {
        const bool mapped = mapped_entry(s);
        if (link.wait(next.pending, Clock::now() + (mapped ? kShmWatch : kSlice))) {
          arrived = true;
          break;
        }
        if (mapped) exited = subscriber_exited(s);
      }
      if (exited) lose(s, *exited);
      if (!arrived) break;
      const at::Tensor request = next.buffer;
      next = NextRequest{};  // read
      Request r;
      try {
        r = decode_request(who.c_str(), request.data_ptr<uint8_t>());
      } catch (const c10::Error& e) {
        // Not a request: the peer's messages cannot be trusted any more.
        lose(s, e.what_without_backtrace());
        Offer refused;
        refused.status = Status::kRefused;
        refused.seq = core::get_le(request.data_ptr<uint8_t>() + 16);  // whatever it said
        answer(s, link, refused, {}, {}, next);
        return;
      }
      if (r.decline != 0) {
        // The subscriber could not map the offer's segments: it pulls over the link now.
        std::lock_guard<std::mutex> lock(mutex_);
        release_entry_locked(s);
        s.stats.transport =
            c10::str("socket (shared memory refused: ", decline_text(r.decline), ")");
        next.buffer = message_buffer();
        next.pending = link.post_recv(next.buffer, Kind::kRequest);
        continue;
      }
      if (r.host != 0) {
        // The subscriber's host, for routes (Request::host); nothing answers it.
        {
          std::lock_guard<std::mutex> lock(mutex_);
          s.host = r.host;
          s.slots = r.host_slots;
        }
        next.buffer = message_buffer();
        next.pending = link.post_recv(next.buffer, Kind::kRequest);
        continue;
      }
      if (r.resume != 0) {
        next.buffer = message_buffer();
        next.pending = link.post_recv(next.buffer, Kind::kRequest);
        if (answer_resume(s, link, r, next) != Next::kServe) break;
        continue;
      }
      if (r.refusal != Refusal::kNone) {
        // A refusal of the last answer once all of it was sent (a transport whose sends
        // complete before the peer takes them): the subscriber pulls no more, and a version it
        // refused is not counted as received.
        std::string why;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (s.last.status == Status::kNew && s.last.seq == r.seq) {
            s.stats.version = s.version_before;
            --s.stats.pulls;
          }
          why = next_message(who.c_str(), request, s.last);
        }
        lose(s, why);
        return;
      }
      next.buffer = message_buffer();
      next.pending = link.post_recv(next.buffer, Kind::kRequest);  // ready for the next at once
      if (answer_request(s, link, r, next) != Next::kServe) break;
    }
  } catch (const std::exception& e) {
    lose(s, text_of(e));
  }
  // Whatever ended the serving, the receive still posted is left to the link (its buffer
  // alive): a later publisher on the link takes the request that lands in it.
  if (next.pending) link.keep({next.pending});
}

PublisherCore::Next PublisherCore::next_of(Sent sent) {
  switch (sent) {
    case Sent::kTaken: return Next::kServe;
    case Sent::kClosing: return Next::kClose;
    case Sent::kLost: break;
  }
  return Next::kStop;
}

PublisherCore::Next PublisherCore::answer_request(Subscription& s, Link& link, const Request& r,
                                                  NextRequest& next) {
  std::unique_lock<std::mutex> lock(mutex_);
  s.asked = true;
  if (!std::exchange(s.ready, true)) ++ready_;
  s.stats.waiting = true;
  if (r.relay && routing_ != Routing::kStar) {
    s.relay_request = r;
    s.relays = true;
  }
  changed_.notify_all();  // wait_for_subscribers
  // A subscriber that can map shared memory is answered with it as soon as there is some.
  const auto shm_ready = [&] { return r.shm && shm_ && shm_->slots != nullptr; };
  const auto eligible = [&] {
    if (closing_.load() || shm_ready()) return true;
    if (newest_ < 0) return false;
    const Slot& slot = slots_[newest_];
    if (slot.writing) return false;  // the only slot, being filled again (max_slots 1)
    const bool newer = r.epoch != epoch_ || slot.version > r.version;
    return newer && slot.version >= r.min_version;
  };
  Offer offer;
  offer.seq = r.seq;
  offer.epoch = epoch_;
  // In slices, looking at the subscriber between them: one that closes, dies or sends again
  // while it waits ends its subscription now, not when a version comes.
  const auto until = r.wait_ms < 0 ? Clock::time_point::max()
                                   : Clock::now() + std::chrono::milliseconds(r.wait_ms);
  while (!changed_.wait_until(lock, std::min(until, Clock::now() + kSlice), eligible) &&
         Clock::now() < until) {
    lock.unlock();
    std::optional<std::string> stop;
    try {
      if (link.wait(next.pending, Clock::now())) {
        const std::string who = c10::str("Publisher (", link.peer(), "'s request)");
        stop = next_message(who.c_str(), next.buffer, offer);
      }
    } catch (const std::exception& e) {
      stop = text_of(e);
    }
    lock.lock();
    if (stop) {
      next.pending = nullptr;  // read, or failed
      s.stats.waiting = false;
      s.relay_request.reset();
      lock.unlock();
      lose(s, *stop);
      return Next::kStop;
    }
  }
  s.stats.waiting = false;
  s.relay_request.reset();
  const auto answer_closed = [&] {
    offer.status = Status::kClosed;
    lock.unlock();
    answer(s, link, offer, {}, {}, next);
    return Next::kClose;
  };
  if (closing_.load()) return answer_closed();
  if (shm_ready()) {
    if (std::optional<Offer> o = shm_offer_locked(s, r)) {
      s.last = *o;
      lock.unlock();
      const Sent sent = answer(s, link, *o, {}, {}, next);
      lock.lock();
      if (sent == Sent::kTaken) s.stats.transport = "shm";
      return next_of(sent);
    }
  }
  if (r.shm && s.stats.transport == "socket") {
    s.stats.transport = c10::str(
        "socket (shared memory refused: ",
        transport_ == Transport::kSocket ? std::string("the publisher's transport is \"socket\"")
        : shm_ && !shm_->failed.empty()  ? shm_->failed
                                         : std::string("no entry is free for it"),
        ")");
  }
  if (!eligible()) {
    offer.status = Status::kNone;
    s.last = offer;
    lock.unlock();
    return next_of(answer(s, link, offer, {}, {}, next));
  }
  if (r.relay && routing_ != Routing::kStar) {
    // Waiting again while the route is made: a builder that gathers (the lock let go) counts
    // this subscriber in, though its thread woke to the publish first.
    s.relay_request = r;
    std::shared_ptr<Plan> plan = plan_locked(s, lock);
    s.relay_request.reset();
    if (plan) return answer_relayed(s, link, r, next, plan, lock);
    // plan_locked may have waited: the newest slot may be being filled again (max_slots 1).
    changed_.wait(lock,
                  [&] { return closing_.load() || (newest_ >= 0 && !slots_[newest_].writing); });
    if (closing_.load()) return answer_closed();
  }
  Slot& slot = slots_[newest_];
  ++slot.pins;
  s.stats.pinned = slot.version;
  s.stats.relayed_from.reset();
  s.stats.relayed_second.reset();
  offer.status = Status::kNew;
  offer.version = slot.version;
  offer.data_bytes = slot.bytes;
  offer.schema = slot.schema;
  const bool reuse = r.epoch == epoch_ && r.schema == slot.schema;
  offer.schema_bytes = reuse ? 0 : static_cast<int64_t>(slot.json->size());
  const at::Tensor schema = reuse ? at::Tensor() : core::bytes_tensor(*slot.json);
  const at::Tensor data = slot.storage.narrow(0, 0, slot.bytes);
  const bool big = slot.bytes >= kBigVersion;
  if (big) {
    // One large version at a time while another is moving: they share the machine's memory
    // bandwidth, so each subscriber is served sooner one after another, and its copy overlaps
    // the next one's transfer. A send past its turn (a slow, stopped or dead subscriber) no
    // longer holds the others back: it delays them once, by a turn at most.
    const auto turn =
        std::clamp(2 * big_send_time_, Clock::duration(kMinTurn), Clock::duration(kMaxTurn));
    // Until no send within its turn is left: the end of the latest turn, or a send's end.
    for (;;) {
      const auto now = Clock::now();
      auto until = now;
      for (const auto& t : big_sends_) until = std::max(until, t + turn);
      if (until == now || closing_.load()) break;
      changed_.wait_until(lock, until);
    }
    big_sends_.push_back(Clock::now());
  }
  const auto mine = big ? std::prev(big_sends_.end()) : big_sends_.end();
  lock.unlock();

  const Sent sent = answer(s, link, offer, schema, data, next);
  const bool taken = sent == Sent::kTaken;
  lock.lock();
  if (big) {
    if (taken) big_send_time_ = Clock::now() - *mine;
    big_sends_.erase(mine);
  }
  --slot.pins;
  s.stats.pinned.reset();
  if (taken) count_taken_locked(s, offer);
  changed_.notify_all();
  return next_of(sent);
}

std::shared_ptr<PublisherCore::Plan> PublisherCore::plan_locked(
    Subscription& s, std::unique_lock<std::mutex>& lock) {
  std::shared_ptr<Plan> p = plan_;
  if (p) {
    changed_.wait(lock, [&] { return p->ready; });
    // A member answers by its route, even when a newer version came meanwhile: its children
    // wait for its pieces.
    if (p->places.count(&s) != 0 && p->answered.insert(&s).second) return p;
  }
  // Looked at after the wait: a publish may have come meanwhile, and may be writing the slot
  // (then the caller waits for it, as it does for any version).
  if (newest_ < 0 || slots_[newest_].writing) return nullptr;
  Slot& slot = slots_[newest_];
  if (p && p->version == slot.version) {
    // Not a member (its request came after the route was made): it reads the version from its
    // host's first's slots, where that one writes it for the others of its host; else whole.
    // A member asking again (its pull of it ended early) is sent it whole.
    if (p->places.count(&s) != 0 || s.host == 0) return nullptr;
    for (const auto& [t, place] : p->places) {
      if (t->host == s.host && place.host_source && t->slots.epoch == epoch_ &&
          place.host_parent.pid == 0) {
        Plan::Place& mine = p->places[&s];
        mine.parent = mine.second.parent = t->stats.rank;  // both lanes from its slots
        mine.host_parent = t->slots;
        p->answered.insert(&s);
        return p;
      }
    }
    return nullptr;
  }
  // The first of the waiting subscribers to come makes the route, the slot pinned meanwhile;
  // the others wait for it.
  p = std::make_shared<Plan>();
  p->version = slot.version;
  p->bytes = slot.bytes;
  p->schema = slot.schema;
  p->json = slot.json;
  plan_ = p;
  ++slot.pins;
  const auto done = [&] {
    --slot.pins;
    p->ready = true;
    changed_.notify_all();
  };
  const auto waits = [&](const Subscription& t) {
    if (&t == &s) return true;
    if (!t.relay_request || !t.serving || t.stats.lost || t.entry >= 0) return false;
    const Request& q = *t.relay_request;
    const bool newer = q.epoch != epoch_ || p->version > q.version;
    return newer && p->version >= q.min_version;
  };
  // Those that relayed before, or never asked, are given kGather to ask: one that asks a
  // moment after the publish would otherwise be sent the version whole.
  const auto gathered = [&] {
    if (closing_.load()) return true;
    for (const auto& t : subscriptions_) {
      const bool expected = (t.relays || !t.asked) && t.serving && !t.stats.lost && t.entry < 0;
      if (expected && !waits(t)) return false;
    }
    return true;
  };
  if (p->bytes >= kGatherFrom) changed_.wait_until(lock, Clock::now() + kGather, gathered);
  // Every one whose request this version answers; those routed around before are leaves.
  std::vector<Subscription*> healthy, slow;
  for (auto& t : subscriptions_) {
    if (waits(t)) (t.demoted ? slow : healthy).push_back(&t);
  }
  if (healthy.size() + slow.size() < 2) {  // one alone: sent whole
    done();
    return nullptr;
  }
  if (slow.size() > healthy.size()) {
    // Most were routed around: the fault was the machine's or the links', not theirs (a
    // loaded host, a burst); they are tried as relays again rather than all hung off one.
    for (Subscription* t : slow) t->demoted = false;
    healthy.insert(healthy.end(), slow.begin(), slow.end());
    slow.clear();
  }
  // The subscribers of one host one after another, hosts in the order their first subscriber
  // came: a version then crosses each host's interface once (the hops within a host go
  // through its loopback).
  std::vector<uint64_t> hosts;
  for (const Subscription* t : healthy) {
    if (t->host != 0 && std::find(hosts.begin(), hosts.end(), t->host) == hosts.end()) {
      hosts.push_back(t->host);
    }
  }
  const auto host_order = [&](const Subscription* t) {
    if (t->host == 0) return hosts.size();
    return static_cast<size_t>(std::find(hosts.begin(), hosts.end(), t->host) - hosts.begin());
  };
  std::stable_sort(
      healthy.begin(), healthy.end(),
      [&](const Subscription* a, const Subscription* b) { return host_order(a) < host_order(b); });
  // A host's first subscriber writes the version into its slots for the others of its host
  // (those routed around before too), who read it there once its slots are known (one that
  // keeps them goes first); until then they follow it on the chain, through the host's
  // loopback, and the slow hang off the chain's end.
  const auto keeps = [&](const Subscription* t) { return t->slots.epoch == epoch_; };
  std::vector<Subscription*> chain;
  std::vector<Subscription*> firsts;  // of each host (each subscriber of no known host)
  std::vector<std::pair<Subscription*, Subscription*>> follow;  // on the chain after its first
  std::map<uint64_t, Subscription*> first_of;  // each known host's first on the chain
  const auto read_slots = [&](Subscription* t, Subscription* first) {
    Plan::Place& place = p->places[t];
    place.parent = place.second.parent = first->stats.rank;  // both lanes from its slots
    place.host_parent = first->slots;
  };
  for (size_t i = 0; i < healthy.size();) {
    size_t end = i + 1;
    while (end < healthy.size() && healthy[i]->host != 0 && healthy[end]->host == healthy[i]->host)
      ++end;
    std::stable_partition(healthy.begin() + static_cast<std::ptrdiff_t>(i),
                          healthy.begin() + static_cast<std::ptrdiff_t>(end), keeps);
    Subscription* first = healthy[i];
    chain.push_back(first);
    firsts.push_back(first);
    if (first->host != 0) first_of[first->host] = first;
    if (end - i > 1) p->places[first].host_source = true;
    for (size_t k = i + 1; k < end; ++k) {
      if (keeps(first)) {
        read_slots(healthy[k], first);
      } else {
        chain.push_back(healthy[k]);
        follow.emplace_back(healthy[k], first);
      }
    }
    i = end;
  }
  // The slow read their host's first's slots, or are leaves of the route (below): they delay
  // nobody.
  std::vector<Subscription*> hanging;
  for (Subscription* t : slow) {
    const auto it = first_of.find(t->host);
    if (t->host != 0 && it != first_of.end()) {
      p->places[it->second].host_source = true;
      if (keeps(it->second)) {
        read_slots(t, it->second);
        continue;
      }
    }
    hanging.push_back(t);
  }
  // The route's length sizes the pieces (its readers of slots take none).
  const double n = static_cast<double>(std::max<size_t>(chain.size() + hanging.size(), 2));
  const bool trees = routing_ == Routing::kTree && firsts.size() >= 2;
  const double hops =
      trees ? 2 * std::ceil(std::log2(static_cast<double>(firsts.size() + hanging.size()) + 1))
            : n - 1;
  const double rate = rate_ > 0 ? static_cast<double>(rate_) : kFirstRate;
  double best = std::sqrt(static_cast<double>(p->bytes) * kPieceCost * rate / hops);
  // A test hook: pieces of this many bytes (within the bounds), for benchmarks/piece_cost.py,
  // which measures what a piece costs by sending the same version in pieces of two sizes.
  if (const auto forced = core::env("TENSORDICT_TEST_PIECE_BYTES")) {
    best = std::strtod(forced->c_str(), nullptr);
  }
  p->piece_bytes =
      std::clamp<int64_t>(static_cast<int64_t>(best) / 4096 * 4096, kMinPieceBytes, kMaxPieceBytes);
  p->pieces = piece_count(p->bytes, p->piece_bytes);
  const auto adopt = [&](Subscription* parent, Subscription* child, int lane) {
    Plan::Place& up = p->places[parent];
    Plan::Place& place = p->places[child];
    (lane == 0 ? up.children : up.second.children).push_back(child->stats.rank);
    (lane == 0 ? place.parent : place.second.parent) = parent->stats.rank;
  };
  if (trees && p->pieces >= 2) {
    // Two binary trees over the hosts' firsts, each carrying half of the pieces, in which every
    // one forwards in one at most: each sends about one copy, and the last holds the version
    // about 2 log2(n) piece times after the first (NCCL's double binary tree). The others of a
    // host, until its first's slots are known, take both halves from it through its loopback.
    p->split = (p->pieces + 1) / 2;
    const auto m = static_cast<int64_t>(firsts.size());
    std::vector<Subscription*> at_second(static_cast<size_t>(m) + 1);
    for (int64_t k = 0; k < m; ++k) at_second[second_position(k + 1, m)] = firsts[k];
    for (int64_t k = 0; k < m; ++k) {
      Subscription* t = firsts[k];
      p->places[t];  // a place even as both roots' child
      if (const int64_t up = tree_parent(k + 1, m); up != 0) adopt(firsts[up - 1], t, 0);
      if (const int64_t up = tree_parent(second_position(k + 1, m), m); up != 0) {
        adopt(at_second[up], t, 1);
      }
    }
    std::map<Subscription*, Subscription*> last;  // of each first's followers: one after another
    for (const auto& [t, first] : follow) {
      Subscription*& up = last.emplace(first, first).first->second;
      adopt(up, t, 0);
      adopt(up, t, 1);
      up = t;
    }
    // The slow are leaves of both trees, each lane's under the member that sends least (one
    // forwarding in a tree already would share its link with them).
    const auto sends = [&](Subscription* t) {
      const Plan::Place& q = p->places[t];
      return q.children.size() + q.second.children.size();
    };
    const auto least = [&] {
      return *std::min_element(firsts.begin(), firsts.end(), [&](Subscription* a, Subscription* b) {
        return sends(a) < sends(b);
      });
    };
    for (Subscription* t : hanging) {
      if (sends(least()) + 2 > kMaxChildren) continue;  // sent whole
      adopt(least(), t, 0);
      adopt(least(), t, 1);
    }
  } else {
    for (size_t i = 0; i < chain.size(); ++i) {
      p->places[chain[i]];
      if (i > 0) adopt(chain[i - 1], chain[i], 0);
    }
    // The slow hang off the chain's end (then the one before it, beyond kMaxChildren).
    for (size_t h = 0; h < hanging.size(); ++h) {
      const size_t from_end = h / kMaxChildren;
      if (from_end >= chain.size()) continue;  // sent whole
      adopt(chain[chain.size() - 1 - from_end], hanging[h], 0);
    }
  }
  // Framed outside the lock: every piece message as it travels, and its checksum.
  lock.unlock();
  try {
    p->framed = at::empty({p->pieces * p->message_bytes()}, at::kByte);
    uint8_t* out = p->framed.data_ptr<uint8_t>();
    const uint8_t* in = slot.storage.data_ptr<uint8_t>();
    p->checksums.resize(static_cast<size_t>(p->pieces));
    for (int64_t i = 0; i < p->pieces; ++i) {
      const int64_t n_i = std::min(p->piece_bytes, p->bytes - i * p->piece_bytes);
      uint8_t* m = out + i * p->message_bytes();
      encode_piece_header({epoch_, p->version, i, n_i}, m);
      if (n_i > 0) std::memcpy(m + kPieceHeaderBytes, in + i * p->piece_bytes, n_i);
      std::memset(m + kPieceHeaderBytes + n_i, 0, p->piece_bytes - n_i);  // the last's padding
      p->checksums[i] = piece_checksum(m + kPieceHeaderBytes, static_cast<size_t>(n_i));
    }
  } catch (...) {
    lock.lock();
    p->places.clear();
    done();
    throw;
  }
  lock.lock();
  done();
  if (p->places.count(&s) == 0) return nullptr;
  p->answered.insert(&s);
  return p;
}

PublisherCore::Next PublisherCore::answer_relayed(Subscription& s, Link& link, const Request& r,
                                                  NextRequest& next,
                                                  const std::shared_ptr<Plan>& plan,
                                                  std::unique_lock<std::mutex>& lock) {
  const Plan::Place& place = plan->places.at(&s);
  Offer offer = plan->offer(r.seq, epoch_);
  const bool reuse = r.epoch == epoch_ && r.schema == plan->schema;
  offer.schema_bytes = reuse ? 0 : static_cast<int64_t>(plan->json->size());
  const Route route = plan->route(&s, r.seq, epoch_, rate_, false, 0);
  std::vector<std::pair<at::Tensor, Kind>> then;
  if (!reuse) then.emplace_back(core::bytes_tensor(*plan->json), Kind::kSchema);
  then.emplace_back(core::bytes_tensor(encode(route, plan->bytes)), Kind::kRoute);
  // The roots of the route's lanes take their lane's pieces from here.
  const bool root = place.parent < 0 && place.host_parent.pid == 0;
  if (root) plan->pieces_of(0, then);
  if (plan->split > 0 && place.host_parent.pid == 0 && place.second.parent < 0) {
    plan->pieces_of(plan->split, then);
  }
  s.stats.relayed_from = place.parent;
  s.stats.relayed_second = plan->split > 0 && place.host_parent.pid == 0
                               ? std::optional(place.second.parent)
                               : std::nullopt;
  lock.unlock();
  const auto start = Clock::now();
  const Sent sent = answer(s, link, offer, then, next, /*pausable=*/true);
  const auto took = std::chrono::duration<double>(Clock::now() - start).count();
  lock.lock();
  if (sent == Sent::kTaken) {
    // The first link's rate, from versions large enough that the socket's buffers and a
    // paced link's burst do not make it (two lanes' roots take half each, at once, over it).
    if (plan->first_relay(&s) && took > 0 && plan->bytes >= kRateFrom) {
      rate_ = static_cast<int64_t>(static_cast<double>(plan->bytes) / took);
    }
    count_taken_locked(s, offer);
  }
  changed_.notify_all();
  return next_of(sent);
}

void PublisherCore::count_taken_locked(Subscription& s, const Offer& offer) {
  s.version_before = s.stats.version;
  s.stats.version = offer.version;
  ++s.stats.pulls;
  s.last = offer;
}

PublisherCore::Next PublisherCore::answer_resume(Subscription& s, Link& link, const Request& r,
                                                 NextRequest& next) {
  std::unique_lock<std::mutex> lock(mutex_);
  const std::shared_ptr<Plan> plan = plan_;
  Subscription* paused = nullptr;
  // Only the parent its route gave it: a resume that names another rank (a hostile or a
  // confused subscriber) routes nobody around.
  // (In the lane of its piece; the version relayed since: its first lane's.)
  std::optional<int64_t> parent = s.stats.relayed_from;
  if (plan && plan->version == r.version && r.piece >= 0 && r.piece < plan->pieces &&
      plan->places.count(&s) != 0) {
    const Plan::Place& mine = plan->places.at(&s);
    parent = plan->lane_of(r.piece) == 0 ? mine.parent : mine.second.parent;
  }
  if (r.around >= 0 && parent == std::optional<int64_t>(r.around)) {
    for (auto& t : subscriptions_) {
      if (t.stats.rank != r.around) continue;
      t.demoted = true;
      t.stats.routed_around = c10::str(s.stats.peer, " left it at piece ", r.piece, " of version ",
                                       r.version, ": ", resume_text(r.resume));
      // A slow first relay takes this publisher's pieces too: it waits while the one that left
      // it is answered, so that the two do not share this publisher's link.
      if (r.resume == static_cast<uint32_t>(Resume::kSlow) && plan && plan->first_relay(&t) &&
          !t.paused) {
        t.paused = true;
        paused = &t;
      }
    }
  }
  // Unpaused however the answer ends.
  const auto unpause = [&] {
    if (paused == nullptr) return;
    std::lock_guard<std::mutex> relock(mutex_);
    paused->paused = false;
  };
  Offer offer;
  offer.seq = r.seq;
  offer.epoch = epoch_;
  if (!plan || !plan->ready || r.epoch != epoch_ || r.version != plan->version ||
      r.piece >= plan->pieces) {
    // The version is no longer the one relayed: the subscriber asks for the newest.
    offer.status = Status::kNone;
    lock.unlock();
    unpause();
    return next_of(answer(s, link, offer, {}, {}, next));
  }
  offer = plan->offer(r.seq, epoch_);
  const Route route = plan->route(&s, r.seq, epoch_, rate_, true, r.piece);
  std::vector<std::pair<at::Tensor, Kind>> then;
  then.emplace_back(core::bytes_tensor(encode(route, plan->bytes)), Kind::kRoute);
  plan->pieces_of(r.piece, then);
  lock.unlock();
  const Sent sent = answer(s, link, offer, then, next);
  unpause();
  return next_of(sent);
}

int64_t PublisherCore::version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return version_;
}

std::vector<SubscriberStats> PublisherCore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SubscriberStats> out;
  for (const auto& s : subscriptions_) {
    out.push_back(s.stats);
    if (s.entry < 0 || !shm_ || !shm_->pins) continue;
    // What a subscriber on shared memory wrote of itself (it sends nothing): shown, never
    // trusted.
    SubscriberStats& st = out.back();
    const uint8_t* q = shm_->entry(s.entry);
    const auto version = static_cast<int64_t>(L::word<uint64_t>(q, L::kEntryVersionAt).load());
    if (version > 0) st.version = version;
    st.pulls += static_cast<int64_t>(L::word<uint64_t>(q, L::kPullsAt).load() & INT64_MAX);
    st.waiting = st.waiting || L::word<uint64_t>(q, L::kWaitingAt).load() != 0;
    for (const size_t at : {L::kReadingAt, L::kHeldAt}) {
      const uint64_t pin = L::word<uint64_t>(q, at).load();
      if (pin != 0) st.pinned = static_cast<int64_t>(pin & ((uint64_t{1} << L::kVersionBits) - 1));
    }
  }
  return out;
}

void PublisherCore::wait_for_subscribers(const char* call, std::chrono::milliseconds timeout,
                                         std::optional<size_t> count,
                                         const std::string& hint) const {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto all = [&] { return count ? ready_ >= *count : ready_ >= added_; };
  if (changed_.wait_for(lock, timeout, all)) return;
  std::string silent;
  for (const auto& s : subscriptions_) {
    if (!s.ready) silent += c10::str(silent.empty() ? "" : ", ", s.stats.peer);
  }
  if (count && added_ < *count) {
    silent += c10::str(silent.empty() ? "" : "; ", *count - added_, " of the ", *count,
                       " subscribers expected never connected");
  }
  TD_THROW(TimeoutError, call, ": no request from ", silent, " within ", timeout.count(),
           " ms: ", hint);
}

void PublisherCore::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  closing_.store(true);
  mark_locked(L::kClosed);
  changed_.notify_all();
}

std::string PublisherCore::pinning_locked() const {
  std::string pinning;
  for (const auto& s : subscriptions_) {
    std::optional<int64_t> pinned = s.stats.pinned;
    const char* how = "";
    if (s.entry >= 0 && shm_ && shm_->pins) {
      for (const size_t at : {L::kReadingAt, L::kHeldAt}) {
        const uint64_t pin = L::word<uint64_t>(shm_->entry(s.entry), at).load();
        if (pin != 0) {
          pinned = static_cast<int64_t>(pin & ((uint64_t{1} << L::kVersionBits) - 1));
          how = ", in shared memory";
        }
      }
    }
    if (!pinned) continue;
    pinning += c10::str(pinning.empty() ? "" : ", ", s.stats.peer, " (version ", *pinned, how, ")");
  }
  return pinning;
}

int64_t PublisherCore::publish(const TensorDict& td,
                               std::optional<std::chrono::milliseconds> timeout,
                               const std::optional<std::string>& tensorclass_type) {
  constexpr const char* kCall = "publish";
  TORCH_CHECK(!closing_.load(), kCall, ": the Publisher is closed");
  TORCH_CHECK_VALUE(!timeout || timeout->count() >= 0, kCall, ": timeout must not be negative");
  std::lock_guard<std::mutex> one(publish_mutex_);
  const Leaves leaves = leaves_in_order(td);
  for (const auto& [path, leaf] : leaves) check_transferable(kCall, NestedKey(path).str(), leaf);

  Metadata metadata = metadata_of(td);
  if (!last_metadata_ || !(*last_metadata_ == metadata) || last_tensorclass_ != tensorclass_type) {
    const int64_t bytes = metadata_storage_bytes(metadata);
    TransportFields fields{{"_total_bytes", bytes}};
    if (tensorclass_type) fields.emplace_back("_tensorclass_type", *tensorclass_type);
    last_json_ = std::make_shared<const std::string>(metadata_to_json(metadata, false, fields));
    last_schema_ = schema_hash(*last_json_);
    last_metadata_ = std::move(metadata);
    last_tensorclass_ = tensorclass_type;
  }
  const int64_t bytes = metadata_storage_bytes(*last_metadata_);

  // A slot nobody pins or fills, the oldest first; the newest last (while it is filled again,
  // pulls wait for the new version rather than take the old one).
  std::unique_lock<std::mutex> lock(mutex_);
  const bool shm = ensure_segment_locked(bytes, last_json_->size());
  const auto pick = [&]() -> int {
    int best = -1;
    const auto rank_of = [&](int i) { return std::pair{i == newest_, slots_[i].version}; };
    for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
      const auto& s = slots_[i];
      if (s.pins > 0 || s.writing || shm_pinned_locked(i, s.version)) continue;
      if (best < 0 || rank_of(i) < rank_of(best)) best = i;
    }
    if (best < 0 || !shm) return best;
    // Dekker with the subscribers (§9.8): the slot is marked as being written, then its pins
    // are looked at again; a subscriber pins, then looks at the slot's state. One of the two
    // sees the other: a subscriber that pinned first keeps the slot, one that comes later
    // finds it being written.
    shm_->state(best).store(L::kWriting);
    if (shm_pinned_locked(best, slots_[best].version)) {
      shm_->state(best).store(static_cast<uint64_t>(slots_[best].version));
      return -1;
    }
    return best;
  };
  int index = pick();
  if (index < 0) {
    const auto deadline = timeout ? Clock::now() + *timeout : Clock::time_point::max();
    while (index < 0 && !closing_.load()) {
      // Subscribers on shared memory unpin without a word: looked at every 2 ms, and the pins
      // of those that died are cleared.
      reap_dead_locked();
      const auto until =
          shm ? std::min(deadline, Clock::now() + std::chrono::milliseconds(2)) : deadline;
      changed_.wait_until(lock, until);
      index = pick();
      if (index < 0 && Clock::now() >= deadline) {
        TD_THROW(TimeoutError, kCall, ": every one of the ", slots_.size(),
                 " slots is pinned by a subscriber still receiving it: ", pinning_locked(),
                 "; waited ", timeout ? timeout->count() : 0,
                 " ms. Raise max_slots, or find out why they do not take their data");
      }
    }
    if (index < 0) TORCH_CHECK(false, kCall, ": the Publisher was closed");
  }
  Slot& slot = slots_[index];
  slot.writing = true;
  const std::shared_ptr<shm::Segment> segment = shm ? shm_->slots : nullptr;
  uint8_t* record = shm ? shm_->record(index) : nullptr;
  uint8_t* json_area =
      shm ? segment->data() + L::slot_at(static_cast<uint32_t>(slots_.size()), shm_->json_cap,
                                         shm_->data_cap, static_cast<uint32_t>(index))
          : nullptr;
  lock.unlock();
  try {
    if (record != nullptr) {
      std::memcpy(json_area, last_json_->data(), last_json_->size());
      L::word<uint64_t>(record, L::kSlotBytesAt).store(static_cast<uint64_t>(bytes));
      L::word<uint64_t>(record, L::kSchemaAt).store(last_schema_);
      L::word<uint64_t>(record, L::kJsonBytesAt).store(last_json_->size());
    }
    if (!slot.storage.defined() || slot.storage.numel() < bytes) {
      slot.storage = at::empty({bytes}, at::kByte);
      slot.views_schema = 0;
    }
    if (slot.views_schema != last_schema_) {
      slot.views = leaves_in_order(rebuild(*last_metadata_, slot.storage.narrow(0, 0, bytes)));
      slot.views_schema = last_schema_;
    }
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < leaves.size(); ++i) slot.views[i].second.copy_(leaves[i].second);
  } catch (...) {
    // Half written: the slot holds no version any more.
    std::lock_guard<std::mutex> relock(mutex_);
    slot.writing = false;
    slot.version = 0;
    if (record != nullptr && segment == shm_->slots) {
      L::word<uint64_t>(record, L::kStateAt).store(0);
      if (newest_ == index) L::word<uint64_t>(segment->data(), L::kNewestAt).store(0);
    }
    if (newest_ == index) newest_ = -1;
    changed_.notify_all();
    throw;
  }
  lock.lock();
  slot.writing = false;
  slot.bytes = bytes;
  slot.json = last_json_;
  slot.schema = last_schema_;
  slot.version = ++version_;
  newest_ = index;
  if (record != nullptr && segment == shm_->slots) {
    L::word<uint64_t>(record, L::kStateAt).store(static_cast<uint64_t>(slot.version));
    L::word<uint64_t>(segment->data(), L::kNewestAt)
        .store(L::pin_of(static_cast<uint32_t>(index), slot.version));
    shm_->wake();
  }
  changed_.notify_all();
  return slot.version;
}

}  // namespace tensordict::wire::publication
