#include "works.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "gloo_errors.h"
#include "tensordict/errors.h"
#include "tensordict/leaf.h"
#include "tensordict/nested_key.h"
#include "wire/leaf_order.h"

namespace tensordict::dist::detail {
namespace {

// Works followed by a step of ours (a copy back from a stand-in, a bucket's values written back
// into its leaves): wait() waits for them all, then runs `finish` once.
class FinishWork : public c10d::Work {
 public:
  FinishWork(std::vector<WorkPtr> inner, std::function<void()> finish,
             std::vector<at::Tensor> result)
      : c10d::Work(-1, c10d::OpType::UNKNOWN),
        inner_(std::move(inner)),
        finish_(std::move(finish)),
        result_(std::move(result)) {}

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    for (const auto& w : inner_) {
      if (!w->wait(timeout)) return false;
    }
    if (finish_) {
      at::NoGradGuard no_grad;
      std::exchange(finish_, nullptr)();
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
  std::vector<at::Tensor> result() override { return result_; }
  void abort() override {
    for (const auto& w : inner_) w->abort();
  }

 private:
  std::vector<WorkPtr> inner_;
  std::function<void()> finish_;
  std::vector<at::Tensor> result_;
};

// A work handed to the caller: its wait() raises the typed errors (typed_works). What it
// carries is worded only when it fails.
class TypedWork : public c10d::Work {
 public:
  TypedWork(WorkPtr inner, const char* call, std::shared_ptr<const std::string> peer,
            std::shared_ptr<const InFlight> what, size_t index, bool keeps_group)
      : c10d::Work(-1, c10d::OpType::UNKNOWN),
        inner_(std::move(inner)),
        call_(call),
        peer_(std::move(peer)),
        what_(std::move(what)),
        index_(index),
        keeps_group_(keeps_group) {}

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    try {
      if (keeps_group_ && timeout != kNoTimeout) {
        // Aborted at the deadline: the work stays posted, and a later wait() may finish it.
        if (wait_until(inner_, Clock::now() + timeout)) return true;
        TD_THROW(TimeoutError, call_, ": timed out after ", timeout.count(), " ms waiting for ",
                 *peer_, ": ", (*what_)(index_),
                 ". The group stays usable and the work posted: "
                 "wait() on it again");
      }
      if (timeout == kNoTimeout) {
        while (!inner_->wait(timeout)) {
          // false only when aborted: by an earlier timed wait that gave up
        }
        return true;
      }
      return inner_->wait(timeout);
    } catch (const TimeoutError&) {
      throw;
    } catch (const std::exception& e) {
      if (classify(e) == GlooFailure::kTimeout) {
        TD_THROW(TimeoutError, call_, ": timed out waiting for ", *peer_, ": ", (*what_)(index_),
                 " (", message_of(e),
                 "). Gloo closes a group's connections when a wait times out: make "
                 "a new group to go on");
      }
      rethrow_lost(e, c10::str(call_, ": lost the connection to ", *peer_, " while waiting for ",
                               (*what_)(index_)));
    }
  }
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  void abort() override { inner_->abort(); }

 private:
  WorkPtr inner_;
  const char* call_;  // a string literal
  std::shared_ptr<const std::string> peer_;
  std::shared_ptr<const InFlight> what_;
  size_t index_;
  bool keeps_group_;  // a point-to-point work: a timed wait aborts it, never lets Gloo expire
};

}  // namespace

MessageWork::MessageWork(MessagePtr m, const char* call, bool check)
    : c10d::Work(-1, c10d::OpType::UNKNOWN), m_(std::move(m)), call_(call), check_(check) {}

bool MessageWork::wait(std::chrono::milliseconds timeout) {
  if (!m_->done) {
    if (!m_->work->wait(timeout)) return false;
    m_->done = true;
  }
  TD_CHECK_PEER(!check_ || !m_->long_message(), call_ ? call_ : "recv", ": the message on tag ",
                m_->tag, " is longer than the ", m_->buffer.nbytes(),
                " bytes this receive expects (it ran into the room kept after them, which "
                "spared this process Gloo's abort; a message longer than ",
                m_->buffer.nbytes() + room_for(m_->buffer.nbytes()), " bytes still aborts it)");
  return true;
}

AdoptedWork::AdoptedWork(MessagePtr m, at::Tensor dest, const char* call)
    : MessageWork(std::move(m), call), dest_(std::move(dest)) {}

bool AdoptedWork::wait(std::chrono::milliseconds timeout) {
  if (!MessageWork::wait(timeout)) return false;
  if (dest_.defined()) {
    at::NoGradGuard no_grad;
    // Both are contiguous receive buffers of the same size, perhaps of other dtypes.
    dest_.reshape({-1}).view(at::kByte).copy_(m_->buffer.reshape({-1}).view(at::kByte));
    dest_ = at::Tensor();
  }
  return true;
}

std::vector<WorkPtr> typed_works(const char* call, const std::string& peer,
                                 std::vector<WorkPtr> works, const InFlight& what,
                                 bool keeps_group) {
  auto shared_peer = std::make_shared<const std::string>(peer);
  auto shared_what = std::make_shared<const InFlight>(what);
  for (size_t i = 0; i < works.size(); ++i) {
    works[i] = c10::make_intrusive<TypedWork>(std::move(works[i]), call, shared_peer, shared_what,
                                              i, keeps_group);
  }
  return works;
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

void check_leaves(const char* call, const TensorDict& td, const std::vector<at::Tensor>& leaves) {
  for (const auto& leaf : leaves) {
    if (untransferable_reason(leaf) == nullptr) continue;
    std::string key = "?";
    for (const auto& [path, t] : wire::leaves_in_order(td)) {
      if (t.is_same(leaf)) {
        key = NestedKey(path).str();
        break;
      }
    }
    check_transferable(call, key, leaf);
  }
}

void check_writable(const char* call, const at::Tensor& leaf, const char* action, const char* who) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(leaf) != at::MemOverlap::Yes, call, ": cannot ",
                    action, " a leaf whose elements share memory (an expanded tensor); give the ",
                    who, " a leaf of its own");
}

WorkPtr copy_back_work(std::vector<WorkPtr> inner, at::Tensor leaf, at::Tensor buffer) {
  TORCH_INTERNAL_ASSERT(!inner.empty());
  return then(std::move(inner), [leaf, buffer] { at::Tensor(leaf).copy_(buffer); }, {leaf});
}

WorkPtr then(std::vector<WorkPtr> inner, std::function<void()> finish,
             std::vector<at::Tensor> result) {
  return c10::make_intrusive<FinishWork>(std::move(inner), std::move(finish), std::move(result));
}

}  // namespace tensordict::dist::detail
