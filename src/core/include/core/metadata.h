#pragma once
// The schema (docs/wire-format.md §3): what every metadata must satisfy, whoever made it, and its
// JSON reader (the core's public API reads and writes that form: files, metadata_from_json).
// The transports' other encoding (the pickle, src/wire/) reads into the same types. A peer's
// metadata is parsed and validated once, into ValidatedMetadata; the stages after (the storage
// transfer, rebuild) take that type and trust it.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"

namespace tensordict::core {

/// Bounds on the tree of a peer's metadata: node nesting, plus a node's fields, a leaf or
/// non-tensor entry and the data of a non-tensor entry; and the number of values.
inline constexpr size_t kMaxMetadataJsonDepth = 2 * kMaxMetadataDepth + 16;
inline constexpr size_t kMaxMetadataJsonValues = 8 * static_cast<size_t>(kMaxMetadataEntries);

/// Leaves start and end on multiples of this many bytes (docs/wire-format.md §3.1).
inline constexpr int64_t kLeafAlign = 8;

/// Whether `name` is a dotted name of ASCII identifiers ("a", "pkg.mod", "Outer.Inner"): what
/// a class reference's module and qualname must be.
bool valid_dotted_name(std::string_view name);

/// Whether a Metadata::cls is "module.qualname" from a peer's pickled class reference (a
/// tensorclass node: rebuilt as a TensorDict node, written back as "TensorDict"), rather than a
/// class name of the reference's CLS_MAP (which never holds a dot).
inline bool is_class_reference_name(std::string_view cls) {
  return cls.find('.') != std::string_view::npos && valid_dotted_name(cls);
}

/// The node fields a nested key may not be named after.
inline bool is_reserved_node_key(std::string_view key) {
  return key == "cls" || key == "non_tensors" || key == "leaves" || key == "cls_metadata";
}

/// Whether the wire names `t` (the reference's utils._TORCH_DTYPES).
bool is_wire_dtype(at::ScalarType t);

/// The device a peer's or a file's device name denotes, at::Device's grammar ("cpu", "cuda:1"),
/// or nullopt. A name longer than core::kExcerptBytes is none without asking at::Device, whose
/// error would quote the whole text (a peer's 250 MB "device").
std::optional<at::Device> parse_device_name(std::string_view name);

/// ValueError, starting with `who` and naming the leaf `where()` (called only on a fault), for a
/// dtype the consolidated format cannot carry or view (quantized).
template <typename Where>
void check_leaf_dtype(at::ScalarType t, const char* who, const Where& where) {
  TORCH_CHECK_VALUE(is_wire_dtype(t), who, ": leaf ", where(), " has dtype ", dtype_name(t),
                    ", which the consolidated format cannot carry");
  TORCH_CHECK_VALUE(!c10::isQIntType(t), who, ": leaf ", where(), " has the quantized dtype ",
                    dtype_name(t), ", which consolidate does not support");
}

/// The nested key path + key, as messages print it: 'a' or ('a', 'b'), each part through
/// core::quoted_excerpt (a peer's key may be 250 MB long).
std::string path_str(const std::vector<std::string>& path, const std::string& key);

/// ValueError, starting with `who` and naming the key, before a full write of `m` (JSON text,
/// a pickle) when its non-tensor values reuse shared values so much that the write would exceed
/// what they hold by more than kMaxJsonExpansion (core/json_text.h: JsonExpansion).
void check_written_size(const Metadata& m, const char* who);

/// A stack node's batch size (a lazy stack's or a NonTensorStack's): its members' (keyed "0",
/// "1", ..., which share one) with their count inserted at stack_dim; nullopt when the node is
/// not such a stack (validate() says why). The wire leaves it out, so readers fill it in.
std::optional<std::vector<int64_t>> stack_batch_size(const Metadata& m);

/// Validates `m` (dtypes, shapes, ranges, alignment, overlaps, keys, bounds; ValueError naming
/// the key path otherwise) for a storage of `storage_bytes` (unbounded if unset) whose first
/// byte sits `storage_offset` bytes into its allocation. Returns the largest stop.
int64_t validate(const Metadata& m, std::optional<int64_t> storage_bytes = std::nullopt,
                 int64_t storage_offset = 0);

/// Metadata that passed validate() once, with what it found: the bytes of storage the layout
/// needs, and the transport fields that came with it. Made only by the readers below (and by
/// validated()); rebuild_validated trusts it.
class ValidatedMetadata {
 public:
  const Metadata& metadata() const { return metadata_; }
  /// The metadata moved out, and the transport fields into `transport` if given; this value is
  /// spent.
  Metadata take(TransportFields* transport = nullptr) && {
    if (transport) *transport = std::move(transport_);
    return std::move(metadata_);
  }
  int64_t storage_bytes() const { return storage_bytes_; }
  const TransportFields& transport() const { return transport_; }

 private:
  friend ValidatedMetadata validated(Metadata metadata, TransportFields transport);
  Metadata metadata_;
  int64_t storage_bytes_ = 0;
  TransportFields transport_;
};

/// Validates `metadata` (ValueError on any fault) and keeps the result.
ValidatedMetadata validated(Metadata metadata, TransportFields transport = {});

/// read_metadata_json's refusal of non-tensor values beyond the value budget: a ValueError,
/// which from_consolidated keeps one (its other refusals are RuntimeErrors naming the file).
class ValueBudgetError : public c10::ValueError {
 public:
  using c10::ValueError::ValueError;
};

/// A peer's metadata JSON (the pipe's, docs/wire-format.md §6.1), parsed and validated: the
/// errors and bounds of metadata_from_json. Top-level transport fields are kept. Its non-tensor
/// values may take meta.json's value budget (kValueBytesPerTextByte per byte of `text`, plus
/// kValueAllowanceBytes), measured before they are built: ValueError beyond it.
ValidatedMetadata read_metadata_json(std::string_view text);
/// The general reader behind read_metadata_json (parse_json, then the tree), which its fast
/// path must agree with (fuzz/metadata_json.cpp checks it); ValueError as there.
ValidatedMetadata read_metadata_json_general(std::string_view text);

/// A TensorDict of views of `storage` laid out as `metadata` says, without validating again:
/// only that the storage is a 1-D contiguous uint8 tensor of at least storage_bytes() bytes
/// whose offset keeps every leaf aligned is checked (else this is rebuild()).
TensorDict rebuild_validated(ValidatedMetadata metadata, const at::Tensor& storage);

}  // namespace tensordict::core
