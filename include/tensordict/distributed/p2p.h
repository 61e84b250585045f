#pragma once
// Point-to-point transfer of a TensorDict over c10d: send / recv / isend / irecv with the
// reference tensordict's semantics and wire format (docs/wire-format.md §1), so a Python peer
// using the reference interoperates with a C++ peer using these.
//
// Free functions rather than TensorDict methods: the core header must not see c10d.
// `dist::send(td, 1, {.init_tag = 8})` is Python's `td.send(1, init_tag=8)`, and
// `dist::send(td, {}, {.group = pg, .group_dst = 0})` is `td.send(group=pg, group_dst=0)`.
//
// Wire format, per leaf (the default): one message per leaf, in depth-first order with keys
// sorted by code point at each level; the message is the leaf's bytes in C order, with no
// header; leaf k carries tag init_tag + k, or the pseudo-random chain of tags.h. The receiver's
// TensorDict must have the same keys, shapes and dtypes (nothing about them travels).
// Non-tensor entries are skipped and take no tag, as in the reference: the receiver keeps its
// own (init_remote and the collectives deliver them).
// Consolidated: one message, tag 0, carrying the consolidated storage (docs/wire-format.md §3).
//
// Peers: `dst`/`src` are global ranks, translated for `group` (default: the default group);
// `group_dst`/`group_src` are ranks inside `group`, which is then used as given (it may be a
// standalone group built on a store, never registered). Exactly one of the two must be given,
// else ValueError with the reference's texts:
//   "`group_dst` requires `group` to be passed."
//   "`dst` and `group_dst` are mutually exclusive."
//   "Exactly one of `dst` and `group_dst` must be provided."
// (recv/irecv: `src`/`group_src`). Every argument is checked before any message leaves:
// a negative init_tag or a last tag above INT32_MAX is a ValueError, and so is a consolidated
// recv into a TensorDict that is not consolidated.
//
// Every call posts all its messages before it waits on any, so a transfer costs one round of
// latency, not one per leaf. Leaves that are not contiguous are sent from a contiguous copy
// and received through one (the copy back happens in wait()).
//
// Blocking calls wait for every message; if one fails, the others are aborted and waited, and
// the first error is rethrown (c10d's DistBackendError / RuntimeError, e.g. on the group
// timeout). A tag mismatch between the two sides is not detected: it blocks until the timeout.

#include <cstdint>
#include <optional>
#include <vector>

#include "tensordict/distributed/options.h"
#include "tensordict/sub_tensor_dict.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::dist {

/// Sends the leaves of `td` to `dst` (a global rank) or to `options.group_dst`. Blocks until
/// every message is delivered to the transport (Gloo: the receiver has taken it).
/// consolidated=True sends td's consolidated storage, consolidating a copy first unless td is
/// consolidated already (init_tag and pseudo_rand are then ignored). With a global `dst` on a
/// blocking send, `dst` must not be this rank (torch's ValueError).
void send(const TensorDict& td, std::optional<int64_t> dst, const SendOptions& options = {});

/// Receives what send()/isend() sends into `td`'s tensors, in place. Returns the last leaf's
/// tag (init_tag - 1 when there are no leaves), or nullopt with consolidated=True, which
/// receives one message into the consolidated storage (td must be consolidated, with the
/// sender's layout). Blocks until everything has arrived. Every receive (irecv and the
/// collectives' reductions too) bumps each leaf's autograd version, as an in-place op does
/// (mark_written, tensordict/leaf.h).
std::optional<int64_t> recv(const TensorDict& td, std::optional<int64_t> src,
                            const RecvOptions& options = {});

/// As send(), with every message posted asynchronously and then waited on (Python's isend with
/// return_early=False). Returns the last tag, or nullopt with consolidated=True.
std::optional<int64_t> isend(const TensorDict& td, std::optional<int64_t> dst,
                             const SendOptions& options = {});
/// Python's isend(return_early=True): posts every message and returns their Work handles
/// without waiting (one per leaf in wire order, or one for a consolidated message).
/// Lifetime: the leaves must stay alive and unchanged until every handle's wait() returned.
/// A failed wait() raises PeerLostError or TimeoutError, as send() does.
std::vector<WorkPtr> isend_early(const TensorDict& td, std::optional<int64_t> dst,
                                 const SendOptions& options = {});

/// As recv(), posting every receive before waiting on any (Python's irecv with
/// return_premature=False).
void irecv(const TensorDict& td, std::optional<int64_t> src, const RecvOptions& options = {});
/// Python's irecv(return_premature=True): posts every receive and returns the Work handles.
/// The leaves hold the received values only once each handle's wait() has returned (for a
/// non-contiguous leaf, wait() copies the data in); until then, do not read or write them.
/// A failed wait() raises PeerLostError or TimeoutError, as recv() does.
std::vector<WorkPtr> irecv_premature(const TensorDict& td, std::optional<int64_t> src,
                                     const RecvOptions& options = {});

/// recv() into the rows of a parent TensorDict that `sub` selects (the reference's
/// _SubTensorDict as a receiver). Basic indices: into views of the parent's leaves, no copy.
/// Advanced indices: into a copy of the rows, then written back at the index. Consolidated:
/// into a consolidated copy of the rows (the sender's layout is that of sub.view()), then
/// written back; the reference refuses this (its sub-tensordict has no storage).
std::optional<int64_t> recv(const SubTensorDict& sub, std::optional<int64_t> src,
                            const RecvOptions& options = {});
/// irecv() likewise; with advanced indices the write back happens once every receive is done.
void irecv(const SubTensorDict& sub, std::optional<int64_t> src, const RecvOptions& options = {});

}  // namespace tensordict::dist
