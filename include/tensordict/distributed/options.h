#pragma once
// Options of the transfer calls (point-to-point, init_remote, collectives), named like the
// reference's keyword arguments, and the Group handle they take.

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tensordict::dist {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// A process group as the transfer calls take it: a c10d::ProcessGroup (the default group, one
/// from new_group(), or one the caller built and never registered), or a bare c10d::Backend
/// such as a ProcessGroupGloo built on a store (what Python's `ProcessGroupGloo(...)` returns).
/// An empty Group means "the default process group", like Python's `group=None`. A Group is a
/// reference-counted handle; copying it is cheap and shares the group.
class Group {
 public:
  Group() = default;
  Group(std::nullptr_t) {}  // NOLINT: `.group = nullptr` reads like Python's group=None
  template <typename T>
    requires std::derived_from<T, c10d::ProcessGroup> || std::derived_from<T, c10d::Backend>
  Group(c10::intrusive_ptr<T> group) {  // NOLINT: implicit, so any c10d pointer converts
    if constexpr (std::derived_from<T, c10d::ProcessGroup>) {
      process_group_ = std::move(group);
    } else {
      backend_ = std::move(group);
    }
  }

  explicit operator bool() const { return process_group_ || backend_; }
  bool operator==(const Group& other) const {
    return process_group_ == other.process_group_ && backend_ == other.backend_;
  }
  /// Null unless this holds a ProcessGroup.
  const ProcessGroupPtr& process_group() const { return process_group_; }
  /// Null unless this holds a bare Backend.
  const BackendPtr& backend() const { return backend_; }

  /// This process's rank in the group, and the group's size (the group must be non-empty).
  int rank() const;
  int size() const;
  /// The c10d calls, on the ProcessGroup (through the dispatcher, as Python's
  /// `group.send([t], peer, tag)` does) or straight on the Backend. Non-blocking.
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) const;
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) const;
  /// The c10d collectives, likewise; `root` is a group rank. Non-blocking. They take what of
  /// c10d's options structs we use (the root, the op), so that those never meet ours.
  WorkPtr broadcast(std::vector<at::Tensor>& tensors, int root) const;
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs,
                    std::vector<at::Tensor>& inputs) const;
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  int root) const;
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 int root) const;
  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) const;
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int root) const;

 private:
  ProcessGroupPtr process_group_;
  BackendPtr backend_;
};

// Timeouts: every options struct has `timeout`, the longest the call waits for its messages,
// all of them together. Unset, each wait runs under the group's own timeout, whose expiry
// makes Gloo close the group's connections. On expiry the call raises TimeoutError naming the
// call, the peer, what was in flight and the time waited (docs/reliability.md). A
// point-to-point call's own timeout keeps the group: its waits are aborted, what it posted
// stays posted (its receives into memory of the library's own, so the TensorDict is
// unchanged; its sends queued), and the next receive from that peer on the same tags takes
// the late message (`late`). A collective's timeout still ends the group (Gloo's collectives
// cannot be aborted).

/// What a receive does with a message that an earlier receive from the same peer, on the same
/// tags, gave up on (its timeout passed): return it (the reference's order of messages,
/// one late), or receive and drop it, then wait for the next.
enum class Late { kDeliver, kDrop };

/// Keyword arguments of send() and isend().
struct SendOptions {
  Group group{};                       // empty: the default process group
  std::optional<int64_t> group_dst{};  // receiver's rank in `group` (exclusive with dst)
  int64_t init_tag = 0;                // tag of the first leaf; leaf i uses init_tag + i
  bool pseudo_rand = false;            // tags from the reference's generator, seeded by init_tag
  bool consolidated = false;           // one message carrying the consolidated storage
  /// Our extension (default off, so the wire stays the reference's): a header and the schema
  /// (keys, dtypes, shapes) go first, so that a receiver whose TensorDict differs raises an
  /// error naming the difference instead of being aborted or half-filled. Both sides must
  /// pass it; see docs/reliability.md.
  bool checked = false;
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
};

/// Keyword arguments of recv() and irecv(); the sender's values must be passed.
struct RecvOptions {
  Group group{};                       // empty: the default process group
  std::optional<int64_t> group_src{};  // sender's rank in `group` (exclusive with src)
  int64_t init_tag = 0;
  bool pseudo_rand = false;
  bool consolidated = false;
  bool checked = false;  // must match the sender's (see SendOptions::checked)
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
  Late late = Late::kDeliver;                          // see "Timeouts" above
};

/// The largest storage a peer may make this process receive when it sends a TensorDict whose
/// structure the receiver does not know (from_remote_init, broadcast, all_gather, scatter) and
/// the call leaves `max_total_bytes` unset: half of this machine's physical memory, so that
/// what passes the check can be held. The peer's "_total_bytes" is refused above it
/// (ValueError) before anything is allocated; pass max_total_bytes for more.
int64_t default_max_total_bytes();

