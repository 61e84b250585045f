#pragma once
// The publisher's end of publication (docs/publication.md, docs/wire-format.md §9.4), whatever
// carries its messages: the slots, the versions, and the answer to each subscriber's requests
// over its Link. The transports own the threads (one per subscriber) and the links:
// tensordict::dist::Publisher over a c10d group, tensordict::pipe::Publisher over a server's
// pipes.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/consolidate.h"
#include "tensordict/publication.h"
#include "tensordict/tensor_dict.h"
#include "wire/publication_link.h"

namespace tensordict::wire::publication {

/// Thread-safe. publish() copies a version into one of the slots; serve() answers one
/// subscriber's requests on the calling thread, pinning the slot it sends from until the
/// subscriber has taken it, so a publish never overwrites what a subscriber receives.
class PublisherCore {
 public:
  /// One subscriber, as add() registers it.
  struct Subscription;

  /// `max_slots` >= 1 (checked by the caller, whose argument it is). With a `transport` other
  /// than kSocket the slots live in shared memory (docs/wire-format.md §9.8) from the first
  /// publish, and subscribers that ask for it (on this host) pull there; kShm raises here when
  /// no segment can be made, kAuto then serves every subscriber over its link.
  /// With `routing` kChain, subscribers that offer to relay and wait for the same version get it
  /// in pieces along a chain of them (§9.9): one copy leaves this process.
  explicit PublisherCore(int64_t max_slots, Transport transport = Transport::kSocket,
                         Routing routing = Routing::kStar);
  ~PublisherCore();
  PublisherCore(const PublisherCore&) = delete;
  PublisherCore& operator=(const PublisherCore&) = delete;

  /// Publisher::publish (both transports): copies `td` into a slot nobody pins, the oldest
  /// first, and makes it the newest version, whose number it returns. Waits only while every
  /// slot is pinned, at most `timeout`, then TimeoutError naming the subscribers that pin them.
  int64_t publish(const TensorDict& td, std::optional<std::chrono::milliseconds> timeout,
                  const std::optional<std::string>& tensorclass_type);

  /// Registers a subscriber; `stats` names it (rank, peer). Alive as long as the core, unless
  /// it is lost and out of serve(): the oldest such are dropped beyond 64.
  Subscription& add(SubscriberStats stats);
  /// Answers `s`'s requests over `link` until close(), a lost or closed connection, a refusal
  /// of what it was sent, or a request that is not one (then answered "refused"), each recorded
  /// in its stats. Looks at the subscriber while it waits for a version, so that one that
  /// leaves costs no thread beyond a slice. Leaves what is still posted to the link when it
  /// returns (Link::keep): a later core serving the same link takes the next request. Never
  /// throws.
  void serve(Subscription& s, Link& link);
  /// Records `s` as lost, with `error` as its reason (kept if one is already recorded).
  void lose(Subscription& s, const std::string& error);

  uint64_t epoch() const { return epoch_; }
  int64_t version() const;
  /// One entry per subscriber, in the order they were added.
  std::vector<SubscriberStats> stats() const;
  /// Publisher::wait_for_subscribers (both transports): waits until `count` subscribers have
  /// sent a request or were lost (unset: every subscriber added), at most `timeout`; then
  /// TimeoutError: "<call>: " and the subscribers that have not asked, then `hint` (who they
  /// may be).
  void wait_for_subscribers(const char* call, std::chrono::milliseconds timeout,
                            std::optional<size_t> count, const std::string& hint) const;
  /// Serving stops: pulls waiting for a version get "closed", messages in flight are left to
  /// the links (Link::keep), serve() returns within a slice of its waits. Idempotent.
  void close();
  bool closing() const { return closing_.load(); }

