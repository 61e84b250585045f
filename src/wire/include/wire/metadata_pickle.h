#pragma once
// Consolidated metadata as the pickled Python dict that the reference's object collectives
// carry (init_remote, broadcast, all_gather, scatter): leaf entries are tuples there.

#include "tensordict/consolidate.h"
#include "tensordict/pickle.h"

namespace tensordict {

/// The metadata as the reference's Python dict: the node structure of metadata_to_json, with
/// each "leaves" and "non_tensors" entry a tuple, and `transport` fields added at the top.
pickle::Value metadata_to_pickle(const Metadata& metadata, const TransportFields& transport = {});

/// Reads metadata from a peer's unpickled dict, with exactly the validation and bounds of
/// metadata_from_json (ValueError on any fault). Top-level transport fields go to `transport`.
Metadata metadata_from_pickle(const pickle::Value& value, TransportFields* transport = nullptr);

/// The bounds a peer's metadata pickle is read under (nesting, values, memory budget).
pickle::Limits metadata_pickle_limits();

/// Reads the pickle bytes of a peer: pickle::loads under metadata_pickle_limits(), then
/// metadata_from_pickle.
Metadata metadata_from_pickle_bytes(std::string_view bytes, TransportFields* transport = nullptr);

}  // namespace tensordict
