#pragma once
// Collectives over a c10d group with the reference tensordict's semantics and wire format
// (docs/wire-format.md §5): broadcast, all_gather and scatter move whole TensorDicts to ranks that
// need not know their structure (metadata as a pickle in torch's object-collective framing,
// then the consolidated storage); all_reduce and reduce combine leaves in place.
//
// Ranks: `src`/`dst` are global ranks, mapped into `group` (registered groups: the default
// one or one from new_group()); options.group_src / group_dst are ranks in `group`, used as
// given (the group may be unregistered). Exactly one of the two, else the reference's p2p
// ValueError texts. A group rank is never compared with a global one.
//
// Metadata is never unpickled with Python's pickle (see init_remote.h): a restricted reader
// takes the reference's dicts, lists, tuples, str, int, float, bool and None only, and the
// receivers check "_total_bytes" against the layout and options.max_total_bytes. When a
// receiver refuses the metadata but knows a sane storage size, it takes part in the storage
// transfer before throwing, so that the other ranks complete. The caller's TensorDicts and
// their metadata are never modified.
//
// Every rank of the group must make the same calls in the same order, as with any c10d
// collective; the calls block until this rank's part is done.

#include <cstdint>
#include <optional>
#include <vector>

#include "tensordict/distributed/options.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::dist {

/// Sends the source's TensorDict to every rank of the group and returns it everywhere,
/// consolidated. On the source, the result is `td` if it is consolidated, else a consolidated
/// copy (on options.device if given); elsewhere `td` is not used, and the result is new, its
/// storage on options.device, else the source's storage device (RuntimeError if this process
/// has no such device). Wire: broadcast_object_list (int64[1] = L, then uint8[L] of pickle
/// holding "_total_bytes" and "_storage_device"), then a broadcast of the storage.
/// options.tensorclass_type (source) travels as "_tensorclass_type"; on the other ranks it goes
/// to `*tensorclass_type` if given (nullopt when none came; nothing is imported).
TensorDict broadcast(const TensorDict& td, std::optional<int64_t> src,
                     const BroadcastOptions& options = {},
                     std::optional<std::string>* tensorclass_type = nullptr);

/// Every rank's TensorDict, on every rank, in group-rank order; each result is a new
/// consolidated TensorDict (this rank's own included). The structures may differ per rank.
/// Wire: all_gather_object (the int64[1] pickle lengths, then the pickles padded to the
/// longest), then an all_gather of the storages zero-padded to the largest "_total_bytes".
std::vector<TensorDict> all_gather(const TensorDict& td, const AllGatherOptions& options = {});

/// The reference's gather_and_stack: the rank `dst` (a global rank, or options.group_dst)
/// receives every other rank's TensorDict and writes them, stacked in group-rank order, into
/// the rows of `td`, whose first batch dim must be the group's size - 1 (updated in place:
/// ValueError naming the key when a leaf does not fit). Returns `td` on the destination and
/// nullopt elsewhere. Wire, as the reference's on Gloo: an all_gather of int64[3] headers
/// (kind: 0 for the destination, 2 for a consolidated storage; the storage's size; the buffer's
/// size), then a gather of buffers zero-padded to the largest: each the consolidated storage
/// followed by its metadata pickle (without transport fields). A reference peer that could not
/// consolidate sends a pickled TensorDict instead (kind 1), which is refused, never unpickled.
/// Sizes are checked on every rank before anything is allocated, so that all ranks refuse
/// together.
std::optional<TensorDict> gather_and_stack(const TensorDict& td, std::optional<int64_t> dst,
                                           const GatherAndStackOptions& options = {});

/// On the source, `tensordicts` holds one TensorDict per group rank (structures may differ);
/// elsewhere it is ignored, as in the reference. Returns this rank's TensorDict, new and
/// consolidated (on the source too). Wire: scatter_object_list (a broadcast of the longest pickle's
/// length, a scatter of the padded pickles, a scatter of the int64[1] lengths), then a scatter of
/// the storages zero-padded to "_max_bytes". ValueError on the source for a list whose length is
/// not the group's size.
TensorDict scatter(std::optional<int64_t> src, const std::vector<TensorDict>& tensordicts,
                   const ScatterOptions& options = {});

/// Reduces every leaf in place with options.op over the group, so that every rank holds the
/// result; leaves in depth-first insertion order (every rank must have inserted the same keys
/// in the same order, with the same shapes and dtypes). One c10d allreduce per leaf.
/// Non-contiguous leaves are reduced through a contiguous copy; expanded ones are refused
/// (ValueError). Blocks until done (with async_op: every leaf is posted before any is waited).
void all_reduce(const TensorDict& td, const AllReduceOptions& options = {});

/// Python's all_reduce(async_op=True): posts every leaf's allreduce and returns the works, in
/// leaf order. Lifetime: the leaves hold the result, and must stay untouched, until each
/// work's wait() has returned. A wait() that fails raises as the blocking call does
/// (PeerLostError for a lost peer, TimeoutError), not Gloo's bare exception.
std::vector<WorkPtr> all_reduce_async(const TensorDict& td, const AllReduceOptions& options = {});

/// Reduces every leaf with options.op into rank `dst` (a global rank) or options.group_dst;
/// leaves in per-leaf wire order (keys sorted by code point at each level, depth first), on
/// `group` at every level. Other ranks' leaves hold undefined values afterwards (Gloo writes
/// partial results). Blocks until done.
void reduce(const TensorDict& td, std::optional<int64_t> dst, const ReduceOptions& options = {});

/// Python's reduce(async_op=True, return_premature=True): posts every leaf's reduce and
/// returns the works; lifetime as all_reduce_async().
std::vector<WorkPtr> reduce_premature(const TensorDict& td, std::optional<int64_t> dst,
                                      const ReduceOptions& options = {});

}  // namespace tensordict::dist
