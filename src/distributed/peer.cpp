#include "peer.h"

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
#include "tensordict/errors.h"
#include "tensordict/leaf.h"
#include "tensordict/log.h"
#include "tensordict/nested_key.h"
#include "tensordict/transfer_stats.h"
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

namespace {

// The arena staged receives are cut from, kept per thread between calls (Waiter::stage()).
thread_local at::Tensor t_arena;  // NOLINT: one per thread by design

// Staged buffers are cut at this alignment, so that any dtype may view them.
constexpr int64_t kStageAlign = 64;
// The largest arena a thread keeps between calls.
constexpr int64_t kMaxKeptArena = int64_t{1} << 30;

// A fresh message's work: marks the message done once a wait succeeds. A receive posted with
// room that a longer message ran into is a MalformedPeerDataError naming `call`, unless the
// message is only being dropped (`check` false).
class MessageWork : public c10d::Work {
 public:
  explicit MessageWork(MessagePtr m, const char* call = nullptr, bool check = true)
      : c10d::Work(-1, c10d::OpType::UNKNOWN), m_(std::move(m)), call_(call), check_(check) {}
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
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
  bool isCompleted() override { return m_->done; }
  int sourceRank() const override { return m_->work->sourceRank(); }
  void abort() override { m_->work->abort(); }

 protected:
  MessagePtr m_;
  const char* call_;
  bool check_;
};

// A receive taken from the registry into the caller's memory: waits for the parked message,
// then copies its bytes into `dest` once.
class AdoptedWork : public MessageWork {
 public:
  AdoptedWork(MessagePtr m, at::Tensor dest, const char* call)
      : MessageWork(std::move(m), call), dest_(std::move(dest)) {}
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    if (!MessageWork::wait(timeout)) return false;
    if (dest_.defined()) {
      at::NoGradGuard no_grad;
      // Both are contiguous receive buffers of the same size, perhaps of other dtypes.
      dest_.reshape({-1}).view(at::kByte).copy_(m_->buffer.reshape({-1}).view(at::kByte));
      dest_ = at::Tensor();
    }
    return true;
  }
  bool isCompleted() override { return MessageWork::isCompleted() && !dest_.defined(); }

 private:
  at::Tensor dest_;  // undefined once copied
};

}  // namespace

Waiter::Waiter(const char* call, std::optional<std::chrono::milliseconds> timeout, std::string peer,
               bool keeps_group)
    : call_(call),
      timeout_(timeout),
      keeps_group_(keeps_group),
      staged_(keeps_group && timeout.has_value()),
      start_(std::chrono::steady_clock::now()),
      start_ticks_(::tensordict::detail::transfer_ticks()),
      peer_(std::move(peer)),
      uncaught_(std::uncaught_exceptions()) {
  TORCH_CHECK_VALUE(!timeout || timeout->count() > 0, call, ": timeout must be positive, got ",
                    timeout ? timeout->count() : 0, " ms");
}

