#pragma once
// Moving a TensorDict to ranks that do not know its structure (init_remote and the
// broadcast / all_gather / scatter collectives): torch's object-collective framing around our
// own pickles, and the receiver's checks on what a peer announces. Private to the c10d layer.

#include <ATen/ATen.h>

#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/metadata.h"
#include "tensordict/consolidate.h"
#include "waiter.h"

namespace tensordict::dist::detail {

// ---- sending ----

/// `td` itself when it is consolidated, else a consolidated copy (on `device` if given).
TensorDict consolidated(const TensorDict& td, std::optional<at::Device> device);

/// The consolidated TensorDict's metadata as the reference's pickled dict, with `fields` added
/// at the top level of a copy (the TensorDict's own metadata is shared and never modified).
std::string metadata_pickle(const TensorDict& consolidated, const TransportFields& fields);

// ---- torch's object-collective framing (CPU tensors, as Gloo's default device) ----
// Every wait goes through the call's Waiter (its deadline, its error texts). Receivers refuse
// a pickle length outside [1, kMaxMetadataJsonBytes] (ValueError) before allocating anything.

/// send_object_list([obj]) then send(storage): int64[1] = L, uint8[L], uint8[storage], all tag
/// 0, all posted before any is waited on. Blocks until the three are taken.
void send_object_and_storage(const Waiter& w, const Peer& peer, const std::string& pickle,
                             const at::Tensor& storage, at::Device framing_device);
/// recv_object_list([None]): the pickle bytes.
std::string recv_object(const Waiter& w, const Peer& peer, at::Device framing_device);
/// broadcast_object_list([obj]); `pickle` is given on the root only.
std::string broadcast_object(const Waiter& w, const Peer& root, const std::string* pickle);
/// all_gather_object: every rank's pickle, by group rank.
std::vector<std::string> all_gather_objects(const Waiter& w, const Group& group,
                                            const std::string& pickle);
/// scatter_object_list: this rank's pickle; `pickles` (one per rank) on the root only.
std::string scatter_objects(const Waiter& w, const Peer& root,
                            const std::vector<std::string>* pickles);

// ---- receiving ----

/// What a peer announced, checked. Errors are deferred when the storage transfer can still be
/// joined (its size is known and within the bound), so that the other ranks complete.
struct Incoming {
  std::string from;                                 // the peer, as messages name it
  std::optional<core::ValidatedMetadata> metadata;  // parsed and validated once
  std::optional<int64_t> total_bytes;               // known and sane
  std::optional<int64_t> max_bytes;                 // scatter's padded size, known and sane
  std::optional<std::string> storage_device;
  std::optional<std::string> tensorclass_type;  // "_tensorclass_type": a name, never imported
  std::exception_ptr error;                     // the first fault found
};

/// Reads a peer's pickle (restricted reader; nothing is imported or called) and checks the
/// transport fields: "_total_bytes" (and "_max_bytes" when `padded`) are ints in
/// [0, max_total_bytes], the layout fits in "_total_bytes", "_tensorclass_type" (if any) is a
/// short string.
/// `from` names the peer in messages ("from_remote_init", "all_gather (rank 2)").
Incoming parse_incoming(const std::string& from, std::string_view pickle, int64_t max_total_bytes,
                        bool padded);

/// The number of bytes the storage transfer moves (total_bytes, or max_bytes when padded);
/// rethrows the deferred error when that is unknown (the transfer cannot be joined).
int64_t transfer_bytes(const Incoming& in, bool padded);

/// Where to allocate the received storage: `device`, else the sender's "_storage_device" if
/// this process has that device, else the CPU. A label this process cannot honour becomes the
/// deferred error (and the CPU is returned, to drain the transfer).
at::Device receive_device(const std::string& from, std::optional<at::Device> device, Incoming& in);

/// `max_total_bytes` as given, or default_max_total_bytes() when unset; ValueError naming
/// `call` when it is negative, before anything is sent or received.
int64_t resolve_max_total_bytes(const char* call, std::optional<int64_t> max_total_bytes);

/// What a peer's storage is received into: `bytes` (1-D uint8) and the stamp that tells a
/// message shorter than announced.
struct StorageBuffer {
  at::Tensor bytes;
  TailStamp stamp;
};

/// The buffer for a storage transfer of `n` bytes (transfer_bytes) on `device`. When the
/// transfer is only drained (the peer's metadata was refused) and lands on the CPU, the buffer
/// maps the same few MiB of memory over and over, so that a refused peer costs no memory for
/// the storage it announced. A failed allocation is an error naming the peer and the size.
StorageBuffer storage_buffer(const Incoming& in, int64_t n, at::Device device);

/// After the transfer: rethrows the deferred error; refuses a storage message shorter than
/// announced (ValueError); or rebuilds the TensorDict from the first total_bytes of `buffer`.
TensorDict finish(Incoming& in, const StorageBuffer& buffer);

/// A 1-D uint8 tensor of `n` bytes on `device`.
at::Tensor byte_buffer(int64_t n, at::Device device, bool zeroed = false);

}  // namespace tensordict::dist::detail
