#pragma once
// Pieces shared by the transfer calls (p2p, init_remote, collectives): naming a peer by global
// or group rank, posting and waiting on a batch of c10d works, receiving through a contiguous
// stand-in. Private to the c10d layer.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/byte_tensor.h"
#include "late.h"
#include "tensordict/distributed/options.h"
#include "tensordict/tensor_dict.h"
#include "wire/tail_stamp.h"

namespace tensordict::dist::detail {

/// The reference's _check_p2p_peer, texts included: exactly one of `peer` (a global rank) and
/// `group_peer` (a rank in `group`), and `group_peer` only with a group. ValueError otherwise.
void check_p2p_peer(const std::optional<int64_t>& peer, const std::optional<int64_t>& group_peer,
                    const Group& group, const char* peer_name, const char* group_peer_name);

/// A group, resolved (never empty), and a rank in it.
struct Peer {
  Group group;
  int rank;  // in group
};

/// The group (empty: the default group) and the peer's rank in it, as torch.distributed
/// resolves them: a global `peer` is mapped through the registry, a `group_peer` is used as
/// given (the group may be unregistered). ValueError for a rank outside the group, or, with
/// `refuse_self` and a global peer, for this process's own rank (torch.distributed.send's and
/// recv's check; the Python layer, which maps global ranks itself, checks them there).
Peer resolve_peer(const char* call, const std::optional<int64_t>& peer,
                  const std::optional<int64_t>& group_peer, const Group& group,
                  const char* peer_name, const char* group_peer_name, bool refuse_self);

/// `group`, or the default group when it is empty (ValueError when there is none).
Group resolve_group(const Group& group);

/// Describes work i of a batch for a timeout's message ("tag 3 (key 'a')").
using InFlight = std::function<std::string(size_t)>;

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

/// Works handed to a caller, who waits on them itself (all_reduce_async, reduce_premature,
/// isend_early, irecv_premature): each wrapped so that its wait() raises what a Waiter's
/// would, a TimeoutError for a timeout and a PeerLostError for a lost connection (Gloo's own
/// exceptions are plain std::exceptions), naming `call`, `peer` ("rank 1", "the group") and
/// `what(i)`. With `keeps_group` (point-to-point works), a wait(timeout) that times out aborts
/// the wait and raises TimeoutError, the work still posted, instead of letting Gloo's wait
/// expire (which closes the group).
std::vector<WorkPtr> typed_works(const char* call, const std::string& peer,
                                 std::vector<WorkPtr> works, const InFlight& what,
                                 bool keeps_group);

/// Rethrows the exception being handled, `e`, as the failure kind it is: our typed errors and
/// c10's own as they are; Gloo's transport errors ("Connection closed by peer", "Connection
/// reset by peer", plain std::exceptions) as PeerLostError, saying where (`where`).
[[noreturn]] void rethrow_lost(const std::exception& e, const std::string& where);

/// Aborts and drains works already posted, ignoring their errors (cleanup before a rethrow).
void abandon(const std::vector<WorkPtr>& works);

/// Posts count works through post(i); if posting throws midway, what was posted is abandoned.
template <typename Post>
std::vector<WorkPtr> post_all(size_t count, Post&& post) {
  std::vector<WorkPtr> works;
  works.reserve(count);
  try {
    for (size_t i = 0; i < count; ++i) {
      works.push_back(post(i));
    }
  } catch (...) {
    abandon(works);
    throw;
  }
  return works;
}

using core::bytes_tensor;

/// Gloo moves contiguous buffers only: `leaf`, or a contiguous copy of it.
at::Tensor sendable(const at::Tensor& leaf);

/// Runs an in-place operation on `leaf` (a receive, a reduction) through a contiguous
/// stand-in when the leaf is not contiguous: post(buffer) posts it, and the returned work's
/// wait() copies the buffer into the leaf. The stand-in starts as a copy of the leaf when
/// `reads_leaf` (a reduction), uninitialised otherwise (a receive). Contiguous leaves are
/// passed to post as they are.
template <typename Post>
WorkPtr post_in_place(const at::Tensor& leaf, bool reads_leaf, Post&& post);

/// ValueError naming the key when one of `leaves` (td's) cannot travel: meta, sparse, nested
/// or quantized (check_transferable). Keys are looked up only for a refused leaf.
void check_leaves(const char* call, const TensorDict& td, const std::vector<at::Tensor>& leaves);

/// ValueError when `leaf`'s elements share memory (an expanded tensor): an in-place transfer
/// into it would be ill-defined. `action` ("receive into") and `who` ("receiver") word it.
void check_writable(const char* call, const at::Tensor& leaf, const char* action, const char* who);

// ---- implementation ----

/// A work that waits for every one of `inner` (which fill `buffer`), then copies `buffer`
/// into `leaf`.
WorkPtr copy_back_work(std::vector<WorkPtr> inner, at::Tensor leaf, at::Tensor buffer);

/// A work that waits for every one of `inner`, then runs `finish` once (without grad), in the
/// first wait() that sees them done; result() is `result`.
WorkPtr then(std::vector<WorkPtr> inner, std::function<void()> finish,
             std::vector<at::Tensor> result);

template <typename Post>
WorkPtr post_in_place(const at::Tensor& leaf, bool reads_leaf, Post&& post) {
  if (leaf.is_contiguous()) {
    return post(leaf);
  }
  at::Tensor buffer =
      reads_leaf ? leaf.contiguous() : at::empty_like(leaf, at::MemoryFormat::Contiguous);
  WorkPtr inner = post(buffer);
  return copy_back_work({std::move(inner)}, leaf, std::move(buffer));
}

}  // namespace tensordict::dist::detail