/// Keyword arguments of init_remote().
struct InitRemoteOptions {
  Group group{};                       // empty: the default process group
  std::optional<int64_t> group_dst{};  // receiver's rank in `group` (exclusive with dst)
  /// Point-to-point: the device of the two framing messages (sizes and pickle), as
  /// send_object_list's `device`; default CPU. With use_broadcast: the storage's device when
  /// the TensorDict must be consolidated first.
  std::optional<at::Device> device{};
  bool use_broadcast = false;  // broadcast to the whole group instead (dst ignored)
  /// A tensorclass's "<module>.<qualname>", sent as the metadata's "_tensorclass_type" so that
  /// the receiver can rebuild that class, as the reference's tensorclass init_remote does.
  std::optional<std::string> tensorclass_type{};
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
};

/// Keyword arguments of from_remote_init().
struct FromRemoteInitOptions {
  Group group{};
  std::optional<int64_t> group_src{};  // sender's rank in `group` (exclusive with src)
  /// The result's device (and, point-to-point, the framing messages'). Default: the CPU
  /// point-to-point; the sender's storage device with use_broadcast, if this process has it.
  std::optional<at::Device> device{};
  bool use_broadcast = false;                          // must match the sender's
  std::optional<int64_t> max_total_bytes{};            // unset: default_max_total_bytes()
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
  Late late = Late::kDeliver;                          // point-to-point only; see "Timeouts" above
};

/// Keyword arguments of broadcast().
struct BroadcastOptions {
  Group group{};
  std::optional<int64_t> group_src{};  // the source's rank in `group` (exclusive with src)
  /// On the source: the storage's device if the TensorDict must be consolidated. Elsewhere:
  /// the result's device (default: the source's storage device, if this process has it).
  std::optional<at::Device> device{};
  std::optional<int64_t> max_total_bytes{};  // unset: default_max_total_bytes()
  /// On the source: a tensorclass's "<module>.<qualname>", sent as "_tensorclass_type".
  std::optional<std::string> tensorclass_type{};
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
};

/// Keyword arguments of all_gather().
struct AllGatherOptions {
  Group group{};
  std::optional<int64_t> max_total_bytes{};  // bound on each rank's storage (unset: the default)
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
};

/// Keyword arguments of scatter().
struct ScatterOptions {
  Group group{};
  std::optional<int64_t> group_src{};  // the source's rank in `group` (exclusive with src)
  std::optional<at::Device> device{};  // receivers: the result's device (default: the source's)
  std::optional<int64_t> max_total_bytes{};  // bound on the padded storage (unset: the default)
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
};

/// Keyword arguments of gather_and_stack().
struct GatherAndStackOptions {
  Group group{};
  std::optional<int64_t> group_dst{};  // the destination's rank in `group` (exclusive with dst)
  std::optional<int64_t> max_total_bytes{};            // destination: bound on each rank's storage
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
};

/// Keyword arguments of all_reduce() and all_reduce_async().
struct AllReduceOptions {
  c10d::ReduceOp op = c10d::ReduceOp::SUM;
  bool async_op = false;  // all_reduce(): post every leaf, then wait on them all
  Group group{};
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
  /// Pack the leaves of one device and dtype into flat buckets of at most this many bytes and
  /// reduce one bucket per collective, as the reference's bucket_bytes (collectives.h). Every
  /// rank must pass the same value: ranks whose buckets differ post collectives of different
  /// sizes, and Gloo aborts a rank (docs/collectives.md).
  std::optional<int64_t> bucket_bytes{};
  /// Ours, off the reference's wire: first all-gather a hash of each rank's bucket layout (the
  /// sizes and dtypes of the collectives it will post) and raise ValueError naming
  /// bucket_bytes on every rank when they differ, instead of Gloo's abort. Costs one small
  /// collective; every rank of the group must pass it (a reference rank cannot).
  bool check_buckets = false;
};

/// Keyword arguments of reduce() and reduce_premature().
struct ReduceOptions {
  c10d::ReduceOp op = c10d::ReduceOp::SUM;
  bool async_op = false;  // reduce(): post every leaf, then wait on them all
  Group group{};
  std::optional<int64_t> group_dst{};  // destination's rank in `group` (exclusive with dst)
  std::optional<std::chrono::milliseconds> timeout{};  // see "Timeouts" above
  std::optional<int64_t> bucket_bytes{};               // as AllReduceOptions::bucket_bytes
  bool check_buckets = false;                          // as AllReduceOptions::check_buckets
};

}  // namespace tensordict::dist
