#include "peer.h"

#include "tensordict/errors.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string_view>

#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/log.h"
#include "tensordict/transfer_stats.h"
#include "tensordict/leaf.h"
#include "tensordict/nested_key.h"

namespace tensordict::dist::detail {
namespace {

// Works followed by a step of ours (a copy back from a stand-in, a bucket's values written back
// into its leaves): wait() waits for them all, then runs `finish` once.
class FinishWork : public c10d::Work {
 public:
  FinishWork(std::vector<WorkPtr> inner, std::function<void()> finish, std::vector<at::Tensor> result)
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
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, call, ": ",
                    group_peer ? group_peer_name : peer_name, " = ",
                    group_peer ? *group_peer : *peer, " is not a rank of the group (size ", size,
                    ")");
  if (refuse_self && !group_peer) {
    // torch.distributed.send's and recv's _check_not_self_rank (Gloo has no pair to itself).
    const char* role = std::string_view(peer_name) == "src" ? "source" : "destination";
    TORCH_CHECK_VALUE(rank != out.group.rank(), "Invalid ", role, " rank: ", role,
                      " rank should not be the same as the rank of the current process.");
  }
  out.rank = static_cast<int>(rank);
  return out;
}

Waiter::Waiter(const char* call, std::optional<std::chrono::milliseconds> timeout,
               std::string peer)
    : call_(call), timeout_(timeout), start_(std::chrono::steady_clock::now()),
      start_ticks_(::tensordict::detail::transfer_ticks()),
      peer_(std::move(peer)), uncaught_(std::uncaught_exceptions()) {
  TORCH_CHECK_VALUE(!timeout || timeout->count() > 0, call, ": timeout must be positive, got ",
                    timeout ? timeout->count() : 0, " ms");
}

Waiter::~Waiter() {
  if (std::uncaught_exceptions() > uncaught_) return;  // the call failed: its error tells
  const int64_t ticks =
      ::tensordict::detail::finish_transfer(Channel::kProcessGroup, start_ticks_);
  if (!log_enabled(LogLevel::kInfo)) return;
  try {
    const std::string took = ::tensordict::detail::micros_text(ticks);
    log(LogLevel::kInfo, c10::str(call_, " with ", peer_, detail_.empty() ? "" : ": ", detail_,
                                  " in ", took));
  } catch (...) {
    // a destructor never throws; the line is lost
  }
}

void Waiter::timed_out(const std::string& what, const std::string& detail) const {
  char waited[32];
  std::snprintf(waited, sizeof(waited), "%.2f",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  std::string limit = timeout_ ? c10::str("the call's timeout of ", timeout_->count(), " ms")
                               : std::string("the group's timeout");
  TD_THROW(TimeoutError,
                  call_, ": timed out after ", waited, " s (",
                           limit, ") waiting for ", peer_, ": ", what,
                           detail.empty() ? "" : " (" + detail + ")",
                           ". Gloo closes a group's connections when a wait times out: make a "
                           "new group to go on");
}

namespace {

bool is_timeout_text(std::string_view s) {
  return s.find("Timed out") != std::string_view::npos ||
         s.find("timed out") != std::string_view::npos ||
         s.find("Timeout") != std::string_view::npos;
}

// Rethrows the exception being handled, `e`, as the failure kind it is, once timeouts are
// told apart: our typed errors and c10's own as they are; Gloo's transport errors (a
// gloo::IoException is a plain std::exception: "Connection closed by peer", "Connection reset
// by peer") and c10 errors with their texts as PeerLostError, saying where (`where`).
[[noreturn]] void rethrow_lost(const std::exception& e, const std::string& where) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string text = c10_error ? c10_error->msg() : e.what();
  const bool lost_text = text.find("Connection closed by peer") != std::string::npos ||
                         text.find("Connection reset by peer") != std::string::npos;
  const bool typed = dynamic_cast<const PeerLostError*>(&e) != nullptr ||
                     dynamic_cast<const TimeoutError*>(&e) != nullptr;
  if (c10_error != nullptr && (typed || !lost_text)) throw;
  TD_THROW(PeerLostError, where, ": ", text);
}

// A work handed to the caller: its wait() raises the typed errors (typed_works). What it
// carries is worded only when it fails.
class TypedWork : public c10d::Work {
 public:
  TypedWork(WorkPtr inner, const char* call, std::shared_ptr<const std::string> peer,
            std::shared_ptr<const InFlight> what, size_t index)
      : c10d::Work(-1, c10d::OpType::UNKNOWN),
        inner_(std::move(inner)),
        call_(call),
        peer_(std::move(peer)),
        what_(std::move(what)),
        index_(index) {}

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    try {
      return inner_->wait(timeout);
    } catch (const std::exception& e) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      const std::string text = c10_error ? c10_error->msg() : e.what();
      if (is_timeout_text(text) && dynamic_cast<const TimeoutError*>(&e) == nullptr) {
        TD_THROW(TimeoutError, call_, ": timed out waiting for ", *peer_, ": ", (*what_)(index_),
                 " (", text, "). Gloo closes a group's connections when a wait times out: make "
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
};

}  // namespace

std::vector<WorkPtr> typed_works(const char* call, const std::string& peer,
                                 std::vector<WorkPtr> works, const InFlight& what) {
  auto shared_peer = std::make_shared<const std::string>(peer);
  auto shared_what = std::make_shared<const InFlight>(what);
  for (size_t i = 0; i < works.size(); ++i) {
    works[i] =
        c10::make_intrusive<TypedWork>(std::move(works[i]), call, shared_peer, shared_what, i);
  }
  return works;
}

void Waiter::wait(const std::vector<WorkPtr>& works, const InFlight& what) const {
  using std::chrono::milliseconds;
  const bool has_deadline = timeout_.has_value();
  const auto deadline = start_ + timeout_.value_or(milliseconds(0));
  const auto past_deadline = [&] {
    return has_deadline && std::chrono::steady_clock::now() >= deadline;
  };
  std::exception_ptr first;
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      if (first) {
        works[i]->abort();
        works[i]->wait();  // returns or throws at once once aborted
        continue;
      }
      if (!has_deadline) {
        works[i]->wait();
        continue;
      }
      const auto left =
          std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      // Work::wait(0) means "no timeout": a deadline already passed still waits 1 ms.
      if (!works[i]->wait(std::max(left, milliseconds(1)))) timed_out(what(i), "");
    } catch (const std::exception& e) {
      if (first) continue;
      // Gloo's own errors (gloo::IoException, "Connection reset by peer") reach Work::wait()
      // as plain std::exceptions; callers get every transport failure as DistBackendError.
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      const std::string text = c10_error ? c10_error->msg() : e.what();
      try {
        if (is_timeout_text(text) || past_deadline()) {
          timed_out(what(i), text);
        }
        rethrow_lost(e, c10::str(call_, ": lost the connection to ", peer_,
                                 " while waiting for ", what(i)));
      } catch (...) {
        first = std::current_exception();
      }
    }
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

void Waiter::wait(const WorkPtr& work, const std::string& what) const {
  wait(std::vector<WorkPtr>{work}, [&](size_t) { return what; });
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

namespace {

// A 64-bit stamp no peer can predict: seeded once from the OS, then advanced per stamp.
uint64_t next_stamp() {
  static std::atomic<uint64_t> state{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }()};
  uint64_t z = state.fetch_add(0x9e3779b97f4a7c15ULL) + 0x9e3779b97f4a7c15ULL;  // splitmix64
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

at::Tensor stamp_tensor(uint64_t stamp) {
  at::Tensor t = at::empty({8}, at::kByte);
  std::memcpy(t.data_ptr(), &stamp, 8);
  return t;
}

}  // namespace

TailStamp::TailStamp(const at::Tensor& bytes) {
  const int64_t n = bytes.numel();
  if (n < 8) {
    if (n > 0) bytes.zero_();
    return;
  }
  stamp_ = next_stamp();
  tail_ = bytes.narrow(0, n - 8, 8);
  if (tail_.is_cpu()) {
    std::memcpy(tail_.data_ptr(), &stamp_, 8);
  } else {
    tail_.copy_(stamp_tensor(stamp_));
  }
}

bool TailStamp::short_message() const {
  if (!tail_.defined()) return false;
  uint64_t now = 0;
  if (tail_.is_cpu()) {
    std::memcpy(&now, tail_.data_ptr(), 8);
  } else {
    std::memcpy(&now, tail_.cpu().data_ptr(), 8);
  }
  return now == stamp_;
}

void check_leaves(const char* call, const TensorDict& td, const std::vector<at::Tensor>& leaves) {
  for (const auto& leaf : leaves) {
    if (untransferable_reason(leaf) == nullptr) continue;
    std::string key = "?";
    for (const auto& [path, t] : wire_order(td)) {
      if (t.is_same(leaf)) {
        key = NestedKey(path).str();
        break;
      }
    }
    check_transferable(call, key, leaf);
  }
}

void check_writable(const char* call, const at::Tensor& leaf, const char* action,
                    const char* who) {
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
