#pragma once
// Naming a peer by global or group rank, as torch.distributed does, for every call of the c10d
// layer that takes one. Private to the c10d layer.

#include <cstdint>
#include <optional>

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
/// `refuse_self` and a global peer, for this process's own rank (torch.distributed.send's and
/// recv's check; the Python layer, which maps global ranks itself, checks them there).
Peer resolve_peer(const char* call, const std::optional<int64_t>& peer,
                  const std::optional<int64_t>& group_peer, const Group& group,
                  const char* peer_name, const char* group_peer_name, bool refuse_self);

/// `group`, or the default group when it is empty (ValueError when there is none).
Group resolve_group(const Group& group);

}  // namespace tensordict::dist::detail
