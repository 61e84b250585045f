#pragma once
// Publication over a c10d group (docs/publication.md): one Publisher hands the newest version
// of a TensorDict to many Subscribers, each pulling when it wants. A version is copied into
// one of max_slots slots when published; a subscriber's pull pins the slot it is sent from,
// so a publish never overwrites what a subscriber is receiving and never waits for one unless
// every slot is pinned. Subscribers fill their TensorDict only once a whole version has
// arrived, so they never see a torn one. The messages are ours (docs/wire-format.md §9); the
// other transfers on the group keep the reference's bytes and never meet them.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/distributed/options.h"
#include "tensordict/publication.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::dist {

// PullOptions, Pulled and SubscriberStats are tensordict::'s (tensordict/publication.h), shared
// with the pipe's publication (tensordict/pipe/publication.h), whose classes have the same
// methods. What differs: a group's Publisher serves the ranks it is given (every other rank by
// default) on a channel of its own, and a later Subscriber of the same group, rank and channel
// takes over what an earlier one left in flight.

/// Keyword arguments of Publisher.
struct PublisherOptions {
  Group group{};  // empty: the default process group; a registered group or a bare Backend
  /// How many copies of the TensorDict the publisher keeps (>= 1). With 2, a publish never
  /// waits while at most one subscriber is mid-pull.
  int64_t max_slots = 2;
  /// The subscribers' ranks in `group`; empty: every other rank of the group.
  std::vector<int64_t> subscribers{};
  /// Several publications on one group use one channel each, 0 to 65535; a Subscriber pulls
  /// from the publisher of its channel.
  int64_t channel = 0;
  /// How subscribers on this host are served: "auto" (the slots in shared memory, mapped by
  /// every subscriber that can, the others over the link), "shm" (the same, but raise when no
  /// shared memory can be made) or "socket" (every subscriber over the link).
  std::string transport = "auto";
  /// How a version reaches the subscribers that wait for it over the group: "star" (whole, to
  /// each, from here), "chain" (once, in pieces, forwarded from subscriber to subscriber as
  /// they arrive; the others of a host read them from its first subscriber's shared memory:
  /// docs/publication.md, "Relays") or "tree" (the same, half of the pieces down each of two
  /// binary trees: many hosts). Subscribers on shared memory read the slots either way.
  std::string route = "star";
};

/// Publishes versions of a TensorDict to subscribers on a c10d group (Gloo). Thread-safe.
/// Serves each subscriber from a thread of its own, so a slow, stopped or dead subscriber
/// costs the others nothing and the publisher at most the slot it pins.
class Publisher {
 public:
  explicit Publisher(const PublisherOptions& options = {});
  /// close().
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  /// Copies `td` into a slot no subscriber is reading and makes it the newest version, whose
  /// number it returns (1, 2, ...). Waits only when every slot is pinned, at most `timeout`
  /// (unset: for ever), then raises TimeoutError naming the subscribers that pin them. `td`
  /// may change its structure between versions (subscribers then read the new schema).
  /// `tensorclass_type` names a tensorclass ("module.qualname") for subscribers that pull a
  /// new TensorDict, as init_remote's does. ValueError for a leaf that cannot travel.
  int64_t publish(const TensorDict& td,
                  std::optional<std::chrono::milliseconds> timeout = std::nullopt,
                  const std::optional<std::string>& tensorclass_type = std::nullopt);

  /// This publisher's epoch: random, never 0, another for every Publisher (a restarted
  /// trainer's subscribers see it change and read the schema again).
  uint64_t epoch() const;
  /// The newest version published; 0 before the first publish.
  int64_t version() const;
  /// One entry per subscriber, in the order of PublisherOptions::subscribers.
  std::vector<SubscriberStats> stats() const;
  /// Waits until `count` subscribers (unset: every one of PublisherOptions::subscribers) have
  /// sent a request or were lost, at most `timeout`; TimeoutError naming the ranks that have
  /// not (a rank that runs no Subscriber, e.g. the reference tensordict). ValueError for a
  /// count above the number of subscribers.
  void wait_for_subscribers(std::chrono::milliseconds timeout,
                            std::optional<size_t> count = std::nullopt) const;
  /// Stops serving: pulls waiting for a version get "closed" (NoPublisherError); versions being
  /// sent stay queued until taken. Idempotent.
  void close();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

/// Keyword arguments of Subscriber.
struct SubscriberOptions {
  Group group{};                       // empty: the default process group
  std::optional<int64_t> src{};        // the publisher's global rank (exclusive with group_src)
  std::optional<int64_t> group_src{};  // the publisher's rank in `group`
  int64_t channel = 0;                 // the publisher's
  /// The largest storage the publisher may announce; unset: default_max_total_bytes().
  std::optional<int64_t> max_total_bytes{};
  /// "auto": pull from the publisher's slots in shared memory when it offers them and they
  /// map (same host and user), else over the link; "shm": the same, but raise (RuntimeError,
  /// naming why) when they cannot be had; "socket": always over the link.
  std::string transport = "auto";
};

/// Pulls versions from the Publisher on rank `src` (its channel). Not thread-safe: one thread
/// pulls at a time.
class Subscriber {
 public:
  explicit Subscriber(const SubscriberOptions& options);
  /// What a pull left posted stays posted (its buffers kept) until the publisher's messages
  /// land, so that neither side's connection is harmed.
  ~Subscriber();
  Subscriber(const Subscriber&) = delete;
  Subscriber& operator=(const Subscriber&) = delete;

  /// Fills `td` with the newest version newer than the one this subscriber holds and returns
  /// its number; nothing when the timeout passes first (`td` unchanged, the group usable).
  /// `td` changes only here, only to one whole version: the bytes land in a buffer of the
  /// subscriber's own, then are copied into td's leaves (Parameters stay the same objects).
  /// SchemaMismatchError naming the key when td's keys, dtypes or shapes are not the
  /// version's (td unchanged); NoPublisherError when the publisher's rank has taken none of
  /// this subscriber's requests yet, within the timeout (it runs no Publisher on this channel;
  /// one that took requests before and stops taking them is slow or stopped: the pull returns
  /// nothing), or the publisher closed;
  /// MalformedPeerDataError for bytes that break docs/wire-format.md §9; PeerLostError.
  std::optional<int64_t> pull(TensorDict& td, const PullOptions& options = {});
  /// The same into a new TensorDict (its leaves views of a storage of its own); fill it with
  /// later pulls.
  std::optional<Pulled> pull(const PullOptions& options = {});

  /// Makes the running pull (or, when none runs, the next) return nothing within 100 ms, its
  /// TensorDict unchanged: an event loop's cancelled apull. interrupt(false) withdraws it.
  /// The only method another thread may call during a pull.
  void interrupt(bool on = true);

  /// The version held (0: none) and its publisher's epoch (0: none).
  int64_t version() const;
  uint64_t epoch() const;
  /// Whether a pull found the publisher closed (its NoPublisherError said "closed").
  bool publisher_closed() const;
  /// How this subscriber pulls: "shm", "socket", or "socket (shared memory refused: <why>)".
  /// The relays this subscriber stopped taking a version's pieces from and left for the
  /// publisher (route "chain"), the newest last, each in words: who, where, why.
  std::vector<std::string> routed_around() const;
  std::string transport() const;
  /// Unpins the slot that the last zero-copy pull left the TensorDict viewing: the publisher
  /// may then rewrite it, so the views' contents may change. No effect over the socket.
  void release();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensordict::dist
