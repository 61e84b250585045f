#pragma once
// init_remote / from_remote_init: send a TensorDict to a rank that does not know its
// structure, with the reference tensordict's wire format (docs/wire-format.md §4), so either side
// may be a Python process running the reference.
//
// Point-to-point (the default), three tag-0 messages on the group, as torch's
// send_object_list + send produce them:
//   1. int64[1]: L, the length of the pickle;
//   2. uint8[L]: the consolidated metadata as a protocol-4 pickle of the reference's dict (leaf
//      entries are tuples), with "_total_bytes" added at its top level;
//   3. uint8[_total_bytes]: the consolidated storage.
// With use_broadcast the whole group takes part and broadcast() (collectives.h) carries it.
//
// Unlike the reference, nothing here runs Python's pickle: the metadata is written by our
// writer and read by a restricted reader (pickle.h) that keeps GLOBAL / STACK_GLOBAL as inert
// class names and refuses any opcode that calls or builds, with bounds on size and depth. The
// caller's TensorDict and its metadata are never modified: the transport fields go into the copy
// being sent.
//
// Malformed input from a peer is a clear error on the receiver. When the storage size is known
// and within max_total_bytes, the receiver still takes the storage message (and drops it)
// before throwing, so the sender completes; when it is not (a pickle that cannot be read, a
// length beyond the bounds), the sender's pending message fails at its group timeout.

#include <cstdint>
#include <optional>
#include <string>

#include "tensordict/distributed/options.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::dist {

/// Sends `td` (consolidated first unless it is already; a copy) to `dst`, a global rank, or to
/// options.group_dst, a rank in options.group: the first call of a transfer whose receiver
/// calls from_remote_init(). Blocks until the three messages are taken. Returns the
/// consolidated TensorDict that was sent (`td` itself when it was consolidated): send the next
/// values with send(result, dst, {.consolidated = true}) after writing them into it, and
/// nothing is copied or allocated. With use_broadcast, every rank of the group must call
/// broadcast()/from_remote_init(use_broadcast) and `dst` is ignored.
/// Throws ValueError for a bad peer (the reference's p2p texts; `dst` must not be this rank),
/// and the transport's errors.
TensorDict init_remote(const TensorDict& td, std::optional<int64_t> dst,
                       const InitRemoteOptions& options = {});

/// Receives what init_remote() sends, from `src` (a global rank) or options.group_src, and
/// returns it: a new consolidated TensorDict, whose storage was allocated on options.device
/// (default: the CPU point-to-point; the sender's storage device with use_broadcast). Receive
/// later values into it with recv(result, src, {.consolidated = true}), which writes into the
/// same storage. Blocks until everything has arrived.
/// When the sender was a tensorclass, the metadata names its class ("_tensorclass_type",
/// "<module>.<qualname>"): it goes to `*tensorclass_type` if given (nullopt when none came).
/// Nothing is imported or looked up here; the result is the tensorclass's TensorDict.
/// Throws ValueError for a bad peer or malformed metadata (a pickle outside the accepted
/// subset, truncated, beyond the bounds, or whose layout needs more bytes than
/// "_total_bytes", a "_tensorclass_type" that is not a short string); ValueError when
/// "_total_bytes" exceeds max_total_bytes; the transport's errors.
TensorDict from_remote_init(std::optional<int64_t> src, const FromRemoteInitOptions& options = {},
                            std::optional<std::string>* tensorclass_type = nullptr);

}  // namespace tensordict::dist
