#include "peer.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "tensordict/distributed/process_group.h"

namespace tensordict::dist::detail {
namespace {

// Works on a contiguous stand-in (one receive, or the chunks of a checked one); wait() waits
// for them all, then copies the stand-in into the real leaf.
class CopyBackWork : public c10d::Work {
 public:
  CopyBackWork(std::vector<WorkPtr> inner, at::Tensor leaf, at::Tensor buffer)
      : c10d::Work(-1, c10d::OpType::UNKNOWN),
        inner_(std::move(inner)),
        leaf_(std::move(leaf)),
        buffer_(std::move(buffer)) {}

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    for (const auto& w : inner_) {
      if (!w->wait(timeout)) return false;
    }
    if (!copied_) {
      at::NoGradGuard no_grad;
      leaf_.copy_(buffer_);
      copied_ = true;
    }
    return true;
  }
  bool isCompleted() override {
    return std::all_of(inner_.begin(), inner_.end(),
                       [](const auto& w) { return w->isCompleted(); });
  }
  bool isSuccess() const override {
    return std::all_of(inner_.begin(), inner_.end(), [](const auto& w) { return w->isSuccess(); });
  }
  std::exception_ptr exception() const override {
    for (const auto& w : inner_) {
      if (auto e = w->exception()) return e;
    }
    return nullptr;
  }
  int sourceRank() const override { return inner_.front()->sourceRank(); }
  std::vector<at::Tensor> result() override { return {leaf_}; }
  void abort() override {
    for (const auto& w : inner_) w->abort();
  }

 private:
  std::vector<WorkPtr> inner_;
  at::Tensor leaf_;
  at::Tensor buffer_;
  bool copied_ = false;
};

}  // namespace

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
  Peer out{group, 0};
  int64_t rank = 0;
  if (group_peer) {
    rank = *group_peer;  // straight to the given group's backend, registered or not
  } else {
    out.group = resolve_group(group);
    rank = get_group_rank(out.group, *peer);
  }
  const int size = out.group.size();
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, call, ": ",
                    group_peer ? group_peer_name : peer_name, " = ",
                    group_peer ? *group_peer : *peer, " is not a rank of the group (size ", size,
                    ")");
  if (refuse_self && !group_peer) {
    // torch.distributed.send's _check_not_self_rank.
    TORCH_CHECK_VALUE(rank != out.group.rank(),
                      "Invalid destination rank: destination rank should not be the same as the "
                      "rank of the current process.");
  }
  out.rank = static_cast<int>(rank);
  return out;
}

namespace {

// Gloo's own errors (gloo::IoException, e.g. "Connection reset by peer") reach Work::wait() as
// plain std::exceptions; callers get them as c10d's DistBackendError, like every other
// transport failure.
std::exception_ptr as_backend_error(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error&) {
    return e;
  } catch (const std::exception& x) {
    try {
      C10_THROW_ERROR(DistBackendError, x.what());
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
  }
  return e;
}

}  // namespace

void wait_all(const std::vector<WorkPtr>& works) {
  std::exception_ptr first;
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      works[i]->wait();
    } catch (...) {
      if (!first) {
        first = as_backend_error(std::current_exception());
        for (size_t j = i + 1; j < works.size(); ++j) {
          try {
            works[j]->abort();
          } catch (...) {
          }
        }
      }
    }
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

void abandon(const std::vector<WorkPtr>& works) {
  for (const auto& w : works) {
    try {
      w->abort();
      w->wait();
    } catch (...) {
    }
  }
}

at::Tensor sendable(const at::Tensor& leaf) {
  return leaf.is_contiguous() ? leaf : leaf.contiguous();
}

void check_writable(const char* call, const at::Tensor& leaf, const char* action,
                    const char* who) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(leaf) != at::MemOverlap::Yes, call, ": cannot ",
                    action, " a leaf whose elements share memory (an expanded tensor); give the ",
                    who, " a leaf of its own");
}

WorkPtr copy_back_work(std::vector<WorkPtr> inner, at::Tensor leaf, at::Tensor buffer) {
  TORCH_INTERNAL_ASSERT(!inner.empty());
  return c10::make_intrusive<CopyBackWork>(std::move(inner), std::move(leaf), std::move(buffer));
}

}  // namespace tensordict::dist::detail
