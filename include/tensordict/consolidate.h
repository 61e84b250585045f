#pragma once
// consolidate(): every leaf of a TensorDict copied into one flat uint8 storage, in the byte
// layout of the reference tensordict (docs/wire-format.md §3); the metadata that describes the
// layout, as a value and as JSON text; and rebuild(), which turns (metadata, storage) back into
// a TensorDict of views. No transport here: the transports move the storage and the metadata.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "tensordict/tensor_dict.h"

namespace tensordict {

/// Options of consolidate(), named like the reference's keywords.
struct ConsolidateOptions {
  bool metadata = true;                // kept for parity: the reference always builds the metadata
  std::optional<at::Device> device{};  // storage device; default: the TensorDict's, else the CPU
  bool pin_memory = false;             // page-locked CPU storage (needs an accelerator backend)
  bool share_memory = false;           // CPU storage in POSIX shared memory (torch's fd strategy)
  int num_threads = 1;                 // > 1: CPU leaves are copied by that many threads (0 = 1)
  /// Write the storage into this file, memory-mapped, with the metadata after it (the
  /// reference's file layout, docs/wire-format.md §3.5): the result's leaves are views of the
  /// shared mapping, so writes reach the file. Exclusive with a device other than the CPU.
  std::optional<std::string> filename{};
};

/// One entry of a node's "leaves": [dtype, shape, start, stop, pad]. start and stop are byte
/// offsets into the whole storage (absolute at every level), stop - start = nbytes + pad.
struct LeafMetadata {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t start = 0;
  int64_t stop = 0;
  int64_t pad = 0;
  bool operator==(const LeafMetadata&) const = default;
};

/// One entry of a node's "non_tensors": [data, batch_size, device], a NonTensorData entry of
/// that level (rebuild() restores it).
struct NonTensorMetadata {
  JsonValue data;
  std::vector<int64_t> batch_size;
  std::optional<std::string> device;
  /// A MetaData rather than a NonTensorData. The reference records no class here; ours says
  /// so where the format leaves room (a pickled list instead of a tuple, docs/wire-format.md
  /// §3.7), so that a MetaData stays one between peers of ours.
  bool metadata = false;
  bool operator==(const NonTensorMetadata&) const = default;
};

/// A node's "cls_metadata". A TensorDict node's is {"device", "names", "batch_size",
/// "is_locked"}; a lazy stack's or a NonTensorStack's {"stack_dim", "stack_dim_name",
/// "is_locked"}, and its batch_size here is the stack's (its members' with the stack dim),
/// which the wire leaves out.
struct ClsMetadata {
  std::optional<std::string> device;              // str(device) or null
  std::vector<std::optional<std::string>> names;  // one per batch dim; null when unnamed
  std::vector<int64_t> batch_size;
  bool is_locked = false;                     // as it was before consolidate() locked its result
  int64_t stack_dim = 0;                      // lazy stacks only
  std::optional<std::string> stack_dim_name;  // lazy stacks only
  bool operator==(const ClsMetadata&) const = default;
};

/// The cls of a lazy stack's node, whose children are its members keyed "0", "1", ... and
/// which has no leaves or non-tensors of its own.
inline constexpr std::string_view kLazyStackCls = "LazyStackedTensorDict";
/// The cls of a NonTensorStack's node: its members keyed "0", "1", ..., each a "non_tensors"
/// entry (a NonTensorData) or a child node (a NonTensorStack); no leaves.
inline constexpr std::string_view kNonTensorStackCls = "NonTensorStack";

/// The metadata of one collection node, root or nested, in the reference's structure and
/// order: cls, non_tensors, leaves, cls_metadata, then the nested nodes by local key.
struct Metadata {
  // "TensorDict", kLazyStackCls, or "module.qualname" where a peer's pickle named a class (the
  // reference's tensorclass node): such a node is rebuilt as a TensorDict and written as
  // "TensorDict".
  std::string cls = "TensorDict";
  bool is_lazy_stack() const { return cls == kLazyStackCls; }
  bool is_non_tensor_stack() const { return cls == kNonTensorStackCls; }
  /// A node whose cls_metadata is a stack's (stack_dim, stack_dim_name, is_locked).
  bool is_stack() const { return is_lazy_stack() || is_non_tensor_stack(); }
  std::vector<std::pair<std::string, NonTensorMetadata>> non_tensors;
  std::vector<std::pair<std::string, LeafMetadata>> leaves;
  ClsMetadata cls_metadata;
  std::vector<std::pair<std::string, Metadata>> children;
  bool operator==(const Metadata&) const = default;
};

/// What a consolidated TensorDict level carries (TensorDict::consolidated_state()). Immutable
/// once made (a change of the TensorDict makes a new state), so what is derived from it is kept.
struct ConsolidatedState {
  ConsolidatedState(at::Tensor storage, std::shared_ptr<const Metadata> metadata)
      : storage(std::move(storage)), metadata(std::move(metadata)) {}

  at::Tensor storage;                        // the whole flat uint8 storage
  std::shared_ptr<const Metadata> metadata;  // this level's node (offsets absolute in storage)

  /// metadata_to_json(*metadata, sort_keys=true): the schema the pipe compares. Made on first
  /// use, by one thread, and kept; safe to call from any thread.
  const std::string& sorted_json() const;

