#pragma once
// c10d works as the transfer calls post and wrap them: posting a batch (post_all, abandon), a
// leaf through a contiguous stand-in (post_in_place), the checks a leaf passes first, and the
// four wrappers: a work with a step of ours after it (then), a work handed to a caller that
// raises the typed errors (typed_works), and a message's work that a timeout parks
// (MessageWork, AdoptedWork). Private to the c10d layer.

#include <ATen/ATen.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "late.h"
#include "tensordict/distributed/options.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::dist::detail {

/// Describes work i of a batch for a timeout's message ("tag 3 (key 'a')").
using InFlight = std::function<std::string(size_t)>;

/// Works handed to a caller, who waits on them itself (all_reduce_async, reduce_premature,
/// isend_early, irecv_premature): each wrapped so that its wait() raises what a Waiter's
/// would, a TimeoutError for a timeout and a PeerLostError for a lost connection (Gloo's own
/// exceptions are untyped, gloo_errors.h), naming `call`, `peer` ("rank 1", "the group") and
/// `what(i)`. With `keeps_group` (point-to-point works), a wait(timeout) that times out aborts
/// the wait and raises TimeoutError, the work still posted, instead of letting Gloo's wait
/// expire (which closes the group).
std::vector<WorkPtr> typed_works(const char* call, const std::string& peer,
                                 std::vector<WorkPtr> works, const InFlight& what,
                                 bool keeps_group);

/// Aborts and drains works already posted, ignoring their errors (cleanup before a rethrow).
void abandon(const std::vector<WorkPtr>& works);

/// Posts count works through post(i); if posting throws midway, what was posted is abandoned.
template <typename Post>
std::vector<WorkPtr> post_all(size_t count, Post&& post) {
  std::vector<WorkPtr> works;
  works.reserve(count);
  try {
    for (size_t i = 0; i < count; ++i) {
      works.push_back(post(i));
    }
  } catch (...) {
    abandon(works);
    throw;
  }
  return works;
}

/// Gloo moves contiguous buffers only: `leaf`, or a contiguous copy of it.
at::Tensor sendable(const at::Tensor& leaf);

/// Runs an in-place operation on `leaf` (a receive, a reduction) through a contiguous
/// stand-in when the leaf is not contiguous: post(buffer) posts it, and the returned work's
/// wait() copies the buffer into the leaf. The stand-in starts as a copy of the leaf when
/// `reads_leaf` (a reduction), uninitialised otherwise (a receive). Contiguous leaves are
/// passed to post as they are.
template <typename Post>
WorkPtr post_in_place(const at::Tensor& leaf, bool reads_leaf, Post&& post);

/// ValueError naming the key when one of `leaves` (td's) cannot travel: meta, sparse, nested
/// or quantized (check_transferable). Keys are looked up only for a refused leaf.
void check_leaves(const char* call, const TensorDict& td, const std::vector<at::Tensor>& leaves);

/// ValueError when `leaf`'s elements share memory (an expanded tensor): an in-place transfer
/// into it would be ill-defined. `action` ("receive into") and `who` ("receiver") word it.
void check_writable(const char* call, const at::Tensor& leaf, const char* action, const char* who);

/// A work that waits for every one of `inner` (which fill `buffer`), then copies `buffer`
/// into `leaf`.
WorkPtr copy_back_work(std::vector<WorkPtr> inner, at::Tensor leaf, at::Tensor buffer);

/// A work that waits for every one of `inner`, then runs `finish` once (without grad), in the
/// first wait() that sees them done; result() is `result`.
WorkPtr then(std::vector<WorkPtr> inner, std::function<void()> finish,
             std::vector<at::Tensor> result);

/// A posted message's work (late.h): marks the message done once a wait succeeds. A receive
/// posted with room that a longer message ran into is a MalformedPeerDataError naming `call`,
/// unless the message is only being dropped (`check` false).
class MessageWork : public c10d::Work {
 public:
  explicit MessageWork(MessagePtr m, const char* call = nullptr, bool check = true);
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  bool isCompleted() override { return m_->done; }
  int sourceRank() const override { return m_->work->sourceRank(); }
  void abort() override { m_->work->abort(); }

 protected:
  MessagePtr m_;
  const char* call_;
  bool check_;
};

/// A parked receive taken over into the caller's memory: waits for the message, then copies its
/// bytes into `dest` once.
class AdoptedWork : public MessageWork {
 public:
  AdoptedWork(MessagePtr m, at::Tensor dest, const char* call);
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  bool isCompleted() override { return MessageWork::isCompleted() && !dest_.defined(); }

 private:
  at::Tensor dest_;  // undefined once copied
};

// ---- implementation -----------------------------------------------------------------------------

template <typename Post>
WorkPtr post_in_place(const at::Tensor& leaf, bool reads_leaf, Post&& post) {
  if (leaf.is_contiguous()) {
    return post(leaf);
  }
  at::Tensor buffer =
      reads_leaf ? leaf.contiguous() : at::empty_like(leaf, at::MemoryFormat::Contiguous);
  WorkPtr inner = post(buffer);
  return copy_back_work({std::move(inner)}, leaf, std::move(buffer));
}

}  // namespace tensordict::dist::detail
