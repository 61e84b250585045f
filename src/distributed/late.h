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
#include <memory>
#include <vector>

#include "tail_stamp.h"
#include "tensordict/distributed/options.h"

namespace tensordict::dist::detail {

using Clock = std::chrono::steady_clock;

/// Waits for `work` until `deadline`: true once it completed, false when the deadline passed
/// first (the work is then still posted; wait again later). Throws what the work's wait
/// throws (a lost peer). Gloo's own timeout never expires in it: the deadline aborts the wait.
/// `work` must be abortable: a point-to-point work of Gloo, or a wrapper of them.
bool wait_until(const WorkPtr& work, Clock::time_point deadline);

/// One message a call with a deadline posted, and the memory it lands in or is read from.
struct PostedMessage {
  WorkPtr work;       // the message's own work (Gloo's)
  at::Tensor buffer;  // a receive's buffer (memory the library owns), or a send's tensor
  std::vector<TailStamp> stamps;  // a receive's stamps in `buffer`, set before it was posted
  int tag = 0;
  bool is_recv = true;
  bool done = false;   // a wait on `work` succeeded
  bool taken = false;  // parked by an earlier call, then taken by a later one
};
using MessagePtr = std::shared_ptr<PostedMessage>;

/// The parked messages, per group and peer, in posting order.
class LateMessages {
 public:
  static LateMessages& get();

  /// Parks what a call posted to or from `peer` of `group` (a Group's identity: group_key())
  /// when its deadline passed: receives taken from here go back to the front, in their order
  /// (they are older than the rest), fresh ones to the back; sends are kept until they
  /// complete.
  void park(const void* group, int peer, const std::vector<MessagePtr>& messages);

  /// The oldest parked receive from `peer` on `tag`, taken out, or null. Gloo matches a
  /// peer's messages on one tag in posting order: the next message on `tag` lands in it.
  MessagePtr take(const void* group, int peer, int tag);

  /// Every parked receive from `peer` on one of `tags`, taken out, oldest first.
  std::vector<MessagePtr> take_all(const void* group, int peer, const std::vector<int>& tags);

  /// Whether a receive from `peer` on one of `tags` is parked. Costs one atomic load when
  /// nothing is parked.
  bool has(const void* group, int peer, const std::vector<int>& tags) const;

 private:
  LateMessages() = default;
  struct Impl;
  Impl& impl() const;
};

/// What identifies a group for the registry: its ProcessGroup or Backend object.
const void* group_key(const Group& group);

}  // namespace tensordict::dist::detail
