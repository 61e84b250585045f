#pragma once
// What the two kinds of publication share (docs/publication.md): over a c10d group
// (tensordict/distributed/publication.h) and over the pipe (tensordict/pipe/publication.h), a
// pull's options, a version pulled into a new TensorDict, and what a publisher reports of each
// subscriber.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "tensordict/tensor_dict.h"

namespace tensordict {

/// Keyword arguments of Subscriber::pull().
struct PullOptions {
  /// The longest pull waits for a newer version, then it returns nothing, its TensorDict
  /// unchanged. 0 polls: what has arrived is taken, nothing is waited for (a version the
  /// publisher is still sending is taken by a later pull). Unset: until one is published.
  std::optional<std::chrono::milliseconds> timeout{};
  /// Wait for at least this version of the publisher's current epoch; unset: any newer than
  /// the one held (a version of a new epoch is newer than any of the old one).
  std::optional<int64_t> min_version{};
  /// Over shared memory only (a subscriber whose transport() is "shm"): the TensorDict's leaves
  /// become views of the publisher's slot (set_: the same tensor objects, so a module's
  /// Parameters view it), read-only (a write into them faults the process), and the slot stays
  /// pinned, never rewritten, until the next pull that takes a version or release(). Over the
  /// socket it is ignored: the pull copies.
  bool zero_copy = false;
};

/// A version pulled into a new TensorDict.
struct Pulled {
  TensorDict td;
  int64_t version = 0;
  std::optional<std::string> tensorclass_type{};  // the publisher's, when it named one
};

/// What Publisher::stats() reports of one subscriber. The version it last pulled is its
/// acknowledgement: the publisher saw its last message taken, so no extra message is needed.
struct SubscriberStats {
  int64_t rank = -1;                 // in the group; -1 over the pipe
  std::string peer{};                // "rank 2", or the pipe's peer "127.0.0.1:40123"
  std::optional<int64_t> version{};  // the last version it received whole (this epoch)
  int64_t pulls = 0;                 // versions it received whole
  std::optional<int64_t> pinned{};   // the version of the slot it is receiving now
  bool waiting = false;              // a pull of it waits for a version to be published
  bool lost = false;                 // its connection broke or closed, or it sent bytes
                                     // that are not a request (then `error` says what)
  std::string error{};
  /// How it is served: "shm" (it maps the slots), "socket", or "socket (shared memory refused:
  /// <why>)" when it asked for shared memory and could not have it.
  std::string transport = "socket";
  /// A relayed version (route "chain" or "tree"): the rank its pieces last came from at first (-1:
  /// the publisher), or whose shared memory it read them from (a subscriber of its host); unset
  /// when it was sent whole.
  std::optional<int64_t> relayed_from{};
  /// Route "tree": the same for the second half of its pieces (the second tree); unset with
  /// one lane.
  std::optional<int64_t> relayed_second{};
  /// Set once a subscriber stopped taking pieces from this one and went to the publisher for
  /// the rest: who, at which piece, and why. It is a leaf of every later route.
  std::string routed_around{};
};

}  // namespace tensordict
