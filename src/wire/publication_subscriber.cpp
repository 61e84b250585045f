#include "wire/publication_subscriber.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <variant>

#include "core/byte_tensor.h"
#include "core/env.h"
#include "core/excerpt.h"
#include "shm/segment.h"
#include "tensordict/errors.h"
#include "tensordict/nested_key.h"
#include "wire/leaf_order.h"
#include "wire/publication_shm.h"

namespace tensordict::wire::publication {
namespace {

// Waits are cut in slices, so that an interrupt ends a pull within one.
constexpr auto kSlice = std::chrono::milliseconds(100);
// A poll's request that the publisher has not taken after this long names a missing publisher.
constexpr auto kPollPatience = std::chrono::milliseconds(1000);
// Over shared memory: a wait for a version sleeps on the header's futex in slices of this, and
// looks whether the publisher's process exited at most this often (also in polls).
constexpr auto kShmSlice = std::chrono::milliseconds(50);
constexpr auto kShmLook = std::chrono::milliseconds(20);
// Relayed pieces (§9.9): receives posted ahead of the pieces; a parent that sends no piece in
// max(kMinStall, kStallPieces piece times) stalls; one whose pieces come at under a third of the
// route's rate (a lane of two: under kSlowerLane of the other lane's), measured over at least
// kSlowPieces pieces, crawls; either is left for the publisher.
constexpr size_t kPiecesAhead = 8;
constexpr auto kMinStall = std::chrono::milliseconds(200);
constexpr int64_t kStallPieces = 4;
constexpr int64_t kSlowPieces = 8;
// A stalled parent's children hear a hold at once; the relay leaves the parent this much later,
// so that its children, whose own bounds end a piece later, wait for it rather than leave it.
constexpr auto kHoldGrace = std::chrono::milliseconds(50);
constexpr int64_t kQueuedSlow = 4;
// A wait that ends this much after its deadline says this process did not run meanwhile (a
// SIGSTOP, a starved machine): the stall clock starts again rather than blame the parent.
constexpr auto kOverslept = std::chrono::milliseconds(100);
// A lane of two is slow at under this share of the other lane's rate (both take half a link).
constexpr double kSlowerLane = 0.6;
// A lane whose resume waits for the publisher's answer to the other lane looks this often.
constexpr auto kPausedLook = std::chrono::milliseconds(5);

namespace L = shm_layout;

using Leaves = std::vector<std::pair<std::vector<std::string>, at::Tensor>>;

std::optional<std::string> tensorclass_of(const core::ValidatedMetadata& m) {
  const JsonScalar* v = transport_field(m, "_tensorclass_type");
  if (v == nullptr || !std::holds_alternative<std::string>(*v)) return std::nullopt;
  return std::get<std::string>(*v);
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

// The first difference between `have` (the target's leaves) and `want` (the version's).
void check_same_leaves(const std::string& who, const Leaves& have, const Leaves& want) {
  for (size_t i = 0; i < std::max(have.size(), want.size()); ++i) {
    if (i >= have.size()) {
      TD_THROW(SchemaMismatchError, who, ": the version has key ",
               core::key_path_excerpt(want[i].first), ", which this TensorDict lacks");
    }
    if (i >= want.size() || have[i].first != want[i].first) {
      TD_THROW(SchemaMismatchError, who, ": this TensorDict has key ",
               core::key_path_excerpt(have[i].first), ", which the version ",
               i >= want.size()
                   ? "lacks"
                   : c10::str("has not here (it has ", core::key_path_excerpt(want[i].first), ")"));
    }
    const at::Tensor& a = have[i].second;
    const at::Tensor& b = want[i].second;
    if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
      TD_THROW(SchemaMismatchError, who, ": key ", core::key_path_excerpt(have[i].first), " is ",
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

}  // namespace

// What the subscriber holds: the last version it applied.
struct SubscriberCore::Held {
  uint64_t epoch = 0;
  int64_t version = 0;
  uint64_t schema = 0;
  int64_t data_bytes = 0;
  std::shared_ptr<const core::ValidatedMetadata> metadata;
};

// The slots of a relay on this host, mapped (§9.9): read-only, but for the entry this subscriber
// claimed in its pins segment (its pid word, from 0), cleared when it is unmapped.
struct HostReader {
  SlotsPlace place;
  std::shared_ptr<shm::Segment> slots, pins;
  L::Checked layout;
  uint8_t* entry = nullptr;
  std::unique_ptr<shm::Process> relay;
  uint64_t progress = 0;       // the relay's count, last seen
  Clock::time_point looked{};  // when its process was last looked at

  void unpin() const {
    if (entry != nullptr) L::word<uint64_t>(entry, L::kReadingAt).store(0);
  }
  ~HostReader() {
    if (entry == nullptr) return;
    L::word<uint64_t>(entry, L::kReadingAt).store(0);
    L::word<uint64_t>(entry, L::kHeldAt).store(0);
    L::word<uint32_t>(entry, L::kEntryPidAt).store(0);
  }
  const uint8_t* record(uint32_t i) const { return slots->data() + L::record_at(i); }
  const uint8_t* data(uint32_t i) const {
    return slots->data() + L::slot_at(layout.slots, layout.json_cap, layout.data_cap, i) +
           layout.json_cap;
  }
};

// Maps the slots at `place`, checked as a publisher's are (§9.8), and claims an entry; null
// with the reason in `why` when it cannot.
std::shared_ptr<HostReader> open_host(const SlotsPlace& place, std::string* why) {
  if (core::env("TENSORDICT_TEST_SHM_UNMAPPABLE")) {
    *why = "TENSORDICT_TEST_SHM_UNMAPPABLE is set (a test hook)";
    return nullptr;
  }
  auto h = std::make_shared<HostReader>();
  h->place = place;
  const auto pid = static_cast<pid_t>(place.pid);
  h->relay = std::make_unique<shm::Process>(pid);  // first: a pid reused maps nothing of it
  h->slots = shm::Segment::open(pid, static_cast<int>(place.slots_fd), false, why, false);
  if (h->slots) h->pins = shm::Segment::open(pid, static_cast<int>(place.pins_fd), true, why);
  if (!h->slots || !h->pins) return nullptr;
  h->layout = L::check_segments(*h->slots, *h->pins, place.token, place.epoch, 0);
  if (h->layout.why.empty() && h->layout.pid != place.pid) {
    h->layout.why = "the segment names another pid";
  }
  if (!h->layout.why.empty()) {
    *why = h->layout.why;
    return nullptr;
  }
  // A free entry, else one whose reader's process exited (its pins cleared once it is ours).
  const auto mine = static_cast<uint32_t>(::getpid());
  for (const bool take_dead : {false, true}) {
    for (uint32_t e = 0; e < L::kEntries; ++e) {
      uint8_t* q = h->pins->data() + L::entry_at(e);
      auto& pid_word = L::word<uint32_t>(q, L::kEntryPidAt);
      uint32_t holder = pid_word.load();
      if (holder != 0 && (!take_dead || shm::Process(static_cast<pid_t>(holder)).alive())) {
        continue;
      }
      if (pid_word.compare_exchange_strong(holder, mine)) {
        L::word<uint64_t>(q, L::kReadingAt).store(0);
        L::word<uint64_t>(q, L::kHeldAt).store(0);
        h->entry = q;
        return h;
      }
    }
  }
  *why = "no entry of its pins segment is free";
  return nullptr;
}

// One lane of a relayed version (§9.9): its pieces [next, end) from one parent (or the
// publisher), each forwarded to the lane's children. A route "tree" has two lanes, each taken
// by a thread of its own while a pull runs (so that both trees' pieces flow at once); every
// other route one.
struct Lane {
  int index = 0;        // its pieces travel as piece_kind(index)
  int64_t end = 0;      // after the lane's last piece
  int64_t parent = -1;  // the rank its pieces come from; -1: the publisher
  // The parts the parent's link is shared in: its children; a lane of two takes half a link
  // anyway (the publisher's is shared by the two roots, every other one's by its lane's two).
  int64_t siblings = 1;
  std::shared_ptr<Link> source;  // the parent's link, or the publisher's
  int64_t next = 0;              // the piece due next from the source
  struct Posted {
    at::Tensor buffer;  // a piece message's bytes (with room)
    PendingPtr pending;
  };
  std::deque<Posted> posted;  // receives on the source, in the order pieces arrive
  struct Child {
    int64_t rank = -1;
    std::shared_ptr<Link> link;
    bool alive = true;
  };
  std::vector<Child> children;
  struct Sending {
    at::Tensor buffer;  // whole (the message sent is its start)
    std::vector<std::pair<Link*, PendingPtr>> sends;
    bool pooled = true;  // a piece buffer (a hold's is not)
  };
  std::vector<Sending> sending;  // forwarded pieces and holds, until every child took them
  std::vector<at::Tensor> free;  // piece buffers to post again
  Clock::time_point progress;    // the last piece from the source (or the start)
  // The last pieces from this source: when each came, and what the parent said it queued.
  std::deque<std::pair<Clock::time_point, int64_t>> arrivals;
  int64_t queued = 0;      // what the source's last piece said it queued
  bool stalled = false;    // the source's bound passed: the children were held
  Clock::time_point held;  // the last hold sent to the children
  std::string lost;        // why the parent's link failed outside a wait
  // A resume waiting for the other lane's answer to end (the publisher answers one at a time).
  struct Wanted {
    Resume why;
    int64_t around;  // the parent left, or -1 (not its fault)
  };
  std::optional<Wanted> wanted;
  // A resume in flight: its offer, then its route.
  bool resuming = false;
  uint64_t resume_seq = 0;
  at::Tensor resume_offer, resume_route, resume_request;
  PendingPtr resume_offer_received, resume_route_received, resume_sent;
  bool resume_offered = false;

  bool done() const { return next >= end; }
  // What is posted on the publisher's link (the rest is left by leave()).
  std::vector<PendingPtr> pending() const {
    std::vector<PendingPtr> out;
    for (const auto& p : {resume_offer_received, resume_route_received, resume_sent}) {
      if (p) out.push_back(p);
    }
    return out;
  }
  // The receives posted on the source, left to its link (buffers alive until each completes):
  // what the parent may still send lands there.
  void leave_source() {
    std::vector<PendingPtr> receives;
    for (const auto& p : posted) receives.push_back(p.pending);
    if (!receives.empty()) source->keep(receives);
    posted.clear();
  }
  // What is posted on other links, left to them: the source's receives, the children's sends.
  void leave() {
    leave_source();
    for (const auto& s : sending) {
      for (const auto& [link, pending] : s.sends) link->keep({pending});
    }
    sending.clear();
  }
};

// A relayed version's pieces in flight (§9.9), once its route is read.
struct RelayState {
  Route route;
  int64_t pieces = 0;
  int64_t message_bytes = 0;  // every piece message: header, piece_bytes (the last one padded)
  std::shared_ptr<HostReader> host;  // the parent's slots, when it is on this host
  RelaySlots* slots = nullptr;       // this subscriber's, when it writes the version there
  int host_slot = -1;                // the parent's slot pinned (read as its pieces come)
  Clock::time_point host_progress;   // the parent's last progress seen in its slots
  std::string unmapped;              // why the parent's slots could not be mapped
  std::vector<std::unique_ptr<Lane>> lanes;
  // Between the lanes' threads: the subscriber's seq and routed_around, the pull's step, a
  // resume's messages on the publisher's link, and which lane the publisher answers now (-1:
  // none; its serving thread answers one request at a time: a lane's resume waits for it).
  std::mutex mutex;
  int answering = -1;
  std::atomic<bool> stop{false};               // a lane failed: the other ends its turn
  std::array<std::atomic<double>, 2> rates{};  // each lane's pieces lately, in bytes/s (0: none)
  std::atomic<bool> abandoned{false};          // the version left the publisher: ask again

  std::vector<PendingPtr> pending() const {
    std::vector<PendingPtr> out;
    for (const auto& l : lanes) {
      for (const auto& p : l->pending()) out.push_back(p);
    }
    return out;
  }
  void leave() {
    for (const auto& l : lanes) l->leave();
  }
};

struct Pull {
  uint64_t seq = 0;
  bool asked_shm = false;  // the request asked for shared memory
  int64_t wait_ms = 0;     // the request's
  Clock::time_point sent;
  at::Tensor request, offer_buffer;
  PendingPtr request_sent, offer_received;
  bool request_taken = false;
  std::optional<Offer> offer;
  std::shared_ptr<const core::ValidatedMetadata> metadata;  // the offer's, once read
  at::Tensor schema, data;
  PendingPtr schema_received, data_received;
  bool schema_done = false, data_done = false;
  // A relayed version (Status::kRelay): its route message, then its pieces.
  bool relayed = false;
  bool abandoned = false;  // the relayed version is gone from the publisher: ask again
  at::Tensor route;
  PendingPtr route_received;
  std::unique_ptr<RelayState> relay;
  // What a refusal of the publisher's bytes read at this step would say (kNone: the publisher
  // refused this subscriber, and is told nothing back).
  Refusal step = Refusal::kOffer;

  // Whatever of the pull is posted: kept (buffers alive) when it ends early.
  std::vector<PendingPtr> posted() const {
    std::vector<PendingPtr> out;
    for (const auto& p :
         {request_sent, offer_received, schema_received, data_received, route_received}) {
      if (p) out.push_back(p);
    }
    if (relay) {
      for (const auto& p : relay->pending()) out.push_back(p);
    }
    return out;
  }
};

struct SubscriberCore::Version {
  std::shared_ptr<const core::ValidatedMetadata> metadata;
  at::Tensor data;  // the version's storage (a slot's, read-only, when `slot` >= 0)
  uint64_t epoch = 0;
  int64_t version = 0;
  uint64_t schema = 0;
  int slot = -1;
};

// The publisher's slots, mapped (§9.8): the slots segment read-only, this subscriber's entry in
// the pins segment writable.
struct SubscriberCore::Mapped {
  std::shared_ptr<shm::Segment> slots, pins;
  L::Checked layout;
  uint64_t epoch = 0;
  uint8_t* entry = nullptr;
  std::unique_ptr<shm::Process> publisher;
  Clock::time_point looked{};
  std::vector<at::Tensor> data;  // each slot's data, over the mapping (which it keeps alive)
  struct Views {
    uint64_t schema = 0;
    int64_t bytes = 0;
    std::shared_ptr<const core::ValidatedMetadata> metadata;
    Leaves leaves;
  };
  std::vector<Views> views;  // each slot's leaves, for the schema they were made for
  uint64_t pulls = 0;

  const uint8_t* header() const { return slots->data(); }
  const uint8_t* record(uint32_t i) const { return header() + L::record_at(i); }
  std::atomic<uint64_t>& reading() const { return L::word<uint64_t>(entry, L::kReadingAt); }
  std::atomic<uint64_t>& held() const { return L::word<uint64_t>(entry, L::kHeldAt); }
  bool within(const void* p) const {
    const auto* b = static_cast<const uint8_t*>(p);
    return b >= slots->data() && b < slots->data() + slots->size();
  }
};

struct Leftover {
  SubscriberCore::Held held;
  std::shared_ptr<Pull> pull;
  std::string ended;
};

SubscriberCore::SubscriberCore(std::shared_ptr<Link> link, std::string who, int64_t max_total_bytes,
                               Transport transport, RelayLinks relay_links)
    : link_(std::move(link)),
      transport_(transport),
      relay_links_(std::move(relay_links)),
      stale_relay_([] {
        const std::optional<std::string> hook = core::env("TENSORDICT_TEST_RELAY_STALE");
        return !hook ? Stale::kNone : *hook == "slots" ? Stale::kSlots : Stale::kPieces;
      }()),
      test_host_(core::env("TENSORDICT_TEST_HOST")),
      who_(std::move(who)),
      max_total_bytes_(max_total_bytes),
      held_(std::make_unique<Held>()) {}

SubscriberCore::~SubscriberCore() { detach(); }

void SubscriberCore::detach() {
  if (!mapped_) return;
  // Views of the slots stay readable (the tensors keep the mapping); only the pins go.
  mapped_->reading().store(0);
  mapped_->held().store(0);
  mapped_.reset();
  transport_text_ = "socket";
}

void SubscriberCore::release_pin() {
  if (mapped_) mapped_->held().store(0);
}

bool SubscriberCore::attach(const Offer& offer) {
  const auto refuse = [&](const std::string& why, Decline reason = Decline::kOpen) {
    transport_text_ = c10::str("socket (shared memory refused: ", why, ")");
    declined_for_ = reason;
    return false;
  };
  // A test hook: a subscriber that cannot map (another user, host or pid namespace), played
  // by one that can.
  if (core::env("TENSORDICT_TEST_SHM_UNMAPPABLE")) {
    return refuse("TENSORDICT_TEST_SHM_UNMAPPABLE is set (a test hook)");
  }
  auto m = std::make_unique<Mapped>();
  // The publisher's process first: a pid reused after it exited maps nothing of it (the token
  // is checked below).
  m->publisher = std::make_unique<shm::Process>(static_cast<pid_t>(offer.pid));
  std::string why;
  m->slots = shm::Segment::open(static_cast<pid_t>(offer.pid), static_cast<int>(offer.slots_fd),
                                false, &why);
  if (m->slots) {
    m->pins = shm::Segment::open(static_cast<pid_t>(offer.pid), static_cast<int>(offer.pins_fd),
                                 true, &why);
  }
  if (!m->slots || !m->pins) return refuse(why);
  m->layout = L::check_segments(*m->slots, *m->pins, offer.token, offer.epoch, offer.entry);
  if (!m->layout.why.empty()) return refuse(m->layout.why, Decline::kCheck);
  if (m->layout.pid != offer.pid) {
    return refuse("the segment names another publisher's pid", Decline::kCheck);
  }
  m->epoch = offer.epoch;
  m->entry = m->pins->data() + L::entry_at(offer.entry);
  L::word<uint32_t>(m->entry, L::kEntryPidAt).store(static_cast<uint32_t>(::getpid()));
  const uint32_t n = m->layout.slots;
  const std::shared_ptr<shm::Segment> keep = m->slots;
  for (uint32_t i = 0; i < n; ++i) {
    auto* p = m->slots->data() + L::slot_at(n, m->layout.json_cap, m->layout.data_cap, i) +
              m->layout.json_cap;
    m->data.push_back(
        at::from_blob(p, {static_cast<int64_t>(m->layout.data_cap)}, [keep](void*) {}, at::kByte));
  }
  m->views.resize(n);
  m->looked = Clock::now();
  mapped_ = std::move(m);
  transport_text_ = "shm";
  return true;
}

std::optional<SubscriberCore::Version> SubscriberCore::shm_next(Clock::time_point deadline,
                                                                const PullOptions& options) {
  Mapped& m = *mapped_;
  const uint8_t* h = m.header();
  const auto& changes = L::word<uint32_t>(h, L::kChangesAt);
  const int64_t least = options.min_version.value_or(0);
  bool waited = false;
  for (;;) {
    if (interrupted_.load()) return std::nullopt;
    const uint32_t seen = changes.load();
    const uint32_t flags = L::word<uint32_t>(h, L::kFlagsAt).load();
    if ((flags & L::kClosed) && !waited) {
      // Closed before this pull: as over the link, the request goes there, where a new
      // publisher may serve (its epoch then new).
      detach();
      return std::nullopt;
    }
    if (flags & L::kClosed) {
      publisher_closed_ = true;
      TD_THROW(NoPublisherError, who_, ": the Publisher on ", link_->peer(),
               " closed (its shared memory says so)");
    }
    if (flags & L::kMoved) {
      detach();  // the next request asks for the new segment
      return std::nullopt;
    }
    const uint64_t newest = L::word<uint64_t>(h, L::kNewestAt).load();
    if (newest != 0) {
      const uint64_t slot = (newest >> L::kVersionBits) - 1;
      const auto version = static_cast<int64_t>(newest & ((uint64_t{1} << L::kVersionBits) - 1));
      TD_CHECK_PEER(slot < m.layout.slots && version >= 1, who_,
                    ": the publisher's shared memory names slot ", slot, " and version ", version,
                    " as the newest (", m.layout.slots, " slots; versions from 1)");
      const bool newer = m.epoch != held_->epoch || version > held_->version;
      if (newer && version >= least) {
        // Dekker with the publisher (§9.8): pinned first, then the slot's state looked at.
        const uint64_t pin = L::pin_of(static_cast<uint32_t>(slot), version);
        m.reading().store(pin);
        const uint8_t* record = m.record(static_cast<uint32_t>(slot));
        if (L::word<uint64_t>(record, L::kStateAt).load() == static_cast<uint64_t>(version)) {
          Refusal step = Refusal::kOffer;
          try {
            const auto bytes =
                static_cast<int64_t>(L::word<uint64_t>(record, L::kSlotBytesAt).load());
            const uint64_t schema = L::word<uint64_t>(record, L::kSchemaAt).load();
            const uint64_t json = L::word<uint64_t>(record, L::kJsonBytesAt).load();
            TD_CHECK_PEER(bytes >= 0 && static_cast<uint64_t>(bytes) <= m.layout.data_cap &&
                              json <= m.layout.json_cap && json <= kMaxMetadataJsonBytes,
                          who_, ": the publisher's shared memory announces a version of ", bytes,
                          " bytes and a schema of ", json, " bytes in slots of ", m.layout.data_cap,
                          " and ", m.layout.json_cap);
            step = Refusal::kStorage;
            TD_CHECK_PEER(
                bytes <= max_total_bytes_, who_, ": the publisher announces a storage of ", bytes,
                " bytes; this subscriber takes 0 to ", max_total_bytes_, " (max_total_bytes)");
            step = Refusal::kSchema;
            Mapped::Views& views = m.views[slot];
            if (views.schema != schema || views.bytes != bytes || !views.metadata) {
              std::shared_ptr<const core::ValidatedMetadata> metadata;
              if (held_->metadata && held_->schema == schema && held_->data_bytes == bytes) {
                metadata = held_->metadata;
              } else {
                // Read from a copy: what the parser reads is then what it checked.
                const uint8_t* text =
                    h + L::slot_at(m.layout.slots, m.layout.json_cap, m.layout.data_cap,
                                   static_cast<uint32_t>(slot));
                const std::string copy(reinterpret_cast<const char*>(text), json);
                Offer announced;
                announced.schema = schema;
                announced.data_bytes = bytes;
                try {
                  metadata = std::make_shared<core::ValidatedMetadata>(
                      read_schema(who_.c_str(), announced, copy));
                } catch (const MalformedPeerDataError&) {
                  throw;
                } catch (const c10::Error& e) {
                  TD_THROW(MalformedPeerDataError, who_,
                           ": the version's schema is refused: ", e.what_without_backtrace());
                }
              }
              views = Mapped::Views{schema, bytes, metadata,
                                    leaves_in_order(core::rebuild_validated(
                                        *metadata, m.data[slot].narrow(0, 0, bytes)))};
            }
            return Version{views.metadata, m.data[slot].narrow(0, 0, bytes),
                           m.epoch,        version,
                           schema,         static_cast<int>(slot)};
          } catch (const MalformedPeerDataError& e) {
            m.reading().store(0);
            ended_ =
                c10::str(e.what_without_backtrace(),
                         ". This subscriber refused it and pulls no more from ", link_->peer());
            detach();
            // The publisher is told, as over the link (§9.2): it stops serving this subscriber
            // and records why.
            try {
              Request r;
              r.refusal = step;
              r.seq = seq_;
              r.epoch = held_->epoch;
              r.version = held_->version;
              link_->keep({link_->post_send(core::bytes_tensor(encode(r)), Kind::kRequest)});
            } catch (...) {
              // the link is broken already: its peer learns it from the transport
            }
            throw;
          }
        }
        m.reading().store(0);  // being rewritten: wait for the change
      }
    }
    const auto now = Clock::now();
    if (now - m.looked >= kShmLook || now < deadline) {
      m.looked = now;
      TD_CHECK_AS(PeerLostError, m.publisher->alive(), who_, ": the publisher's process (pid ",
                  m.publisher->pid(), ") on ", link_->peer(), " exited");
    }
    if (now >= deadline) return std::nullopt;
    waited = true;
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    // Shown as `waiting` in the publisher's stats(), as a request held there is over a link.
    auto& waiting = L::word<uint64_t>(m.entry, L::kWaitingAt);
    waiting.store(1, std::memory_order_relaxed);
    shm::futex_wait(&changes, seen, std::min<std::chrono::microseconds>(left, kShmSlice));
    waiting.store(0, std::memory_order_relaxed);
  }
}

int64_t SubscriberCore::version() const { return held_->version; }
uint64_t SubscriberCore::epoch() const { return held_->epoch; }

std::shared_ptr<Leftover> SubscriberCore::release() {
  if (!pull_ && ended_.empty()) return nullptr;
  auto left = std::make_shared<Leftover>();
  left->held = *held_;
  left->pull = std::move(pull_);
  left->ended = std::move(ended_);
  return left;
}

void SubscriberCore::adopt(std::shared_ptr<Leftover> leftover) {
  if (!leftover) return;
  if (leftover->pull) {
    // The pull in flight is finished by the first pull here, against what was held then.
    *held_ = leftover->held;
    pull_ = std::move(leftover->pull);
    seq_ = pull_->seq;
  }
  ended_ = std::move(leftover->ended);
}

bool SubscriberCore::wait(const PendingPtr& p, Clock::time_point deadline) {
  return wait(*link_, p, deadline);
}

bool SubscriberCore::wait(Link& link, const PendingPtr& p, Clock::time_point deadline) {
  for (;;) {
    if (interrupted_.load()) return false;
    const auto end = std::min(deadline, Clock::now() + kSlice);
    if (link.wait(p, end)) return true;
    if (end >= deadline) return false;
  }
}

void SubscriberCore::end_pull(std::exception_ptr error) {
  const std::shared_ptr<Pull> o = std::move(pull_);
  // A relayed version's receives on its parent and sends to its children stay on their links.
  const auto leave_relay = [&] {
    if (o && o->relay) o->relay->leave();
  };
  try {
    std::rethrow_exception(error);
  } catch (const NoPublisherError&) {
    pull_ = o;  // nobody took the request: it stays queued for a publisher that starts
    throw;
  } catch (const MalformedPeerDataError& e) {
    // The publisher's bytes are refused: what it sent next cannot be trusted to fit what this
    // side would post, so the link ends here. The publisher is told (it stops serving this
    // subscriber and frees the slot it pinned); what was posted stays posted, its buffers
    // kept, so that nothing the publisher sent lands in memory used for anything else.
    leave_relay();
    if (ended_.empty()) {
      ended_ = c10::str(e.what_without_backtrace(),
                        ". This subscriber refused it and pulls no more from ", link_->peer());
    }
    if (o) {
      std::vector<PendingPtr> keep = o->posted();
      // Refused back, unless the publisher ended the link itself (Refusal::kNone).
      if (o->step != Refusal::kNone) {
        try {
          Request r;
          r.refusal = o->step;
          r.seq = o->seq;
          r.epoch = held_->epoch;
          r.version = held_->version;
          keep.push_back(link_->post_send(core::bytes_tensor(encode(r)), Kind::kRequest));
        } catch (...) {
          // the link is broken already: its peer learns it from the transport
        }
      }
      link_->keep(keep);
    }
    TD_THROW(MalformedPeerDataError, ended_);
  } catch (const PeerClosedError& e) {
    leave_relay();
    publisher_closed_ = true;
    TD_THROW(NoPublisherError, who_, ": the Publisher on ", link_->peer(), " closed (",
             e.what_without_backtrace(), ")");
  } catch (const PeerLostError& e) {
    leave_relay();
    // What was posted stays posted, its buffers kept: a transport may not fail at once the
    // receive whose bytes it was reading when the connection went (Gloo's).
    if (o) link_->keep(o->posted());
    // A lost request send may hide the publisher's clean close, already in the offer's
    // receive (a pipe's close marker).
    if (o && o->offer_received) {
      try {
        link_->wait(o->offer_received, Clock::now());
      } catch (const PeerClosedError& closed) {
        publisher_closed_ = true;
        TD_THROW(NoPublisherError, who_, ": the Publisher on ", link_->peer(), " closed (",
                 closed.what_without_backtrace(), ")");
      } catch (...) {
      }
    }
    TD_THROW(PeerLostError, who_,
             ": lost the connection to the publisher: ", e.what_without_backtrace());
  } catch (...) {
    pull_ = o;  // anything else leaves the pull as it was, for the next pull to go on with
    throw;
  }
}

void SubscriberCore::send_request(const PullOptions& options) {
  auto o = std::make_shared<Pull>();
  o->seq = ++seq_;
  Request r;
  r.seq = o->seq;
  r.epoch = held_->epoch;
  r.version = held_->version;
  r.min_version = options.min_version.value_or(0);
  r.wait_ms = options.timeout ? options.timeout->count() : -1;
  r.schema = held_->schema;
  r.shm = transport_ != Transport::kSocket && !declined_ && !mapped_;
  r.relay = static_cast<bool>(relay_links_);
  const SlotsPlace slots = relay_slots_ ? relay_slots_->place() : SlotsPlace{};
  if (r.relay && relayed_ && (!said_host_ || slots != said_slots_)) {
    // Before the first request after a relayed version (a publisher of ours that relays:
    // another peer would take it for a request), and again when its slots for its host are
    // new: this subscriber's host, and where those slots are. Not at every pull: the host is
    // read from /proc.
    Request hello;
    hello.host = test_host_ ? schema_hash(*test_host_) | 1 : shm::host_fingerprint();
    hello.host_slots = slots;
    if (hello.host != 0) {
      link_->keep({link_->post_send(core::bytes_tensor(encode(hello)), Kind::kRequest)});
    }
    said_host_ = true;
    said_slots_ = slots;
  }
  o->asked_shm = r.shm;
  o->wait_ms = r.wait_ms;
  // The offer's receive first: the publisher never waits on this subscriber to answer.
  o->offer_buffer = message_buffer();
  o->offer_received = link_->post_recv(o->offer_buffer, Kind::kOffer);
  o->request = core::bytes_tensor(encode(r));
  o->sent = Clock::now();
  pull_ = o;
  o->request_sent = link_->post_send(o->request, Kind::kRequest);
}

bool SubscriberCore::request_taken(Pull& o, Clock::time_point deadline,
                                   const PullOptions& options) {
  if (o.request_taken) return true;
  if (!wait(o.request_sent, deadline)) {
    // A publisher that took requests before is slow or stopped, not missing.
    if (interrupted_.load() || answered_) return false;
    const auto now = Clock::now();
    const auto waited = now - o.sent;
    const auto asked = options.timeout.value_or(std::chrono::milliseconds(0));
    const auto least = asked.count() > 0 ? asked : kPollPatience;
    // A request this pull sent has waited all of the pull once its deadline passed (the pull
    // began a moment before the request went).
    const bool whole_pull = asked.count() > 0 && now >= deadline && o.sent >= deadline - asked;
    TD_CHECK_AS(NoPublisherError, waited < least && !whole_pull, who_, ": ", link_->peer(),
                " has taken no request in ",
                std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
                " ms: ", link_->no_publisher(), ". The request stays queued for when one starts");
    return false;
  }
  o.request_taken = true;
  answered_ = true;
  return true;
}

SubscriberCore::OfferRead SubscriberCore::read_offer(Pull& o, Clock::time_point deadline) {
  if (o.offer) return OfferRead::kNew;
  if (!wait(o.offer_received, deadline)) return OfferRead::kWaiting;
  const Offer offer = decode_offer(who_.c_str(), o.offer_buffer.data_ptr<uint8_t>());
  TD_CHECK_PEER(offer.seq == o.seq, who_, ": the publisher's offer answers request ", offer.seq,
                ", not request ", o.seq, " (a message out of order)");
  switch (offer.status) {
    case Status::kNone: {
      // An honest publisher answers "none" once the request's wait has passed: sooner, a loop
      // of requests would spin.
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - o.sent);
      o.step = Refusal::kAnswer;
      TD_CHECK_PEER(
          o.wait_ms >= 0 && waited.count() >= o.wait_ms, who_, ": the publisher on ", link_->peer(),
          " answered \"none\" after ", waited.count(), " ms to a request that waits ",
          o.wait_ms < 0 ? std::string("until a version is published") : c10::str(o.wait_ms, " ms"));
      pull_.reset();
      return OfferRead::kNone;
    }
    case Status::kClosed: TD_THROW(PeerClosedError, "it answered \"closed\"");
    case Status::kRefused:
      // The publisher ended the link itself: nothing to refuse back.
      o.step = Refusal::kNone;
      ended_ = c10::str(who_, ": the Publisher on ", link_->peer(),
                        " refused this subscriber's request as malformed and serves it no more");
      TD_THROW(MalformedPeerDataError, ended_);
    case Status::kShm: {
      TD_CHECK_PEER(o.asked_shm, who_, ": the publisher on ", link_->peer(),
                    " offered shared memory to a request that did not ask for it");
      const uint64_t seq = o.seq;  // `o` is the pull, ended here
      pull_.reset();               // answered
      if (attach(offer)) return OfferRead::kShm;
      // Declined: the publisher serves the link from the next request on.
      declined_ = true;
      Request decline;
      decline.seq = seq;
      decline.decline = static_cast<uint32_t>(declined_for_);
      link_->keep({link_->post_send(core::bytes_tensor(encode(decline)), Kind::kRequest)});
      TORCH_CHECK(transport_ != Transport::kShm, who_, ": transport=\"shm\", but ",
                  transport_text_);
      return OfferRead::kNone;
    }
    case Status::kNew: break;
    case Status::kRelay:
      TD_CHECK_PEER(relay_links_, who_, ": the publisher on ", link_->peer(),
                    " relays a version to a request that did not offer to relay");
      o.relayed = true;
      relayed_ = true;
      break;
  }
  if (o.asked_shm) {
    // Asked for shared memory and sent the version instead: the publisher serves the link.
    transport_text_ = "socket (shared memory refused: the publisher offers none)";
    TORCH_CHECK(transport_ != Transport::kShm, who_, ": transport=\"shm\", but the publisher on ",
                link_->peer(),
                " offers no shared memory (its transport is \"socket\", or it could "
                "make none)");
  }
  o.step = offer.data_bytes > max_total_bytes_ ? Refusal::kStorage : Refusal::kOffer;
  const publication::Held check{o.seq,         held_->epoch,      held_->version,
                                held_->schema, held_->data_bytes, max_total_bytes_};
  check_offer(who_.c_str(), offer, check);
  o.offer = offer;
  // Nothing is allocated for a size before check_offer bounded it.
  if (offer.schema_bytes > 0) {
    o.schema = recv_buffer(offer.schema_bytes);
    o.schema_received = link_->post_recv(o.schema, Kind::kSchema);
  } else {
    o.metadata = held_->metadata;
  }
  const int64_t n = offer.data_bytes;
  // The stage, unless a pull into a new TensorDict took it (or it is too small).
  if (!stage_.defined() || stage_.numel() < n) stage_ = recv_buffer(std::max<int64_t>(n, 1));
  o.data = stage_.narrow(0, 0, n);
  if (o.relayed) {
    o.route = recv_buffer(max_route_bytes(n));
    o.route_received = link_->post_recv(o.route, Kind::kRoute);
  } else {
    o.data_received = link_->post_recv(o.data, Kind::kData);
  }
  return OfferRead::kNew;
}

bool SubscriberCore::read_version(Pull& o, Clock::time_point deadline) {
  if (o.schema_received && !o.schema_done) {
    if (!wait(o.schema_received, deadline)) return false;
    o.schema_done = true;
    o.step = Refusal::kSchema;
    const std::string_view text(reinterpret_cast<const char*>(o.schema.data_ptr<uint8_t>()),
                                static_cast<size_t>(o.schema.numel()));
    try {
      o.metadata =
          std::make_shared<core::ValidatedMetadata>(read_schema(who_.c_str(), *o.offer, text));
    } catch (const MalformedPeerDataError&) {
      throw;
    } catch (const c10::Error& e) {
      // The reader's ValueError names what it refused; a peer's schema it is all the same.
      TD_THROW(MalformedPeerDataError, who_,
               ": the version's schema is refused: ", e.what_without_backtrace());
    }
  }
  if (o.relayed) return read_route(o, deadline) && read_pieces(o, deadline);
  if (!o.data_done) {
    if (!wait(o.data_received, deadline)) return false;
    o.data_done = true;
    o.step = Refusal::kData;
    TD_CHECK_PEER(!link_->short_message(o.data_received), who_,
                  ": the version's data stopped short of the ", o.offer->data_bytes,
                  " bytes its offer announced");
  }
  return true;
}

std::shared_ptr<Link> SubscriberCore::relay_link(int64_t rank) {
  auto it = relays_.find(rank);
  if (it == relays_.end()) it = relays_.emplace(rank, relay_links_(rank)).first;
  return it->second;
}

bool SubscriberCore::read_route(Pull& o, Clock::time_point deadline) {
  if (o.relay) return true;
  if (!wait(o.route_received, deadline)) return false;
  const Offer& offer = *o.offer;
  o.step = Refusal::kOffer;
  TD_CHECK_PEER(!link_->short_message(o.route_received), who_,
                ": the publisher's route message stopped short of its ",
                max_route_bytes(offer.data_bytes), " bytes");
  o.route_received = nullptr;
  Route route = decode_route(who_.c_str(), o.route.data_ptr<uint8_t>(), offer);
  TD_CHECK_PEER(route.first == 0, who_, ": the publisher's route starts version ", offer.version,
                " at piece ", route.first, " (a version's first route starts at 0)");
  auto r = std::make_unique<RelayState>();
  TD_CHECK_PEER(!route.checksums.empty(), who_,
                ": the publisher's route carries no checksums (a relayed piece is checked by one)");
  TD_CHECK_PEER(route.split == 0 || route.host_parent.pid != 0 || route.parent >= 0 ||
                    route.second.parent >= 0,
                who_, ": the publisher's route sends both lanes from itself");
  r->pieces = piece_count(offer.data_bytes, route.piece_bytes);
  r->message_bytes = kPieceHeaderBytes + route.piece_bytes;
  const auto add_lane = [&](int64_t first, int64_t end, int64_t parent, int64_t siblings,
                            const std::vector<int64_t>& children) {
    auto l = std::make_unique<Lane>();
    l->index = static_cast<int>(r->lanes.size());
    l->next = first;
    l->end = end;
    l->parent = parent;
    l->siblings = route.split > 0 ? std::max<int64_t>(siblings, 2) : siblings;
    l->source = link_;
    if (parent >= 0 && route.host_parent.pid == 0) {
      try {
        l->source = relay_link(parent);
      } catch (const MalformedPeerDataError&) {
        throw;  // a rank that is no other subscriber: the route is refused
      } catch (const std::exception& e) {
        l->lost = e.what();  // the parent's connection is gone already: resumed at once
      }
    }
    for (const int64_t c : children) {
      Lane::Child child{c, nullptr, false};
      try {
        child.link = relay_link(c);
        child.alive = true;
      } catch (const MalformedPeerDataError&) {
        throw;
      } catch (const std::exception&) {
        // a child whose connection is gone: it resumes at the publisher by itself
      }
      l->children.push_back(std::move(child));
    }
    // The publisher's serving thread sends a lane from itself until every piece is taken.
    if (parent < 0) r->answering = l->index;
    l->progress = Clock::now();
    r->lanes.push_back(std::move(l));
  };
  if (route.split > 0) {
    add_lane(0, route.split, route.parent, route.siblings, route.children);
    add_lane(route.split, r->pieces, route.second.parent, route.second.siblings,
             route.second.children);
  } else {
    add_lane(0, r->pieces, route.parent, route.siblings, route.children);
  }
  if (route.host_source) {
    try {
      if (!relay_slots_ || relay_slots_->epoch() != offer.epoch) {
        relay_slots_ = std::make_unique<RelaySlots>(offer.epoch);
      }
      // Pieces that come while no slot is free go nowhere: the readers leave for the publisher.
      relay_slots_->begin(offer.version, offer.schema, offer.data_bytes, route.piece_bytes,
                          route.split);
      r->slots = relay_slots_.get();
    } catch (const std::exception&) {
      relay_slots_.reset();  // no shared memory: its host's subscribers stay on the chain
    }
  }
  if (route.host_parent.pid != 0) {
    std::string why;
    if (!host_reader_ || host_reader_->place != route.host_parent) {
      host_reader_ = open_host(route.host_parent, &why);
    }
    r->host = host_reader_;
    if (!r->host) r->unmapped = c10::str("could not map its slots: ", why);
  }
  r->route = std::move(route);
  r->host_progress = Clock::now();
  r->lanes[0]->free = std::move(piece_pool_);
  piece_pool_.clear();
  o.relay = std::move(r);
  return true;
}

namespace {

// Forwarded pieces every child has taken: their buffers are posted again. A child whose send
// failed is forwarded nothing more (its own resume finds the publisher). A link takes its sends
// in the order they were posted: once one is not taken, the later ones on that link are not
// looked at (a look at a Gloo send that is not taken costs an abort of its wait).
void recycle(Lane& l) {
  std::vector<Link*> behind;  // links whose oldest send in flight is not taken yet
  const auto taken = [&](const std::pair<Link*, PendingPtr>& s) {
    if (std::find(behind.begin(), behind.end(), s.first) != behind.end()) return false;
    try {
      if (s.first->wait(s.second, Clock::now())) return true;
      behind.push_back(s.first);
      return false;
    } catch (const std::exception&) {
      for (auto& c : l.children) {
        if (c.link.get() == s.first) c.alive = false;
      }
      return true;
    }
  };
  for (auto it = l.sending.begin(); it != l.sending.end();) {
    auto& sends = it->sends;
    sends.erase(std::remove_if(sends.begin(), sends.end(), taken), sends.end());
    if (sends.empty()) {
      if (it->pooled) l.free.push_back(it->buffer);
      it = l.sending.erase(it);
    } else {
      ++it;
    }
  }
}

at::Tensor piece_buffer(Lane& l) {
  at::Tensor b;
  if (l.free.empty()) {
    // Every piece buffer fits the largest piece, with room: a receive kept posted on a link
    // takes whatever that peer sends there next, of any route's piece size, and the receive
    // that takes it over (GroupLink) is of the same size.
    b = piece_recv_buffer();
  } else {
    b = std::move(l.free.back());
    l.free.pop_back();
  }
  return b;
}

// The most pieces not yet taken by one child (its sends still in flight).
int64_t queued_to_children(const Lane& l) {
  int64_t most = 0;
  for (const auto& c : l.children) {
    if (!c.link) continue;
    int64_t n = 0;
    for (const auto& s : l.sending) {
      for (const auto& [link, pending] : s.sends) n += link == c.link.get() ? 1 : 0;
    }
    most = std::max(most, n);
  }
  return most;
}

// Forwards the first `bytes` of `buffer` (a piece or a hold) to every live child. A piece
// buffer goes back to the pool whole: a later route's pieces may be larger.
void forward(Lane& l, const at::Tensor& buffer, int64_t bytes, bool pooled) {
  const at::Tensor message = buffer.narrow(0, 0, bytes);
  Lane::Sending sending{buffer, {}, pooled};
  for (auto& c : l.children) {
    if (!c.alive || !c.link) continue;
    try {
      sending.sends.emplace_back(c.link.get(), c.link->post_send(message, piece_kind(l.index)));
    } catch (const std::exception&) {
      c.alive = false;
    }
  }
  if (!sending.sends.empty()) {
    l.sending.push_back(std::move(sending));
  } else if (pooled) {
    l.free.push_back(buffer);
  }
}

// A parent that sends no piece in this long stalls: max(kMinStall, kStallPieces piece times).
Clock::duration stall_bound(const Route& route) {
  const double piece_s =
      route.rate > 0 ? static_cast<double>(route.piece_bytes) / static_cast<double>(route.rate)
                     : 0.0;
  return std::max<Clock::duration>(kMinStall,
                                   std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(kStallPieces * piece_s)));
}

// Tells the lane's children to wait: this relay waits for the publisher's pieces (§9.9).
void send_hold(Lane& l, RelaySlots* slots, const Offer& offer) {
  l.held = Clock::now();
  if (slots) slots->progress();  // its host's readers wait with it too
  at::Tensor hold = at::empty({kPieceHeaderBytes}, at::kByte);
  encode_piece_header({offer.epoch, offer.version, l.next, 0, 0, true}, hold.data_ptr<uint8_t>());
  forward(l, hold, kPieceHeaderBytes, false);
}

}  // namespace

bool SubscriberCore::read_pieces(Pull& o, Clock::time_point deadline) {
  RelayState& r = *o.relay;
  if (!r.unmapped.empty()) {
    // Not the relay's fault: it is not left as one that failed.
    const std::string why = std::exchange(r.unmapped, std::string());
    for (auto& l : r.lanes) {
      if (!l->done()) resume(o, *l, Resume::kLost, why, false);
    }
  }
  if (r.host && !read_host(o, deadline)) return false;
  std::vector<Lane*> due;
  for (auto& l : r.lanes) {
    if (!l->done()) due.push_back(l.get());
  }
  // Each lane's pieces as they come: a lane of its own on a thread of its own while both run.
  std::exception_ptr failed;
  bool in = true;
  const auto run = [&](Lane& l) {
    try {
      return read_lane(o, l, deadline);
    } catch (...) {
      r.stop = true;  // the other lane ends its turn too
      std::lock_guard<std::mutex> lock(r.mutex);
      if (!failed) failed = std::current_exception();
      return false;
    }
  };
  if (due.size() == 2) {
    bool second = false;
    std::thread t([&] { second = run(*due[1]); });
    in = run(*due[0]);
    t.join();
    in = in && second;
  } else if (due.size() == 1) {
    in = run(*due[0]);
  }
  r.stop = false;
  if (failed) std::rethrow_exception(failed);
  if (r.abandoned.load()) {
    r.leave();
    o.abandoned = true;
    return false;
  }
  if (!in) return false;
  for (auto& l : r.lanes) {
    for (auto& b : l->free) {
      if (piece_pool_.size() < kPiecesAhead) piece_pool_.push_back(std::move(b));
    }
    l->free.clear();
  }
  if (r.slots) r.slots->finish();
  o.data_done = true;
  return true;
}

bool SubscriberCore::wait_lane(RelayState& r, Link& link, const PendingPtr& p,
                               Clock::time_point deadline) {
  for (;;) {
    if (r.stop.load() || r.abandoned.load()) return false;
    const auto end = std::min(deadline, Clock::now() + kSlice);
    if (wait(link, p, end)) return true;
    if (end >= deadline || interrupted_.load()) return false;
  }
}

bool SubscriberCore::read_lane(Pull& o, Lane& l, Clock::time_point deadline) {
  RelayState& r = *o.relay;
  const Offer& offer = *o.offer;
  const int64_t piece = r.route.piece_bytes;
  uint8_t* stage = static_cast<uint8_t*>(o.data.data_ptr());
  for (;;) {
    recycle(l);
    if (r.stop.load() || r.abandoned.load()) return false;
    if (l.wanted) {
      // The publisher still answers the other lane: this one waits, holding its children.
      std::this_thread::sleep_until(std::min(deadline, Clock::now() + kPausedLook));
      if (r.abandoned.load() || r.stop.load() || interrupted_.load()) return false;
      if (Clock::now() >= deadline) return false;
      if (!ask(o, l) && Clock::now() >= l.held + kMinStall / 2) send_hold(l, r.slots, offer);
      continue;
    }
    if (l.resuming) {
      // The children hear every half stall bound that this relay waits, not left.
      const auto until = std::min(deadline, Clock::now() + kMinStall / 2);
      if (read_resume(o, l, until)) continue;
      if (r.abandoned.load() || r.stop.load() || Clock::now() >= deadline || interrupted_.load())
        return false;
      send_hold(l, r.slots, offer);
      continue;
    }
    if (l.done()) {
      {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (r.answering == l.index) r.answering = -1;  // every piece of its answer taken
      }
      l.leave();  // the sends still on their way to the children
      return true;
    }
    const bool from_parent = l.parent >= 0;
    // Receives of the largest piece: a receive left posted on a link (a relay left) takes a
    // later route's piece whatever its size; a short piece is told by its header and checksum.
    try {
      if (!l.lost.empty()) TD_THROW(PeerLostError, l.lost);
      while (l.posted.size() < kPiecesAhead &&
             l.next + static_cast<int64_t>(l.posted.size()) < l.end) {
        const at::Tensor b = piece_buffer(l);
        l.posted.push_back({b, l.source->post_recv(b, piece_kind(l.index))});
      }
    } catch (const std::exception& e) {
      if (!from_parent) throw;
      l.lost.clear();
      resume(o, l, Resume::kLost, e.what());
      continue;
    }
    auto until = deadline;
    Clock::duration bound{};
    if (from_parent) {
      bound = stall_bound(r.route) + (l.stalled ? kHoldGrace : Clock::duration{});
      until = std::min(deadline, l.progress + bound);
    }
    const Lane::Posted front = l.posted.front();
    bool in = false;
    try {
      in = wait_lane(r, *l.source, front.pending, until);
    } catch (const PeerLostError& e) {
      if (!from_parent) throw;
      resume(o, l, Resume::kLost, e.what_without_backtrace());
      continue;
    } catch (const MalformedPeerDataError& e) {
      if (!from_parent) throw;
      resume(o, l, Resume::kForged, e.what_without_backtrace());
      continue;
    }
    if (!in) {
      const auto now = Clock::now();
      if (from_parent && !interrupted_.load() && !r.stop.load() && now < deadline &&
          now > until + kOverslept) {
        l.progress = now;  // this process did not run (stopped, starved): not the parent's pause
        continue;
      }
      if (from_parent && !interrupted_.load() && !r.stop.load() && now >= l.progress + bound) {
        if (!l.stalled) {
          l.stalled = true;  // the children wait with this relay; the parent has a grace
          send_hold(l, r.slots, offer);
          continue;
        }
        resume(
            o, l, Resume::kStalled,
            c10::str("no piece in ",
                     std::chrono::duration_cast<std::chrono::milliseconds>(bound).count(), " ms"));
        continue;
      }
      return false;
    }
    l.posted.pop_front();
    uint8_t* m = front.buffer.data_ptr<uint8_t>();
    const int64_t index = l.next;
    const int64_t want = std::min(piece, offer.data_bytes - index * piece);
    const std::optional<PieceHeader> h = decode_piece_header(m);
    std::string bad;
    if (h && h->epoch == offer.epoch && h->version < offer.version) {
      // A piece of an earlier version, left in a receive kept posted on this link: dropped.
      l.free.push_back(front.buffer);
      continue;
    }
    if (h && h->hold && h->epoch == offer.epoch && h->version == offer.version) {
      // The parent waits for the publisher's pieces: so do this relay and its children.
      l.free.push_back(front.buffer);
      l.progress = Clock::now();
      l.arrivals.clear();
      l.stalled = false;
      send_hold(l, r.slots, offer);
      continue;
    }
    if (!h || h->hold) {
      bad = "a message that is not a piece of this version";
    } else if (h->epoch != offer.epoch || h->version != offer.version || h->index != index ||
               h->bytes != want) {
      bad = c10::str("piece ", h->index, " of version ", h->version, " of epoch ", h->epoch, " (",
                     h->bytes, " bytes) where piece ", index, " of version ", offer.version,
                     " of epoch ", offer.epoch, " (", want, " bytes) was due");
    }
    uint8_t* const to = stage + index * piece;
    // A test hook: a relay that forwards what its stage held before (the previous version's
    // bytes, when it held one of this size) as this version's piece, or writes it into its slots
    // (kSlots: only there).
    std::vector<uint8_t> before;
    if (bad.empty() && stale_relay_ != Stale::kNone) before.assign(to, to + want);
    // Checked as it is copied into the stage (one pass, from this relay's own receive buffer);
    // a forged piece's bytes there are overwritten by the resume's.
    if (bad.empty() && copy_piece_checksum(to, m + kPieceHeaderBytes, static_cast<size_t>(want)) !=
                           r.route.checksums[static_cast<size_t>(index)]) {
      bad = c10::str("piece ", index, " of version ", offer.version,
                     " whose bytes do not match the checksum the publisher sent");
    }
    if (!bad.empty()) {
      if (from_parent) {
        resume(o, l, Resume::kForged, bad);
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(r.mutex);
        o.step = Refusal::kData;
      }
      TD_THROW(MalformedPeerDataError, who_, ": the publisher on ", link_->peer(), " sent ", bad);
    }
    const uint8_t* kept = m + kPieceHeaderBytes;
    if (stale_relay_ != Stale::kNone && want > 0) {
      if (stale_relay_ == Stale::kPieces)
        std::memcpy(m + kPieceHeaderBytes, before.data(), before.size());
      kept = before.data();
    }
    if (r.slots) r.slots->piece(index, kept, want);
    l.queued = h->queued;
    // What this relay queues for its children travels with the piece (PieceHeader::queued).
    if (!l.children.empty()) {
      encode_piece_header({h->epoch, h->version, h->index, h->bytes, queued_to_children(l), false},
                          m);
    }
    forward(l, front.buffer, r.message_bytes, true);
    const auto now = Clock::now();
    l.progress = now;
    l.stalled = false;
    ++l.next;
    // The last pieces from the source, over at least kSlowPieces pieces and kMinStall (a lane
    // of two: twice that, as its rate is judged against the other lane's, whose own pauses
    // count too): a shorter window sees a paced link's bursts and a loaded machine's pauses.
    const auto span = r.lanes.size() == 2 ? 2 * kMinStall : kMinStall;
    l.arrivals.emplace_back(now, l.queued);
    while (l.arrivals.size() > static_cast<size_t>(kSlowPieces) + 1 &&
           now - l.arrivals[1].first >= span) {
      l.arrivals.pop_front();
    }
    // A crawling parent: its pieces come slowly while it queues them (its own link is slow),
    // not because its own parent is slow.
    const auto window = now - l.arrivals.front().first;
    if (window < span || l.arrivals.size() <= static_cast<size_t>(kSlowPieces)) continue;
    const double secs = std::chrono::duration<double>(window).count();
    const auto over = static_cast<int64_t>(l.arrivals.size()) - 1;
    const double rate = static_cast<double>(over * piece) / secs;
    r.rates[l.index] = rate;
    if (!from_parent || r.route.rate <= 0 || l.queued < kQueuedSlow || l.done()) continue;
    // Against its link's share (shared by its children); a lane of two against the other
    // lane's pieces, which come from the same publisher at about the same share and through as
    // many relays, and only while the parent's queue grows, by a quarter of what it handed on
    // or more: then its own link holds them back, not its input (the publisher's two lanes'
    // flows share its link unevenly at times, which a relay passes on without queueing).
    const double other = r.lanes.size() == 2 ? r.rates[1 - l.index].load() : 0.0;
    const auto grew = static_cast<double>(l.queued - l.arrivals.front().second);
    const bool slow =
        other > 0 ? rate < kSlowerLane * other && grew >= kQueuedSlow &&
                        grew * 4 >= static_cast<double>(over)
                  : rate * 3 * static_cast<double>(l.siblings) < static_cast<double>(r.route.rate);
    if (slow) {
      resume(o, l, Resume::kSlow,
             c10::str(std::llround(rate / 1e6), " MB/s over ", over, " pieces in ",
                      std::llround(secs * 1000), " ms, ", l.queued, " queued there (",
                      l.arrivals.front().second, " before); ",
                      other > 0 ? c10::str("the other lane's came at ", std::llround(other / 1e6),
                                           " MB/s")
                                : c10::str("the route announced ", r.route.rate / 1000000,
                                           " MB/s shared by ", l.siblings)));
    }
  }
}

bool SubscriberCore::read_host(Pull& o, Clock::time_point deadline) {
  RelayState& r = *o.relay;
  const Offer& offer = *o.offer;
  HostReader& h = *r.host;
  const uint8_t* head = h.slots->data();
  const auto& changes = L::word<uint32_t>(head, L::kChangesAt);
  const int64_t piece = r.route.piece_bytes;
  const auto version = static_cast<uint64_t>(offer.version);
  // With the grace a relay's children give a hold: the relay itself leaves a stalled parent
  // within the bound, holding them meanwhile (its progress word moves then).
  const Clock::duration bound = stall_bound(r.route) + kHoldGrace;
  auto& reading = L::word<uint64_t>(h.entry, L::kReadingAt);
  auto* stage = static_cast<uint8_t*>(o.data.data_ptr());
  // Leaves the relay: each lane not in yet resumes at the publisher from the piece it reached.
  const auto leave = [&](Resume why, const std::string& detail, bool blame) {
    h.unpin();
    r.host.reset();
    r.host_slot = -1;
    for (auto& l : r.lanes) {
      if (!l->done()) resume(o, *l, why, detail, blame);
    }
    return true;
  };
  auto last = Clock::now();
  for (;;) {
    if (interrupted_.load()) return false;
    const uint32_t seen = changes.load();
    if (L::word<uint32_t>(head, L::kFlagsAt).load() & (L::kClosed | L::kMoved)) {
      // Its Subscriber went, or its slots grew: the next route names the new ones.
      return leave(Resume::kLost, "its slots were closed or moved", false);
    }
    const auto now = Clock::now();
    // This process did not run (stopped, starved): its own pause is not the relay's.
    if (now - last > kShmLook + kOverslept) r.host_progress = now;
    last = now;
    const uint64_t progress = L::word<uint64_t>(head, L::kProgressAt).load();
    if (progress != h.progress) {
      h.progress = progress;
      r.host_progress = now;
    }
    // The version's slot, written or being filled: pinned, then its state looked at again
    // (§9.8); the relay never starts another version there while it is pinned.
    for (uint32_t i = 0; i < h.layout.slots && r.host_slot < 0; ++i) {
      const auto& state = L::word<uint64_t>(h.record(i), L::kStateAt);
      const auto holds = [&] {
        const uint64_t st = state.load();
        return st == version || st == (L::kFilling | version);
      };
      if (!holds()) continue;
      reading.store(L::pin_of(i, offer.version));
      if (!holds()) {
        reading.store(0);
        continue;
      }
      const uint64_t bytes = L::word<uint64_t>(h.record(i), L::kSlotBytesAt).load();
      if (bytes != static_cast<uint64_t>(offer.data_bytes) || bytes > h.layout.data_cap) {
        return leave(Resume::kForged,
                     c10::str("its slot holds ", bytes, " bytes of version ", offer.version,
                              ", not ", offer.data_bytes),
                     true);
      }
      r.host_slot = static_cast<int>(i);
    }
    if (r.host_slot >= 0) {
      const auto slot = static_cast<uint32_t>(r.host_slot);
      const bool whole = L::word<uint64_t>(h.record(slot), L::kStateAt).load() == version;
      bool all = true;
      for (auto& l : r.lanes) {
        const size_t at = l->index == 0 ? L::kFilledAt : L::kFilled2At;
        const int64_t filled =
            whole ? l->end
                  : std::min<int64_t>(
                        l->end, static_cast<int64_t>(L::word<uint64_t>(h.record(slot), at).load()));
        // Each piece copied into this subscriber's buffer, then checked there: what it keeps is
        // what it checked.
        for (; l->next < filled; ++l->next) {
          const int64_t n = std::min(piece, offer.data_bytes - l->next * piece);
          uint8_t* to = stage + l->next * piece;
          std::memcpy(to, h.data(slot) + l->next * piece, static_cast<size_t>(n));
          if (piece_checksum(to, static_cast<size_t>(n)) !=
              r.route.checksums[static_cast<size_t>(l->next)]) {
            return leave(Resume::kForged,
                         c10::str("piece ", l->next, " of version ", offer.version,
                                  " in its slots does not match the checksum the publisher sent"),
                         true);
          }
          r.host_progress = Clock::now();
        }
        all = all && l->done();
      }
      if (all) {
        h.unpin();
        r.host_slot = -1;
        return true;
      }
    }
    if (now - h.looked >= kShmLook) {
      h.looked = now;
      if (!h.relay->alive()) {
        return leave(Resume::kLost, c10::str("its process (pid ", h.relay->pid(), ") exited"),
                     true);
      }
    }
    if (now >= r.host_progress + bound) {
      return leave(
          Resume::kStalled,
          c10::str("no progress in ",
                   std::chrono::duration_cast<std::chrono::milliseconds>(bound).count(), " ms"),
          true);
    }
    if (now >= deadline) return false;
    const auto until = std::min({deadline, r.host_progress + bound, now + kShmLook});
    shm::futex_wait(&changes, seen,
                    std::chrono::duration_cast<std::chrono::microseconds>(until - now));
  }
}

void SubscriberCore::resume(Pull& o, Lane& l, Resume why, const std::string& detail, bool blame) {
  RelayState& r = *o.relay;
  const Offer& offer = *o.offer;
  l.leave_source();
  l.stalled = false;
  if (blame) {
    std::lock_guard<std::mutex> lock(r.mutex);
    routed_around_.push_back(c10::str("rank ", l.parent, " at piece ", l.next, " of ", r.pieces,
                                      " of version ", offer.version, ": ",
                                      resume_text(static_cast<uint32_t>(why)), " (", detail, ")"));
    if (routed_around_.size() > 16) routed_around_.erase(routed_around_.begin());
  }
  l.wanted = Lane::Wanted{why, blame ? l.parent : -1};
  ask(o, l);
  send_hold(l, r.slots, offer);
}

bool SubscriberCore::ask(Pull& o, Lane& l) {
  RelayState& r = *o.relay;
  const Offer& offer = *o.offer;
  std::lock_guard<std::mutex> lock(r.mutex);
  // The publisher answers the other lane: this one asks once that answer is taken.
  if (r.answering < 0 || r.answering == l.index) {
    r.answering = l.index;
    Request q;
    q.resume = static_cast<uint32_t>(l.wanted->why);
    q.seq = ++seq_;
    q.epoch = offer.epoch;
    q.version = offer.version;
    q.piece = l.next;
    q.around = l.wanted->around;
    l.resume_seq = q.seq;
    l.resume_offer = message_buffer();
    l.resume_offer_received = link_->post_recv(l.resume_offer, Kind::kOffer);
    l.resume_request = core::bytes_tensor(encode(q));
    l.resume_sent = link_->post_send(l.resume_request, Kind::kRequest);
    l.wanted.reset();
    l.resuming = true;
    l.resume_offered = false;
    return true;
  }
  return false;
}

bool SubscriberCore::read_resume(Pull& o, Lane& l, Clock::time_point deadline) {
  RelayState& r = *o.relay;
  const Offer& offer = *o.offer;
  if (!l.resume_offered) {
    if (!wait_lane(r, *link_, l.resume_offer_received, deadline)) return false;
    const Offer a = decode_offer(who_.c_str(), l.resume_offer.data_ptr<uint8_t>());
    l.resume_offer_received = nullptr;
    l.resume_sent = nullptr;  // taken: the offer answers it
    TD_CHECK_PEER(a.seq == l.resume_seq, who_, ": the publisher's offer answers request ", a.seq,
                  ", not the resume ", l.resume_seq, " (a message out of order)");
    switch (a.status) {
      case Status::kClosed: TD_THROW(PeerClosedError, "it answered \"closed\" to a resume");
      case Status::kNone:
        // The version left the publisher's slots: the pull asks for the newest.
        r.abandoned = true;
        return false;
      case Status::kRefused: {
        std::lock_guard<std::mutex> lock(r.mutex);
        o.step = Refusal::kNone;
        ended_ = c10::str(who_, ": the Publisher on ", link_->peer(),
                          " refused this subscriber's resume as malformed and serves it no more");
        TD_THROW(MalformedPeerDataError, ended_);
      }
      case Status::kRelay: break;
      default:
        TD_THROW(MalformedPeerDataError, who_, ": the publisher answered a resume with status ",
                 static_cast<uint32_t>(a.status), " (\"relay\", \"none\" or \"closed\")");
    }
    TD_CHECK_PEER(a.epoch == offer.epoch && a.version == offer.version &&
                      a.data_bytes == offer.data_bytes && a.schema == offer.schema &&
                      a.schema_bytes == 0,
                  who_, ": the publisher resumes version ", a.version, " of epoch ", a.epoch, " (",
                  a.data_bytes, " bytes, a schema of ", a.schema_bytes,
                  " bytes) where it relayed version ", offer.version, " of epoch ", offer.epoch,
                  " (", offer.data_bytes, " bytes, the schema held)");
    l.resume_offered = true;
    l.resume_route = recv_buffer(max_route_bytes(offer.data_bytes));
    l.resume_route_received = link_->post_recv(l.resume_route, Kind::kRoute);
  }
  if (!wait_lane(r, *link_, l.resume_route_received, deadline)) return false;
  TD_CHECK_PEER(!link_->short_message(l.resume_route_received), who_,
                ": the publisher's route message stopped short of its ",
                max_route_bytes(offer.data_bytes), " bytes");
  l.resume_route_received = nullptr;
  Offer answered = offer;
  answered.seq = l.resume_seq;
  const Route route = decode_route(who_.c_str(), l.resume_route.data_ptr<uint8_t>(), answered);
  TD_CHECK_PEER(
      route.parent == -1 && route.first == l.next && route.split == r.route.split &&
          route.piece_bytes == r.route.piece_bytes && route.checksums == r.route.checksums,
      who_, ": the publisher resumes from rank ", route.parent, " at piece ", route.first,
      " in pieces of ", route.piece_bytes, " (lanes split at ", route.split,
      "); this subscriber asked for piece ", l.next, " from the publisher (-1) in pieces of ",
      r.route.piece_bytes, " (split at ", r.route.split, "), the checksums unchanged");
  l.resuming = false;
  l.parent = -1;
  r.route.rate = route.rate;
  l.source = link_;
  l.progress = Clock::now();
  l.arrivals.clear();
  l.queued = 0;
  return true;
}

bool SubscriberCore::advance(Clock::time_point deadline, const PullOptions& options) {
  for (;;) {
    if (!pull_) send_request(options);
    Pull& o = *pull_;
    if (!request_taken(o, deadline, options)) return false;
    switch (read_offer(o, deadline)) {
      case OfferRead::kWaiting: return false;
      case OfferRead::kShm: return false;  // mapped: pull_with pulls there
      case OfferRead::kNone:               // nothing newer within the request's wait: ask again
        if (Clock::now() >= deadline || interrupted_.load()) return false;
        continue;
      case OfferRead::kNew:
        if (read_version(o, deadline)) return true;
        if (!o.abandoned) return false;  // the deadline or an interrupt
        pull_.reset();                   // a relayed version given up: ask again
        if (Clock::now() >= deadline || interrupted_.load()) return false;
        continue;
    }
  }
}

// Pulls until a version of at least min_version is in, or the deadline passes: apply(v) puts
// each version where it goes (it may throw, the version then not held) and makes the result.
// Over shared memory the version is read where it lies, pinned while apply runs; a zero-copy
// pull keeps the pin (the TensorDict views the slot) until the next version or release_pin().
template <typename Apply>
auto SubscriberCore::pull_with(const PullOptions& options, Apply&& apply)
    -> std::optional<std::invoke_result_t<Apply&, const Version&>> {
  check_pull(options);
  TD_CHECK_AS(MalformedPeerDataError, ended_.empty(), ended_);
  TORCH_CHECK(transport_ != Transport::kShm || !declined_, who_, ": transport=\"shm\", but ",
              transport_text_);
  const auto start = Clock::now();
  const auto deadline = options.timeout ? start + *options.timeout : Clock::time_point::max();
  for (;;) {
    if (mapped_ && !pull_) {
      std::optional<Version> v = shm_next(deadline, options);
      if (!v) {
        if (mapped_ || Clock::now() >= deadline || interrupted_.load()) return std::nullopt;
        continue;  // moved: ask the link for the new segment
      }
      Mapped& m = *mapped_;
      try {
        auto result = apply(*v);
        const uint64_t pin = m.reading().load();
        if (options.zero_copy) m.held().store(pin);
        m.reading().store(0);
        *held_ = Held{v->epoch, v->version, v->schema, v->data.numel(), v->metadata};
        L::word<uint64_t>(m.entry, L::kEntryVersionAt)
            .store(static_cast<uint64_t>(v->version), std::memory_order_relaxed);
        L::word<uint64_t>(m.entry, L::kPullsAt).store(++m.pulls, std::memory_order_relaxed);
        return result;
      } catch (...) {
        m.reading().store(0);
        throw;
      }
    }
    bool in = false;
    try {
      in = advance(deadline, options);
    } catch (...) {
      end_pull(std::current_exception());
    }
    if (!in) {
      if (mapped_ && !pull_ && Clock::now() < deadline && !interrupted_.load()) continue;
      if (mapped_ && !pull_ && options.timeout && options.timeout->count() == 0) continue;
      return std::nullopt;
    }
    const std::shared_ptr<Pull> o = std::move(pull_);
    const Offer& offer = *o->offer;
    auto result = apply(Version{o->metadata, o->data, offer.epoch, offer.version, offer.schema});
    *held_ = Held{offer.epoch, offer.version, offer.schema, offer.data_bytes, o->metadata};
    if (offer.version >= options.min_version.value_or(0)) return result;
    if (Clock::now() >= deadline || interrupted_.load()) return std::nullopt;
  }
}

std::optional<int64_t> SubscriberCore::pull(TensorDict& td, const PullOptions& options) {
  return pull_with(options, [&](const Version& v) {
    const auto& metadata = *v.metadata;
    const Leaves* views = nullptr;
    if (v.slot >= 0) {
      views = &mapped_->views[v.slot].leaves;
    } else {
      // The version's leaves as views of the data, made once per schema and stage.
      if (stage_views_for_ != v.data.data_ptr() || stage_views_schema_ != v.schema) {
        stage_views_ = leaves_in_order(core::rebuild_validated(metadata, v.data));
        stage_views_for_ = v.data.data_ptr();
        stage_views_schema_ = v.schema;
      }
      views = &stage_views_;
    }
    const Leaves target = leaves_in_order(td);
    check_same_leaves(who_, target, *views);
    {
      at::NoGradGuard no_grad;  // a module's Parameters are written in place
      if (v.slot >= 0 && options.zero_copy) {
        // The same tensors, now views of the slot (read-only memory).
        for (size_t i = 0; i < target.size(); ++i) {
          const at::Tensor& from = (*views)[i].second;
          at::Tensor to = target[i].second;
          to.set_(from.storage(), from.storage_offset(), from.sizes(), from.strides());
        }
      } else {
        for (size_t i = 0; i < target.size(); ++i) {
          at::Tensor to = target[i].second;
          // A leaf a zero-copy pull left viewing a slot gets memory of its own again: the
          // slot's is read-only.
          if (mapped_ && to.numel() > 0 && mapped_->within(to.data_ptr()))
            to.set_(at::empty_like(to));
          to.copy_((*views)[i].second);
        }
      }
    }
    if (has_non_tensors(metadata.metadata())) {
      copy_non_tensors(core::rebuild_validated(metadata, v.data), td);
    }
    return v.version;
  });
}

std::optional<Pulled> SubscriberCore::pull(const PullOptions& options) {
  return pull_with(options, [&](const Version& v) {
    if (v.slot >= 0) {
      // Zero-copy: the leaves view the slot; otherwise a storage of its own, one copy.
      const at::Tensor data = options.zero_copy ? v.data : v.data.clone();
      return Pulled{core::rebuild_validated(*v.metadata, data), v.version,
                    tensorclass_of(*v.metadata)};
    }
    // The new TensorDict keeps the stage as its storage; the next pull makes another.
    Pulled pulled{core::rebuild_validated(*v.metadata, v.data), v.version,
                  tensorclass_of(*v.metadata)};
    stage_ = at::Tensor();
    stage_views_for_ = nullptr;
    return pulled;
  });
}

}  // namespace tensordict::wire::publication
