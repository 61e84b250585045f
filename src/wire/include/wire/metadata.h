#pragma once
// Private: metadata from an already parsed JSON-like tree (the JSON text's or a pickle's), so
// that both codecs share one reader, its validation and its bounds.

#include <cstddef>
#include <cstdint>

#include "tensordict/consolidate.h"
#include "tensordict/pickle.h"

namespace tensordict::detail {

/// Bounds on the tree of a peer's metadata: node nesting, plus a node's fields, a leaf or
/// non-tensor entry and the data of a non-tensor entry; and the number of values.
inline constexpr size_t kMaxMetadataJsonDepth = 2 * kMaxMetadataDepth + 16;
inline constexpr size_t kMaxMetadataJsonValues = 8 * static_cast<size_t>(kMaxMetadataEntries);

/// Whether a Metadata::cls is "module.qualname" from a peer's pickled class reference (a
/// tensorclass node: rebuilt as a TensorDict node, written back as "TensorDict"), rather than a
/// class name of the reference's CLS_MAP (which never holds a dot).
inline bool is_class_reference_name(std::string_view cls) {
  return cls.find('.') != std::string_view::npos && pickle::valid_dotted_name(cls);
}

/// metadata_from_json after parsing: the same reading, validation and errors.
Metadata metadata_from_value(const JsonValue& value, TransportFields* transport);

}  // namespace tensordict::detail
