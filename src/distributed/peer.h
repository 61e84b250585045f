#pragma once
// Pieces shared by the transfer calls (p2p, init_remote, collectives): naming a peer by global
// or group rank, posting and waiting on a batch of c10d works, receiving through a contiguous
// stand-in. Private to the c10d layer.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "tensordict/distributed/options.h"

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
/// `refuse_self` and a global peer, for this process's own rank (torch.distributed.send's
/// check).
Peer resolve_peer(const char* call, const std::optional<int64_t>& peer,
                  const std::optional<int64_t>& group_peer, const Group& group,
                  const char* peer_name, const char* group_peer_name, bool refuse_self);

/// `group`, or the default group when it is empty (ValueError when there is none).
Group resolve_group(const Group& group);

/// Waits on every work. After the first failure the rest are aborted, so that a dead peer or
/// a timeout costs one timeout, not one per work; the first error is rethrown.
void wait_all(const std::vector<WorkPtr>& works);

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

/// ValueError when `leaf`'s elements share memory (an expanded tensor): an in-place transfer
/// into it would be ill-defined. `action` ("receive into") and `who` ("receiver") word it.
void check_writable(const char* call, const at::Tensor& leaf, const char* action,
                    const char* who);

// ---- implementation ----

/// A work that waits for every one of `inner` (which fill `buffer`), then copies `buffer`
/// into `leaf`.
WorkPtr copy_back_work(std::vector<WorkPtr> inner, at::Tensor leaf, at::Tensor buffer);

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
