#include "peer.h"

#include <c10/util/Exception.h>

#include <string_view>

#include "tensordict/distributed/process_group.h"

namespace tensordict::dist::detail {

void check_p2p_peer(const std::optional<int64_t>& peer, const std::optional<int64_t>& group_peer,
                    const Group& group, const char* peer_name, const char* group_peer_name) {
  if (group_peer) {
    TORCH_CHECK_VALUE(group, "`", group_peer_name, "` requires `group` to be passed.");
    TORCH_CHECK_VALUE(!peer, "`", peer_name, "` and `", group_peer_name,
                      "` are mutually exclusive.");
  } else {
    TORCH_CHECK_VALUE(peer, "Exactly one of `", peer_name, "` and `", group_peer_name,
                      "` must be provided.");
  }
}

Group resolve_group(const Group& group) { return group ? group : Group(default_group()); }

Peer resolve_peer(const char* call, const std::optional<int64_t>& peer,
                  const std::optional<int64_t>& group_peer, const Group& group,
                  const char* peer_name, const char* group_peer_name, bool refuse_self) {
  check_p2p_peer(peer, group_peer, group, peer_name, group_peer_name);
  check_group_member(group, call);
  Peer out{group, 0};
  int64_t rank = 0;
  if (group_peer) {
    rank = *group_peer;  // straight to the given group's backend, registered or not
  } else {
    out.group = resolve_group(group);
    rank = get_group_rank(out.group, *peer);
  }
  const int size = out.group.size();
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, call, ": ", group_peer ? group_peer_name : peer_name,
                    " = ", group_peer ? *group_peer : *peer, " is not a rank of the group (size ",
                    size, ")");
  if (refuse_self && !group_peer) {
    // torch.distributed.send's and recv's _check_not_self_rank (Gloo has no pair to itself).
    const char* role = std::string_view(peer_name) == "src" ? "source" : "destination";
    TORCH_CHECK_VALUE(rank != out.group.rank(), "Invalid ", role, " rank: ", role,
                      " rank should not be the same as the rank of the current process.");
  }
  out.rank = static_cast<int>(rank);
  return out;
}

}  // namespace tensordict::dist::detail
