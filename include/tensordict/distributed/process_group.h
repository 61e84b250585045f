#pragma once
// The process-group layer: torch.distributed's init_process_group / new_group / rank queries in
// C++, over c10d. Groups are laid out in the store the way torch.distributed lays them out
// (prefixes "default_pg", "<group name>/", "cpu/"), so Python ranks can share a group with C++
// ranks.
//
// Thread-safety: the registry behind these functions is guarded by a mutex; creating and
// destroying groups concurrently with transfers on those groups is the caller's problem, as in
// torch.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tensordict/distributed/options.h"

namespace tensordict::dist {

/// torch.distributed's default_pg_timeout.
inline constexpr std::chrono::milliseconds kDefaultGroupTimeout = std::chrono::minutes(30);

/// Arguments of init_process_group, named like torch.distributed's.
struct InitOptions {
  std::string backend = "gloo";        // any c10d backend this build has (a CPU wheel: gloo)
  std::string init_method = "env://";  // "env://", "tcp://host:port" or "file:///path"
  int64_t rank = -1;                   // -1: from the RANK environment variable
  int64_t world_size = -1;             // -1: from WORLD_SIZE
  std::chrono::milliseconds timeout = kDefaultGroupTimeout;
  /// A store to use instead of init_method (it is wrapped in the "default_pg" prefix).
  c10::intrusive_ptr<c10d::Store> store{};
  /// Address the Gloo device binds to (e.g. "127.0.0.1"); empty: GLOO_SOCKET_IFNAME, else
  /// this machine's hostname, as torch does.
  std::string gloo_hostname{};
};

/// Builds the store and the default process group, and registers it. Blocks until every rank
/// joins (or the timeout passes). ValueError for bad arguments; RuntimeError if a default
/// group exists already or the rendezvous fails.
void init_process_group(const InitOptions& options = {});

/// True once init_process_group has succeeded (and until destroy_process_group()).
bool is_initialized();

/// The default process group; ValueError when there is none.
ProcessGroupPtr default_group();

/// A registered subgroup of the default group over `ranks` (global ranks; empty: all). Like
/// torch, every rank of the default group must call it, in the same order as the other
/// new_group calls; ranks outside `ranks` get non_group_member(). Group rank i is the i-th
/// smallest global rank. Blocks until the members have joined.
ProcessGroupPtr new_group(std::vector<int64_t> ranks = {},
                          std::optional<std::chrono::milliseconds> timeout = std::nullopt);

/// What new_group() gives a rank outside the new group (torch's GroupMember.NON_GROUP_MEMBER):
/// a handle that every transfer and query refuses with a ValueError saying so. (A null pointer
/// would mean "the default group" to the calls that take a Group.)
const ProcessGroupPtr& non_group_member();
/// ValueError, naming `call`, when `group` is non_group_member(). Every call that takes a Group
/// checks it.
void check_group_member(const Group& group, const char* call);

/// This process's rank in `group` (empty: the default group). Works on unregistered groups.
int64_t get_rank(const Group& group = {});
/// The size of `group` (empty: the default group).
int64_t get_world_size(const Group& group = {});

/// Global rank -> rank in `group`, for the default group (identity) and groups from
/// new_group(). ValueError, with torch's texts, for an unregistered group or a rank outside it.
int64_t get_group_rank(const Group& group, int64_t global_rank);
/// Rank in `group` -> global rank, the inverse of get_group_rank.
int64_t get_global_rank(const Group& group, int64_t group_rank);
/// The global ranks of a registered group, ordered by group rank.
std::vector<int64_t> get_process_group_ranks(const Group& group);

/// A standalone Gloo group over `store`, registered nowhere: Python's
/// `ProcessGroupGloo(store, rank, size, timeout)`, a bare c10d::Backend. Pass it as `group`
/// with group_dst / group_src. Blocks until all `size` ranks have joined or `timeout` passes.
/// `gloo_hostname` as in InitOptions.
BackendPtr make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             std::chrono::milliseconds timeout = kDefaultGroupTimeout,
                             const std::string& gloo_hostname = "");

/// Shuts down and unregisters `group` (a subgroup), or, given nothing, every group including
/// the default one. Waits for the group's pending work. non_group_member(): nothing to do.
void destroy_process_group(const Group& group = {});

}  // namespace tensordict::dist
