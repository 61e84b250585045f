#pragma once
// The waits of one blocking transfer call of the c10d layer (p2p, init_remote, collectives,
// checked transfers): its deadline, its typed errors, the receives it stages so that a call
// that times out leaves its TensorDict as it was, and what a timed-out call parks (late.h).
// Private to the c10d layer.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "late.h"
#include "peer.h"
#include "works.h"

namespace tensordict::dist::detail {

/// The waits of one blocking call. They share the call's deadline (its `timeout` option, when
/// given; otherwise each wait runs under the group's own timeout), and a wait that times out
/// raises TimeoutError naming the call, the peer, what was in flight and the time waited,
/// which Gloo's own message does not.
///
/// A point-to-point call's deadline keeps the group (late.h): its waits are aborted at the
/// deadline, and what it posted through recv()/recv_into()/send() is parked, not freed. With a
/// deadline, receives into the caller's memory land in buffers of the library's own (stage())
/// and are copied into place by land() once the whole call has arrived, so a call that times
/// out leaves its TensorDict as it was. Collectives cannot keep the group (Gloo's collective
/// works cannot be aborted, and ranks that gave up a collective would be out of step): their
/// Waiter (`keeps_group` false) lets Gloo's wait expire as before.
class Waiter {
 public:
  /// `peer` in words ("rank 1", "the group"). ValueError for a timeout that is not positive.
  Waiter(const char* call, std::optional<std::chrono::milliseconds> timeout, std::string peer,
         bool keeps_group = true);
  /// A call that completes (no exception leaves it) counts as a transfer of the process-group
  /// channel (transfer_stats.h) and is logged at "info" (log.h): call, peer, detail, duration.
  ~Waiter();
  Waiter(const Waiter&) = delete;
  Waiter& operator=(const Waiter&) = delete;

  /// What the log line says of the transfer ("per leaf, 3 messages, tags 0-2, 112 bytes"). Build
  /// it only when log_enabled(LogLevel::kInfo).
  void set_detail(std::string detail) { detail_ = std::move(detail); }

  const char* call() const { return call_; }
  const std::string& peer() const { return peer_; }
  void set_peer(std::string peer) { peer_ = std::move(peer); }

  /// Waits on every work. After the first failure the rest are aborted, so that a dead peer or
  /// a timeout costs one timeout, not one per work; the first error is rethrown. A deadline
  /// that passes in a call that keeps the group parks what the call posted instead.
  void wait(const std::vector<WorkPtr>& works, const InFlight& what) const;
  void wait(const WorkPtr& work, const std::string& what) const;

  /// Posts a receive from `peer` on `tag` into `buffer`, memory the library owns (a header, a
  /// new TensorDict's storage). When an earlier call that timed out left a receive from that
  /// peer on that tag, it is taken instead: `buffer` and `stamps` become the parked message's
  /// (no copy), or with `copy_late` its bytes are copied into `buffer` once it completes.
  /// ValueError when that message's size differs from `buffer`'s.
  /// With `room`, `buffer` is a view of memory of the library's own followed by at least 8
  /// spare bytes (stage(), or a larger allocation narrowed): they are posted with it, up to
  /// room_for(n), so that a longer message is a MalformedPeerDataError from the wait instead of
  /// Gloo's abort. ValueError when LateMessages::kMaxParked receives from the peer are parked.
  WorkPtr recv(const Peer& peer, at::Tensor& buffer, int tag,
               std::initializer_list<TailStamp*> stamps = {}, bool copy_late = false,
               bool room = false) const;
  /// Posts a receive from `peer` on `tag` into the caller's `dest` (a leaf, a consolidated
  /// storage): with a deadline into stage(dest); otherwise into dest itself, or a contiguous
  /// stand-in copied into it once waited. A parked receive on that tag is taken instead, its
  /// bytes copied in once it completes.
  WorkPtr recv_into(const Peer& peer, const at::Tensor& dest, int tag) const;
  /// Posts a send to `peer` on `tag`; with a deadline, one that times out stays queued, its
  /// tensor kept until the receiver has taken it.
  WorkPtr send(const Peer& peer, const at::Tensor& tensor, int tag) const;

  /// Whether receives into the caller's memory are staged: a deadline in a call that keeps the
  /// group, unless direct_landing() was called.
  bool staged() const { return staged_; }
  /// The call's receives land in the caller's memory as they come (irecv(return_premature)).
  void direct_landing() { staged_ = false; }
  /// A buffer of the library's own for `dest`'s bytes (1-D uint8), copied into `dest` by
  /// land(). From a per-thread arena that the next call reuses (the size of the largest staged
  /// call, kept).
  at::Tensor stage(const at::Tensor& dest) const;
  /// Copies every staged buffer into its destination. Call once, after the last wait.
  void land() const;

  /// late="drop": waits for the receives from `peer` on `tags` that earlier calls left parked,
  /// and drops them. For transfers whose later messages depend on their first ones (checked,
  /// from_remote_init), run the call itself instead, into a throwaway target.
  void drop_late(const Peer& peer, const std::vector<int>& tags) const;

 private:
  struct Record {
    GroupKey group;
    int peer;
    MessagePtr message;
  };

  /// Raises the TimeoutError; in a call that keeps the group, parks what it posted first.
  [[noreturn]] void timed_out(const std::string& what, const std::string& detail) const;
  /// Whether a timeout parks what the call posted: a deadline, in a call that keeps the group.
  bool parks() const { return timeout_.has_value() && keeps_group_; }
  /// Keeps `message` for park(), when parks().
  void record(const Peer& peer, MessagePtr message) const;
  /// The same for a message just posted through `work`, which then becomes a work that marks
  /// the message done; the message, or null when nothing is kept.
  MessagePtr track(const Peer& peer, WorkPtr& work, const at::Tensor& buffer, int tag,
                   bool is_recv) const;
  void park() const;

  const char* call_;
  std::optional<std::chrono::milliseconds> timeout_;
  bool keeps_group_;
  bool staged_;
  std::chrono::steady_clock::time_point start_;
  int64_t start_ticks_;  // transfer_ticks(), for the transfer's counted duration
  std::string peer_;
  std::string detail_;
  int uncaught_;  // std::uncaught_exceptions() when the call began
  // What the call posted, parked if its deadline passes (with a deadline only).
  mutable std::vector<Record> records_;
  mutable bool parked_ = false;
  // Staged receives: the arena they are cut from, the bytes cut, and where each lands.
  mutable at::Tensor arena_;
  mutable int64_t arena_used_ = 0;
  mutable int64_t staged_bytes_ = 0;
  mutable std::vector<std::pair<at::Tensor, at::Tensor>> landings_;  // (dest, buffer)
};

}  // namespace tensordict::dist::detail