 private:
  struct Slot;
  struct Shm;
  struct Plan;
  // The receive of a subscriber's next request, posted while its last one is answered, so that
  // a refusal or a dead subscriber is seen meanwhile. `pending` is null once its message was
  // read or failed; otherwise serve() leaves it to the link (Link::keep) when it returns.
  struct NextRequest {
    at::Tensor buffer;
    PendingPtr pending;
  };
  // How an answer went: taken by the subscriber, left to the link by a closing publisher, or
  // not (the subscriber refused it, sent something else or was lost; then recorded as lost).
  enum class Sent { kTaken, kClosing, kLost };
  // Sends `offer` (and, for a new version, the schema and the data) to `s`, looking at `next`
  // while a send takes longer than a slice.
  Sent answer(Subscription& s, Link& link, const Offer& offer, const at::Tensor& schema,
              const at::Tensor& data, NextRequest& next);
  // The same with the messages that follow the offer given; `pausable`: a relayed version's
  // first answer, whose pieces wait while `s` is paused (a resume's never do: a root of one
  // tree may resume its other lane while paused, and the one that paused it may wait for it).
  Sent answer(Subscription& s, Link& link, const Offer& offer,
              const std::vector<std::pair<at::Tensor, Kind>>& then, NextRequest& next,
              bool pausable = false);
  // serve()'s loop.
  void serve_requests(Subscription& s, Link& link);
  // What serve() does after answering a request: serve the next, stop (closing), or stop
  // (the subscriber lost).
  enum class Next { kServe, kClose, kStop };
  static Next next_of(Sent sent);
  // Waits until a version the request asks for is published (or its wait passes, or closing),
  // then answers it, pinning the slot it sends from until the subscriber has taken it.
  Next answer_request(Subscription& s, Link& link, const Request& r, NextRequest& next);
  // Relays (§9.9): the route of the newest version for `s` (built by the first subscriber's
  // thread to come, which frames the pieces), or null when `s` is not in it; the answer along
  // it; the answer to a resume.
  std::shared_ptr<Plan> plan_locked(Subscription& s, std::unique_lock<std::mutex>& lock);
  Next answer_relayed(Subscription& s, Link& link, const Request& r, NextRequest& next,
                      const std::shared_ptr<Plan>& plan, std::unique_lock<std::mutex>& lock);
  Next answer_resume(Subscription& s, Link& link, const Request& r, NextRequest& next);
  // `s` took the version `offer` announced: its stats count it (its acknowledgement).
  void count_taken_locked(Subscription& s, const Offer& offer);
  std::string pinning_locked() const;
  // Drops the oldest lost subscriptions out of serve() beyond kMaxLostKept, but `keep`.
  void prune_locked(const Subscription* keep);
  // Shared memory (§9.8). Slot `i` holds `version` pinned by a subscriber that maps it.
  bool shm_pinned_locked(int i, int64_t version) const;
  // Clears the pins of subscribers whose process exited.
  void reap_dead_locked();
  // Makes slots in a new segment that fit `bytes` and `json` bytes (the old one, if any, is
  // marked moved). False when shared memory cannot be had (kAuto): the slots stay in memory.
  bool ensure_segment_locked(int64_t bytes, size_t json);
  // The offer of shared memory to `s` (an entry assigned), or nothing when none is free.
  std::optional<Offer> shm_offer_locked(Subscription& s, const Request& r);
  void release_entry_locked(Subscription& s);
  // Whether `s` maps the slots; why its process is gone, if it is (its pid from its entry).
  bool mapped_entry(const Subscription& s) const;
  std::optional<std::string> subscriber_exited(const Subscription& s);
  void mark_locked(uint32_t flag);

  const uint64_t epoch_;
  const Transport transport_;
  const Routing routing_;
  std::shared_ptr<Plan> plan_;  // the route of the newest version relayed
  int64_t rate_ = 0;            // bytes per second of the last relayed version's first link
  std::unique_ptr<Shm> shm_;    // null: kSocket
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;  // a version published, a slot unpinned, a request
  std::vector<Slot> slots_;
  int newest_ = -1;
  int64_t version_ = 0;
  std::list<Subscription> subscriptions_;  // a list: each stays where it is
  size_t added_ = 0;                       // subscribers ever added (the lost ones pruned)
  size_t ready_ = 0;                       // of which sent a request or were lost
  // Large versions being sent (when each started), and how long the last one took.
  std::list<Clock::time_point> big_sends_;
  Clock::duration big_send_time_ = std::chrono::milliseconds(25);
  std::atomic<bool> closing_{false};
  std::mutex publish_mutex_;  // one publish copies at a time; guards the last_* fields
  std::optional<Metadata> last_metadata_;
  std::optional<std::string> last_tensorclass_;
  std::shared_ptr<const std::string> last_json_;
  uint64_t last_schema_ = 0;
};

}  // namespace tensordict::wire::publication
