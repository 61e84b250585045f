#pragma once
// Consolidated metadata as the pickled Python dict that the reference's object collectives
// carry (init_remote, broadcast, all_gather, scatter; docs/wire-format.md §4.2): leaf entries
// are tuples there.

#include <string>
#include <string_view>

#include "core/metadata.h"
#include "tensordict/consolidate.h"
#include "wire/pickle.h"

namespace tensordict::wire {

/// The pickle bytes of the reference's dict for `metadata`: the node structure of
/// metadata_to_json, each "leaves" and "non_tensors" entry a tuple, `transport` fields added at
/// the top; written directly, as Python's pickle.dumps(protocol=4) writes that dict (no memo).
/// ValueError for a key or string that is not valid UTF-8.
std::string metadata_pickle_bytes(const Metadata& metadata, const TransportFields& transport = {});

/// The same dict as a value (for tests and tools that edit it before sending).
pickle::Value metadata_to_pickle(const Metadata& metadata, const TransportFields& transport = {});

/// Reads metadata from a peer's unpickled dict, with exactly the validation and bounds of
/// metadata_from_json (ValueError on any fault). Top-level transport fields go to `transport`.
Metadata metadata_from_pickle(const pickle::Value& value, TransportFields* transport = nullptr);

/// The bounds a peer's metadata pickle is read under (nesting, values, memory budget).
pickle::Limits metadata_pickle_limits();

/// Reads the pickle bytes of a peer: pickle::loads under metadata_pickle_limits(), then
/// metadata_from_pickle. (read_metadata_pickle keeps the validation's result.)
Metadata metadata_from_pickle_bytes(std::string_view bytes, TransportFields* transport = nullptr);

/// A peer's metadata pickle (init_remote and the collectives, §4.2), read by the restricted
/// reader under metadata_pickle_limits() and validated.
core::ValidatedMetadata read_metadata_pickle(std::string_view bytes);

}  // namespace tensordict::wire
