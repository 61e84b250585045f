#pragma once
// How publication's messages travel (docs/wire-format.md §9): the two ends of the exchange
// (publication_publisher.h, publication_subscriber.h) post and wait on messages through a Link,
// which each transport implements: a c10d group's tags (src/distributed/group_link.h) and a
// pipe's tag messages (src/pipe/pipe_link.h). No transport here. A link reports what happened,
// typed; the engine alone decides what it means. tests/cpp/publication_contract.h holds every
// link to this contract, the same scenarios over each, in one process: a new transport is a new
// Link and one line there.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "wire/publication.h"

namespace tensordict::wire::publication {

using Clock = std::chrono::steady_clock;

/// One message posted on a Link (the transport's own record behind it).
struct Pending {
  virtual ~Pending() = default;
};
using PendingPtr = std::shared_ptr<Pending>;

/// One publisher and one subscriber's messages. Messages of one Kind arrive in the order they
/// were sent; a message posted stays posted, its buffer kept, until it completes, however many
/// waits give up on it. Called by one thread at a time; a c10d group's link (relays are a
/// group's only) also by a relay's two lanes' threads at once, each on messages of its own.
class Link {
 public:
  virtual ~Link() = default;
  /// Posts the receive of the next message of `kind` into `buffer` (contiguous uint8). A
  /// buffer from recv_buffer() has room after it: a link whose transport ends the process on a
  /// longer message (Gloo) posts the room too, and wait() names such a message instead.
  virtual PendingPtr post_recv(const at::Tensor& buffer, Kind kind) = 0;
  /// Posts the send of `buffer`. A request's completes only once the peer has taken it (posted
  /// its receive): that is how a subscriber tells a peer that runs no publisher.
  virtual PendingPtr post_send(const at::Tensor& buffer, Kind kind) = 0;
  /// Waits until `p` completes (true) or `deadline` passes (false; it stays posted). Throws
  /// PeerLostError for a lost connection (also while the message in progress is one the
  /// transport would never fail), PeerClosedError for the peer's clean close where a request
  /// or an offer was due (the two ends decide what that means), and MalformedPeerDataError for
  /// a message longer than its buffer, or a request or an offer of the wrong size.
  virtual bool wait(const PendingPtr& p, Clock::time_point deadline) = 0;
  /// Whether the completed receive `p` carried fewer bytes than its buffer.
  virtual bool short_message(const PendingPtr& p) const = 0;
  /// Messages an end leaves posted (a closing publisher, a subscriber that refused or lost
  /// its publisher): kept, their buffers alive, until they complete or the connection goes. A
  /// kept receive of a request is the next one: the next post_recv() of a request on this link
  /// takes it over (its bytes copied into the new buffer once it completes), so that a new
  /// publisher on the link gets the request that lands in it.
  virtual void keep(const std::vector<PendingPtr>& posted) = 0;
  /// The peer in words, for messages: "rank 2", "127.0.0.1:40123".
  virtual std::string peer() const = 0;
  /// Why a peer that takes no request runs no publisher, for NoPublisherError.
  virtual std::string no_publisher() const = 0;
};

}  // namespace tensordict::wire::publication
