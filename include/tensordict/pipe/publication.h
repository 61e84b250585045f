#pragma once
// Publication over the pipe (docs/publication.md): a TensorDictServer's Publisher hands the
// newest version of a TensorDict to each connected TensorDictPipe's Subscriber, each pulling
// when it wants, as tensordict::dist::Publisher does over a c10d group: versions in max_slots
// slots, a pull pinning the slot it is sent from, never a torn version. The messages are the
// group's (docs/wire-format.md §9), in order on the pipe (§9.7); a pipe that subscribes carries
// nothing else.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/pipe/pipe.h"
#include "tensordict/pipe/server.h"
#include "tensordict/publication.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::pipe {

// PullOptions, Pulled and SubscriberStats are tensordict::'s (tensordict/publication.h), shared
// with the group's publication (tensordict/distributed/publication.h), whose classes have the
// same methods. What differs: a server's Publisher serves every client that connects, present
// and future (so wait_for_subscribers needs a count), and a pipe carries one Subscriber, once
// (a second raises RuntimeError: the pipe carries a publication already).

/// Keyword arguments of Publisher.
struct PublisherOptions {
  /// How many copies of the TensorDict the publisher keeps (>= 1). With 2, a publish never
  /// waits while at most one subscriber is mid-pull.
  int64_t max_slots = 2;
  /// How clients on this host are served: "auto" (the slots in shared memory, mapped by every
  /// subscriber that can, the others over their pipe), "shm" (the same, but raise when no
  /// shared memory can be made) or "socket" (every subscriber over its pipe).
  std::string transport = "auto";
};

/// Publishes versions of a TensorDict to every client of `server`, present and future: it
/// serves the server (TensorDictServer::serve), each client's pipe from the server's thread
/// for it, so a slow, stopped or dead subscriber costs the others nothing and the publisher at
/// most the slot it pins. A client that is not a tensordict_cpp peer (the reference's pipe) is
/// recorded as lost and its pipe closed. Thread-safe.
class Publisher {
 public:
  /// RuntimeError when `server` is closed or serves already.
  explicit Publisher(TensorDictServer& server, const PublisherOptions& options = {});
  /// close().
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  /// As dist::Publisher::publish: copies `td` into a slot nobody pins and returns its version;
  /// waits only while every slot is pinned, at most `timeout`, then TimeoutError naming the
  /// subscribers (their pipes' peers) that pin them.
  int64_t publish(const TensorDict& td,
                  std::optional<std::chrono::milliseconds> timeout = std::nullopt,
                  const std::optional<std::string>& tensorclass_type = std::nullopt);

  uint64_t epoch() const;
  int64_t version() const;
  /// One entry per client, in the order they connected (`peer`: the pipe's peer, `rank` -1).
  std::vector<SubscriberStats> stats() const;
  /// Waits until `count` clients have connected and sent a request (or were lost), at most
  /// `timeout`; TimeoutError naming those that have not, and how many never connected.
  /// ValueError without a count: clients come and go, so "every one" means nothing here.
  void wait_for_subscribers(std::chrono::milliseconds timeout,
                            std::optional<size_t> count = std::nullopt) const;
  /// Stops serving: pulls waiting for a version get "closed" (NoPublisherError), and every
  /// client's pipe is closed once its thread has answered. The server keeps running (close it
  /// to stop accepting). Idempotent.
  void close();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

/// Keyword arguments of Subscriber.
struct SubscriberOptions {
  /// The largest storage the publisher may announce; unset: the pipe's max_storage_bytes.
  std::optional<int64_t> max_total_bytes{};
  /// "auto": pull from the publisher's slots in shared memory when it offers them and they
  /// map (same host and user), else over the pipe; "shm": the same, but raise (RuntimeError,
  /// naming why) when they cannot be had; "socket": always over the pipe.
  std::string transport = "auto";
};

/// Pulls versions from the Publisher of the server at the other end of `pipe` (made by
/// Pipe::connect, or listen for a single client). The pipe then carries the publication's
/// messages only, for good: its send() and recv() raise, and so does a second Subscriber on it,
/// even once this one is destroyed (connect another pipe for a new Subscriber). Not
/// thread-safe: one thread pulls at a time.
class Subscriber {
 public:
  /// ValueError for a pipe over a caller's link (Pipe::over), whose messages cannot be waited
  /// on apart; RuntimeError for a pipe that carries a publication already (a Subscriber was
  /// made on it, or a Publisher serves it); the pipe's errors when it is closed or broken;
  /// NoPublisherError when the peer is not a tensordict_cpp peer.
  explicit Subscriber(Pipe pipe, const SubscriberOptions& options = {});
  ~Subscriber();
  Subscriber(const Subscriber&) = delete;
  Subscriber& operator=(const Subscriber&) = delete;

  /// As dist::Subscriber::pull: fills `td` with the newest version newer than the one held and
  /// returns its number, or nothing when the timeout passes first (`td` unchanged, the pipe
  /// usable). NoPublisherError when the server has taken none of this subscriber's requests
  /// within the timeout (it runs no Publisher), and when its Publisher closed (or closed the
  /// pipe); PeerLostError when the pipe broke.
  std::optional<int64_t> pull(TensorDict& td, const PullOptions& options = {});
  // The rest as dist::Subscriber's (tensordict/distributed/publication.h).
  std::optional<Pulled> pull(const PullOptions& options = {});
  void interrupt(bool on = true);
  int64_t version() const;
  uint64_t epoch() const;
  bool publisher_closed() const;
  /// How this subscriber pulls: "shm", "socket", or "socket (shared memory refused: <why>)".
  /// Always empty: relays run over a group only (dist::Subscriber's).
  std::vector<std::string> routed_around() const;
  std::string transport() const;
  /// Unpins the slot that the last zero-copy pull left the TensorDict viewing: the publisher
  /// may then rewrite it, so the views' contents may change. No effect over the pipe.
  void release();
  const Pipe& pipe() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensordict::pipe