 private:
  mutable std::once_flag sorted_json_once_;
  mutable std::string sorted_json_;
};

/// A scalar JSON value, for the transport fields ("_total_bytes", "_device", ...) that
/// transports add at the top level of the metadata.
using JsonScalar = std::variant<std::nullptr_t, bool, int64_t, std::string>;
using TransportFields = std::vector<std::pair<std::string, JsonScalar>>;

/// Bounds on metadata from a peer.
inline constexpr int kMaxMetadataDepth = 64;             // nested levels below the root
inline constexpr int64_t kMaxMetadataEntries = 1 << 20;  // leaves + nodes + non-tensors
inline constexpr size_t kMaxMetadataJsonBytes = size_t{256} << 20;

/// A consolidated copy of `td`: one uint8 storage holding every leaf in depth-first insertion
/// order, each C-contiguous and followed by zero bytes up to a multiple of 8; the result's
/// leaves (nested levels included) are views of it. The result is locked and carries the state
/// at its root, as the reference's does. Non-tensor entries take no bytes: each node's
/// "non_tensors" records them, and the result keeps them where `td` has them. Returns `td`
/// itself when it is already consolidated. Throws ValueError for a dtype the wire cannot name
/// (float8, quantized, ...), a leaf whose offset cannot be viewed as its dtype (a complex128
/// starting at 8 mod 16: the reference raises too), a nested key that collides with the metadata's
/// own names, or bad options; TypeError for a sparse or nested-tensor leaf. Blocks until every copy
/// is done.
TensorDict consolidate(const TensorDict& td, const ConsolidateOptions& options = {});

/// True when `td` carries a consolidated state (see TensorDict::consolidated_state()) and its
/// entries are still the views that state describes. A change of any level's entries (set,
/// erase, ... through the root or a nested level's own handle) is seen; after one, the leaves
/// are checked again (O(leaves)), otherwise the call is O(levels). A leaf tensor changed in
/// place through its own handle (Tensor.set_, resize_, unsqueeze_, ...) is not seen, as in the
/// reference: its storage would then no longer hold that leaf.
bool is_consolidated(const TensorDict& td);

/// The flat storage of a consolidated TensorDict (RuntimeError otherwise).
at::Tensor consolidated_storage(const TensorDict& td);
/// The metadata of a consolidated TensorDict's level (RuntimeError otherwise).
std::shared_ptr<const Metadata> consolidated_metadata(const TensorDict& td);

/// The metadata consolidate(td) would record, without copying anything.
Metadata metadata_of(const TensorDict& td);

/// Validates `metadata` (dtypes, shapes, ranges, alignment, overlaps, keys, bounds; ValueError
/// naming the key path otherwise) and returns the storage size it needs: the largest stop.
int64_t metadata_storage_bytes(const Metadata& metadata);

/// The metadata as Python's json.dumps(metadata, sort_keys=sort_keys) writes it, byte for byte
/// (", " and ": " separators, ASCII only). `transport` fields are added at the top level (after
/// the nodes when unsorted, as the reference inserts them). ValueError for keys that are not
/// valid UTF-8.
std::string metadata_to_json(const Metadata& metadata, bool sort_keys = false,
                             const TransportFields& transport = {});

/// Parses metadata JSON from an untrusted peer and validates it as metadata_storage_bytes
/// does; ValueError on any fault. Top-level keys that start with "_" and do not hold an object
/// are transport fields: they are returned in `transport` (if given; a float, list or object
/// value comes back as null), never read as nodes. Any other key holding a non-object is an
/// error, except "size" (the file variant's), which is ignored as the reference ignores it.
Metadata metadata_from_json(std::string_view text, TransportFields* transport = nullptr);

/// Options of from_consolidated().
struct FromConsolidatedOptions {
  /// The file's metadata may not be longer than this (it is read into memory); the leaves are
  /// mapped, not read.
  int64_t max_metadata_bytes = int64_t{256} << 20;
};

/// Reads a file written by consolidate(filename=...) (ours or the reference's): the leaves are
/// views of a private (copy-on-write) mapping of the file, so writes do not reach it, as in the
/// reference. The file is untrusted: its trailer, its metadata and every leaf's range are
/// checked against its size before anything is mapped or viewed; a truncated, forged or missing
/// file is a RuntimeError naming the file (the reference's type for such files).
/// A file truncated after it was mapped makes reads of the leaves fault (SIGBUS), as with any
/// mapping: docs/reliability.md.
TensorDict from_consolidated(const std::string& filename,
                             const FromConsolidatedOptions& options = {});

/// A TensorDict whose leaves are views of `storage` (a 1-D contiguous uint8 tensor), laid out
/// as `metadata` says. The metadata is validated against the storage first (ValueError on any
/// fault; nothing is read out of bounds). Every level carries the state {storage, its own
/// node}, as the reference's rebuild does. A node with a device gets the storage's device.
/// Levels with is_locked are locked. Non-null names are kept in the metadata only. Each level
/// lists its non-tensor entries (NonTensorData, a device label becoming the storage's device)
/// first, then its leaves, then its nested levels: the reference's rebuild order.
TensorDict rebuild(Metadata metadata, const at::Tensor& storage);

}  // namespace tensordict