Waiter::~Waiter() {
  // The arena goes back to the thread unless something still holds a part of it: parked
  // receives, or works of a failed call that Gloo may still write into.
  landings_.clear();
  records_.clear();
  if (arena_.defined() && !parked_ && arena_.use_count() == 1 &&
      arena_.storage().use_count() == 1) {
    t_arena = std::move(arena_);
  }
  if (std::uncaught_exceptions() > uncaught_) return;  // the call failed: its error tells
  const int64_t ticks = ::tensordict::detail::finish_transfer(Channel::kProcessGroup, start_ticks_);
  if (!log_enabled(LogLevel::kInfo)) return;
  try {
    const std::string took = ::tensordict::detail::micros_text(ticks);
    log(LogLevel::kInfo,
        c10::str(call_, " with ", peer_, detail_.empty() ? "" : ": ", detail_, " in ", took));
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
  std::string after;
  if (!parks()) {
    after =
        ". Gloo closes a group's connections when its own timeout passes: make a new group "
        "to go on";
  } else {
    bool recvs = false, sends = false;
    for (const auto& r : records_) (r.message->is_recv ? recvs : sends) = true;
    after = ". The group stays usable";
    if (recvs) {
      after += c10::str("; the late message stays posted: the next receive from ", peer_,
                        " on its tags takes it (late=\"deliver\") or drops it (late=\"drop\")");
    }
    if (sends) after += "; the send stays queued, its bytes kept until the receiver takes them";
    park();  // before anything else is touched: what was posted stays posted
  }
  TD_THROW(TimeoutError, call_, ": timed out after ", waited, " s (", limit, ") waiting for ",
           peer_, ": ", what, detail.empty() ? "" : " (" + detail + ")", after);
}

void Waiter::record(const Peer& peer, MessagePtr message) const {
  if (!parks()) return;
  records_.push_back({GroupKey(peer.group), peer.rank, std::move(message)});
}

MessagePtr Waiter::track(const Peer& peer, WorkPtr& work, const at::Tensor& buffer, int tag,
                         bool is_recv) const {
  if (!parks()) return nullptr;
  auto m = std::make_shared<PostedMessage>();
  m->work = work;
  m->buffer = buffer;
  m->tag = tag;
  m->is_recv = is_recv;
  record(peer, m);
  work = c10::make_intrusive<MessageWork>(m, call_);
  return m;
}

void Waiter::park() const {
  if (records_.empty()) return;
  parked_ = true;
  // One park per peer, the call's messages in posting order.
  std::vector<bool> done(records_.size(), false);
  for (size_t i = 0; i < records_.size(); ++i) {
    if (done[i]) continue;
    std::vector<MessagePtr> mine;
    for (size_t j = i; j < records_.size(); ++j) {
      if (records_[j].group == records_[i].group && records_[j].peer == records_[i].peer) {
        mine.push_back(records_[j].message);
        done[j] = true;
      }
    }
    LateMessages::get().park(records_[i].group, records_[i].peer, mine);
  }
  records_.clear();
  landings_.clear();
}

WorkPtr Waiter::recv(const Peer& peer, at::Tensor& buffer, int tag,
                     std::initializer_list<TailStamp*> stamps, bool copy_late, bool room) const {
  const GroupKey key(peer.group);
  if (MessagePtr late = LateMessages::get().take(key, peer.rank, tag)) {
    if (late->buffer.nbytes() != buffer.nbytes() || late->stamps.size() != stamps.size()) {
      const auto late_bytes = late->buffer.nbytes();
      LateMessages::get().park(key, peer.rank, {late});
      TORCH_CHECK_VALUE(false, call_, ": a late message from ", peer_, " on tag ", tag,
                        ", received into ", late_bytes,
                        " bytes by a call that timed out, "
                        "waits to be taken, and this receive expects ",
                        buffer.nbytes(),
                        " bytes there. Receive it as it was sent, or pass late=\"drop\"");
    }
    record(peer, late);
    if (copy_late) return c10::make_intrusive<AdoptedWork>(std::move(late), buffer, call_);
    buffer = late->buffer;
    size_t i = 0;
    for (TailStamp* s : stamps) *s = late->stamps[i++];
    return c10::make_intrusive<MessageWork>(std::move(late), call_);
  }
  if (parks()) LateMessages::get().admit(call_, key, peer.rank, peer_);
  // A buffer of the library's own followed by room (stage()) is posted with it, a stamp at the
  // room's start: a longer message is then a named error, not Gloo's abort.
  const at::Tensor posted =
      room ? with_room(buffer, room_for(static_cast<int64_t>(buffer.nbytes()))) : buffer;
  std::optional<TailStamp> beyond;
  if (posted.nbytes() > buffer.nbytes()) {
    beyond.emplace(wire::stamp_beyond(posted, static_cast<int64_t>(buffer.nbytes())));
  }
  std::vector<at::Tensor> one{posted};
  WorkPtr work = peer.group.recv(one, peer.rank, tag);
  if (!parks() && beyond) {
    // Not kept for a later call: checked when waited.
    auto m = std::make_shared<PostedMessage>();
    m->work = work;
    m->buffer = buffer;
    m->tag = tag;
    m->beyond = beyond;
    return c10::make_intrusive<MessageWork>(std::move(m), call_);
  }
  if (MessagePtr m = track(peer, work, buffer, tag, /*is_recv=*/true)) {
    for (TailStamp* s : stamps) m->stamps.push_back(*s);
    m->beyond = beyond;
  }
  return work;
}

WorkPtr Waiter::recv_into(const Peer& peer, const at::Tensor& dest, int tag) const {
  if (staged_) {
    at::Tensor buffer = stage(dest);
    return recv(peer, buffer, tag, {}, /*copy_late=*/true, /*room=*/true);
  }
  return post_in_place(dest, /*reads_leaf=*/false, [&](const at::Tensor& b) {
    at::Tensor buffer = b;
    return recv(peer, buffer, tag, {}, /*copy_late=*/true);
  });
}

WorkPtr Waiter::send(const Peer& peer, const at::Tensor& tensor, int tag) const {
  std::vector<at::Tensor> one{tensor};
  WorkPtr work = peer.group.send(one, peer.rank, tag);
  track(peer, work, tensor, tag, /*is_recv=*/false);
  return work;
}

at::Tensor Waiter::stage(const at::Tensor& dest) const {
  const auto n = static_cast<int64_t>(dest.nbytes());
  // Room after the bytes (recv() posts it with them): a parked receive may meet a longer
  // message of a later layout.
  const int64_t cut = (n + room_for(n) + kStageAlign - 1) / kStageAlign * kStageAlign;
  if (!arena_.defined() && t_arena.defined() && dest.is_cpu()) {
    arena_ = std::move(t_arena);  // taken: a call nested on this thread cuts its own
    arena_used_ = 0;
  }
  at::Tensor bytes;
  if (dest.is_cpu() && arena_.defined() && arena_used_ + cut <= arena_.numel()) {
    bytes = arena_.narrow(0, arena_used_, n);
    arena_used_ += cut;
  } else {
    bytes = core::fresh_bytes(cut, dest.device()).narrow(0, 0, n);
  }
  if (dest.is_cpu()) staged_bytes_ += cut;
  landings_.emplace_back(dest, bytes);
  return bytes;  // Gloo moves bytes: no typed view needed (each costs a dispatch)
}

void Waiter::land() const {
  {
    at::NoGradGuard no_grad;
    for (auto& [dest, bytes] : landings_) {
      if (bytes.numel() == 0) continue;
      if (dest.is_cpu() && dest.is_contiguous()) {
        std::memcpy(dest.data_ptr(), bytes.data_ptr(), bytes.numel());
      } else {
        at::Tensor(dest).copy_(bytes.view(dest.scalar_type()).view(dest.sizes()));
      }
    }
  }
  landings_.clear();
  records_.clear();
  // Next time, one arena for all of it.
  if (staged_bytes_ > (arena_.defined() ? arena_.numel() : 0) && staged_bytes_ <= kMaxKeptArena) {
    arena_ = at::empty({staged_bytes_}, at::kByte);
  }
}

void Waiter::drop_late(const Peer& peer, const std::vector<int>& tags) const {
  auto late = LateMessages::get().take_all(GroupKey(peer.group), peer.rank, tags);
  if (late.empty()) return;
  std::vector<WorkPtr> works;
  for (auto& m : late) {
    record(peer, m);
    works.push_back(c10::make_intrusive<MessageWork>(m, call_, /*check=*/false));
  }
  wait(works, [&](size_t i) {
    return c10::str("a late message on tag ", late[i]->tag, " (", late[i]->buffer.nbytes(),
                    " bytes), to be dropped");
  });
  // Taken and complete: nothing of them is parked again.
  std::erase_if(records_, [&](const Record& r) {
    return std::find(late.begin(), late.end(), r.message) != late.end();
  });
}

namespace {

bool is_timeout_text(std::string_view s) {
  return s.find("Timed out") != std::string_view::npos ||
         s.find("timed out") != std::string_view::npos ||
         s.find("Timeout") != std::string_view::npos;
}

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
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      const std::string text = c10_error ? c10_error->msg() : e.what();
      if (is_timeout_text(text) && dynamic_cast<const TimeoutError*>(&e) == nullptr) {
        TD_THROW(TimeoutError, call_, ": timed out waiting for ", *peer_, ": ", (*what_)(index_),
                 " (", text,
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

void rethrow_lost(const std::exception& e, const std::string& where) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string text = c10_error ? c10_error->msg() : e.what();
  const bool lost_text = text.find("Connection closed by peer") != std::string::npos ||
                         text.find("Connection reset by peer") != std::string::npos;
  const bool typed = dynamic_cast<const PeerLostError*>(&e) != nullptr ||
                     dynamic_cast<const TimeoutError*>(&e) != nullptr;
  if (c10_error != nullptr && (typed || !lost_text)) throw;
  TD_THROW(PeerLostError, where, ": ", text);
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
        // False only when aborted: a parked message aborted by the call that gave up on it.
        while (!works[i]->wait()) {
        }
        continue;
      }
      if (keeps_group_) {
        if (!wait_until(works[i], deadline)) timed_out(what(i), "");  // parks what was posted
        continue;
      }
      const auto left =
          std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      // Work::wait(0) means "no timeout": a deadline already passed still waits 1 ms.
      if (!works[i]->wait(std::max(left, milliseconds(1)))) timed_out(what(i), "");
    } catch (const TimeoutError&) {
      if (parked_) throw;  // the rest stays posted, parked
      if (!first) first = std::current_exception();
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
        rethrow_lost(
            e, c10::str(call_, ": lost the connection to ", peer_, " while waiting for ", what(i)));
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
