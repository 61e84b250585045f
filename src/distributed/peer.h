#pragma once
// Pieces shared by the transfer calls (p2p, init_remote, collectives): naming a peer by global
// or group rank, posting and waiting on a batch of c10d works, receiving through a contiguous
// stand-in. Private to the c10d layer.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <optional>
#include <vector>

#include "tensordict/distributed/options.h"
#include "tensordict/tensor_dict.h"

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
/// given; otherwise each wait runs under the group's own timeout), and a wait that times out,
/// by either, raises DistBackendError naming the call, the peer, what was in flight and the
/// time waited, which Gloo's own message does not.
class Waiter {
 public:
  /// `peer` in words ("rank 1", "the group"). ValueError for a timeout that is not positive.
  Waiter(const char* call, std::optional<std::chrono::milliseconds> timeout, std::string peer);
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
  /// a timeout costs one timeout, not one per work; the first error is rethrown.
  void wait(const std::vector<WorkPtr>& works, const InFlight& what) const;
  void wait(const WorkPtr& work, const std::string& what) const;

 private:
  [[noreturn]] void timed_out(const std::string& what, const std::string& detail) const;

  const char* call_;
  std::optional<std::chrono::milliseconds> timeout_;
  std::chrono::steady_clock::time_point start_;
  int64_t start_ticks_;  // transfer_ticks(), for the transfer's counted duration
  std::string peer_;
  std::string detail_;
  int uncaught_;  // std::uncaught_exceptions() when the call began
};

/// Works handed to a caller, who waits on them itself (all_reduce_async, reduce_premature,
/// isend_early, irecv_premature): each wrapped so that its wait() raises what a Waiter's
/// would, a TimeoutError for a timeout and a PeerLostError for a lost connection (Gloo's own
/// exceptions are plain std::exceptions), naming `call`, `peer` ("rank 1", "the group") and
/// `what(i)`.
std::vector<WorkPtr> typed_works(const char* call, const std::string& peer,
                                 std::vector<WorkPtr> works, const InFlight& what);

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

/// Gloo moves contiguous buffers only: `leaf`, or a contiguous copy of it.
at::Tensor sendable(const at::Tensor& leaf);

/// Runs an in-place operation on `leaf` (a receive, a reduction) through a contiguous
/// stand-in when the leaf is not contiguous: post(buffer) posts it, and the returned work's
/// wait() copies the buffer into the leaf. The stand-in starts as a copy of the leaf when
/// `reads_leaf` (a reduction), uninitialised otherwise (a receive). Contiguous leaves are
/// passed to post as they are.
template <typename Post>
WorkPtr post_in_place(const at::Tensor& leaf, bool reads_leaf, Post&& post);

/// Gloo does not tell a receiver how many bytes a message carried: a message shorter than the
/// posted buffer leaves the rest of the buffer as it was, which for a fresh allocation is
/// memory freed earlier. A TailStamp writes 8 random bytes at the end of a buffer before the
/// receive; if they are still there afterwards, the message stopped short of the end (by 8
/// bytes or more; the chance that a full message ends with the same 8 bytes is 2^-64). A
/// message shorter by 1 to 7 bytes leaves stamp bytes, never old memory. Buffers under 8
/// bytes are zeroed instead, and short_message() is then always false.
class TailStamp {
 public:
  /// `bytes`: a contiguous 1-D uint8 tensor, on any device, about to be received into.
  explicit TailStamp(const at::Tensor& bytes);
  /// After the receive: whether the message ended before the stamp.
  bool short_message() const;

 private:
  at::Tensor tail_;  // a view of the buffer's last 8 bytes, or undefined
  uint64_t stamp_ = 0;
};

/// ValueError naming the key when one of `leaves` (td's) cannot travel: meta, sparse, nested
/// or quantized (check_transferable). Keys are looked up only for a refused leaf.
void check_leaves(const char* call, const TensorDict& td, const std::vector<at::Tensor>& leaves);

/// ValueError when `leaf`'s elements share memory (an expanded tensor): an in-place transfer
/// into it would be ill-defined. `action` ("receive into") and `who` ("receiver") word it.
void check_writable(const char* call, const at::Tensor& leaf, const char* action,
                    const char* who);

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
