#pragma once
// Timeouts that keep the group (docs/reliability.md, "Timeouts"). Gloo closes every connection
// of a rank when one of its waits expires; Work::abort() ends a wait and closes nothing, the
// message staying posted. So a call's deadline ends its waits by aborting them, never by
// letting Gloo's own timeout pass, and what a timed-out call posted is parked here: its
// receives (landing in memory the library owns) until a later call from the same peer takes
// them, its sends until they complete. A posted message must keep its buffer until it
// completes: Gloo writes into it whenever the peer's bytes come. Private to the c10d layer.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/distributed/options.h"
#include "wire/tail_stamp.h"

namespace tensordict::dist::detail {

using Clock = std::chrono::steady_clock;

/// Waits for `work` until `deadline`: true once it completed, false when the deadline passed
/// first (the work is then still posted; wait again later). Throws what the work's wait
/// throws (a lost peer). Gloo's own timeout never expires in it: the deadline aborts the wait.
/// `work` must be abortable: a point-to-point work of Gloo, or a wrapper of them.
bool wait_until(const WorkPtr& work, Clock::time_point deadline);

using wire::room_for;
using wire::TailStamp;
using wire::with_room;

/// One message a call with a deadline posted, and the memory it lands in or is read from.
struct PostedMessage {
  WorkPtr work;       // the message's own work (Gloo's)
  at::Tensor buffer;  // a receive's buffer (memory the library owns), or a send's tensor
  std::vector<TailStamp> stamps;    // a receive's stamps in `buffer`, set before it was posted
  std::optional<TailStamp> beyond;  // in the room after `buffer`, when it was posted with room
  int tag = 0;
  bool is_recv = true;
  bool done = false;   // a wait on `work` succeeded
  bool taken = false;  // parked by an earlier call, then taken by a later one

  /// After the receive completed: whether the message ran past `buffer` into its room.
  bool long_message() const { return beyond && wire::long_message(*beyond); }
};
using MessagePtr = std::shared_ptr<PostedMessage>;

/// What identifies a group in the registries (the parked messages, publication's channels): a
/// weak reference to its ProcessGroup or Backend. While one exists the group's memory is not
/// reused, so no later group can take its address; once the group ends, expired() says so and
/// its entries are released (within a second, by the registry's thread).
class GroupKey {
 public:
  explicit GroupKey(const Group& group);
  bool expired() const;
  bool operator<(const GroupKey& other) const { return address_ < other.address_; }
  bool operator==(const GroupKey& other) const { return address_ == other.address_; }

 private:
  std::optional<c10::weak_intrusive_ptr<c10d::ProcessGroup>> process_group_;
  std::optional<c10::weak_intrusive_ptr<c10d::Backend>> backend_;
  const void* address_ = nullptr;
};

/// The parked messages, per group and peer, in posting order, for as long as the group lives:
/// a group that ends releases them (its receives' buffers, its sends' tensors), so a later
/// group never meets them.
class LateMessages {
 public:
  /// The most receives parked per group and peer; a call that would post more refuses first.
  static constexpr size_t kMaxParked = 1024;

  static LateMessages& get();

  /// Parks what a call posted to or from `peer` of `group` when its deadline passed: receives
  /// taken from here go back to the front, in their order (they are older than the rest),
  /// fresh ones to the back; sends are kept until they complete or the group ends.
  void park(const GroupKey& group, int peer, const std::vector<MessagePtr>& messages);

  /// The oldest parked receive from `peer` on `tag`, taken out, or null. Gloo matches a
  /// peer's messages on one tag in posting order: the next message on `tag` lands in it.
  MessagePtr take(const GroupKey& group, int peer, int tag);

  /// Every parked receive from `peer` on one of `tags`, taken out, oldest first.
  std::vector<MessagePtr> take_all(const GroupKey& group, int peer, const std::vector<int>& tags);

  /// Whether a receive from `peer` on one of `tags` is parked. Costs one atomic load when
  /// nothing is parked.
  bool has(const GroupKey& group, int peer, const std::vector<int>& tags) const;

  /// ValueError naming `call` and `who` when kMaxParked receives from `peer` are parked: a
  /// loop of timed-out receives on ever new tags would otherwise keep memory without end.
  void admit(const char* call, const GroupKey& group, int peer, const std::string& who) const;

  /// What an object leaves on the group for a later one of the same `slot` (publication's
  /// subscriber on a channel): kept until taken or the group ends. Replaces an earlier value.
  void keep(const GroupKey& group, int peer, int64_t slot, std::shared_ptr<void> value);
  std::shared_ptr<void> take_kept(const GroupKey& group, int peer, int64_t slot);

 private:
  LateMessages() = default;
  struct Impl;
  Impl& impl() const;
};

}  // namespace tensordict::dist::detail
