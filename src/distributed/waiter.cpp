#include "waiter.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/byte_tensor.h"
#include "gloo_errors.h"
#include "tensordict/errors.h"
#include "tensordict/log.h"
#include "tensordict/transfer_stats.h"

namespace tensordict::dist::detail {
namespace {

// The arena staged receives are cut from, kept per thread between calls (Waiter::stage()).
thread_local at::Tensor t_arena;  // NOLINT: one per thread by design

// Staged buffers are cut at this alignment, so that any dtype may view them.
constexpr int64_t kStageAlign = 64;
// The largest arena a thread keeps between calls.
constexpr int64_t kMaxKeptArena = int64_t{1} << 30;

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

void Waiter::wait(const std::vector<WorkPtr>& works, const InFlight& what) const {
  using std::chrono::milliseconds;
  const bool has_deadline = timeout_.has_value();
  const auto deadline = start_ + timeout_.value_or(milliseconds(0));
  const auto past_deadline = [&] {
    return has_deadline && std::chrono::steady_clock::now() >= deadline;
  };
  std::exception_ptr first;
  bool refused = false;  // the first failure is a message refused (the peer is there)
  for (size_t i = 0; i < works.size(); ++i) {
    try {
      if (first && !(refused && keeps_group_)) {
        works[i]->abort();
        works[i]->wait();  // returns or throws at once once aborted
        continue;
      }
      if (first) {
        // A refused message (longer than expected): the call's other messages are of the same
        // transfer, already sent. They are received and dropped, so that no receive Gloo may
        // still write into loses its buffer (that wedges the pair) and the next call starts in
        // step; those the deadline leaves are parked, for the next call to take.
        if (!has_deadline) {
          while (!works[i]->wait()) {
          }
        } else if (!wait_until(works[i], deadline)) {
          std::erase_if(records_, [](const Record& r) { return r.message->done; });
          park();
          break;
        }
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
      if (first) continue;  // a later message's own failure: the first one is the call's
      // Gloo's own errors are untyped (gloo_errors.h); callers get each as its typed error.
      try {
        if (classify(e) == GlooFailure::kTimeout || past_deadline()) {
          timed_out(what(i), message_of(e));
        }
        rethrow_lost(
            e, c10::str(call_, ": lost the connection to ", peer_, " while waiting for ", what(i)));
      } catch (const MalformedPeerDataError&) {
        first = std::current_exception();
        refused = true;
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

}  // namespace tensordict::dist::detail
