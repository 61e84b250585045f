#include "late.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

namespace tensordict::dist::detail {
namespace {

// Gloo's wait is given this much beyond the deadline: the timer aborts it at the deadline, and
// only a timer thread that did not run for this long would let Gloo's own timeout (which
// closes the rank's connections) pass.
constexpr std::chrono::seconds kBackstop{60};

// One thread that aborts works at their deadlines. Leaked, so that no exit-time destructor
// joins a thread or frees a work another thread still waits on.
class AbortTimer {
 public:
  using Token = std::pair<Clock::time_point, uint64_t>;

  static AbortTimer& get() {
    static auto* timer = new AbortTimer;
    return *timer;
  }

  Token arm(WorkPtr work, Clock::time_point at) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!started_) {
      std::thread([this] { run(); }).detach();
      started_ = true;
    }
    const Token token{at, next_++};
    armed_.emplace(token, std::move(work));
    // The thread sleeps until wake_at_ even when what it slept for was disarmed, so a loop of
    // calls, each arming a later deadline than the last, wakes it once per deadline passed,
    // not once per call.
    if (at < wake_at_) wake_.notify_one();
    return token;
  }

  // True when the timer fired (or is firing) for `token`.
  bool disarm(const Token& token) {
    std::lock_guard<std::mutex> lock(mutex_);
    return armed_.erase(token) == 0;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (armed_.empty()) {
        wake_at_ = Clock::time_point::max();
        wake_.wait(lock);
        continue;
      }
      const auto first = armed_.begin();
      if (Clock::now() < first->first.first) {
        wake_at_ = first->first.first;
        wake_.wait_until(lock, wake_at_);
        continue;
      }
      WorkPtr work = std::move(first->second);
      armed_.erase(first);
      lock.unlock();
      try {
        work->abort();
      } catch (...) {
        // a work that cannot abort is waited on under Gloo's own timeout
      }
      work.reset();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::map<Token, WorkPtr> armed_;
  Clock::time_point wake_at_ = Clock::time_point::min();  // until the thread runs
  uint64_t next_ = 0;
  bool started_ = false;
};

}  // namespace

bool wait_until(const WorkPtr& work, Clock::time_point deadline) {
  auto& timer = AbortTimer::get();
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::max(deadline - Clock::now(), Clock::duration::zero()));
    const auto token = timer.arm(work, deadline);
    bool completed = false;
    try {
      completed = work->wait(left + kBackstop);
    } catch (...) {
      timer.disarm(token);
      throw;
    }
    const bool fired = timer.disarm(token);
    if (completed) return true;
    if (fired) return false;
    // Aborted by someone else earlier (an abort leaves a flag for the next wait): wait again.
  }
}

// ---- the registry ---------------------------------------------------------------------------

GroupKey::GroupKey(const Group& group) {
  if (group.process_group()) {
    process_group_.emplace(group.process_group());
    address_ = group.process_group().get();
  } else {
    backend_.emplace(group.backend());
    address_ = group.backend().get();
  }
}

bool GroupKey::expired() const {
  return process_group_ ? process_group_->expired() : !backend_ || backend_->expired();
}

struct LateMessages::Impl {
  using Key = std::pair<GroupKey, int>;

  mutable std::mutex mutex;
  std::map<Key, std::deque<MessagePtr>> receives;
  std::atomic<int64_t> receive_count{0};
  std::map<std::tuple<GroupKey, int, int64_t>, std::shared_ptr<void>> kept;

  // Parked sends, waited for by one thread until they complete (or fail, or their group ends),
  // then dropped.
  std::deque<std::pair<GroupKey, MessagePtr>> sends;
  std::condition_variable parked;  // something was parked: the thread looks again
  bool thread_started = false;

  // Takes out of the queue of (group, peer) the parked receives `wanted` accepts, oldest
  // first: only the first with `first_only`. Holds `mutex`.
  template <typename Wanted>
  std::vector<MessagePtr> take(const GroupKey& group, int peer, Wanted wanted, bool first_only) {
    std::vector<MessagePtr> out;
    const auto it = receives.find({group, peer});
    if (it == receives.end()) return out;
    auto& queue = it->second;
    for (auto m = queue.begin(); m != queue.end();) {
      if (!wanted(**m)) {
        ++m;
        continue;
      }
      (*m)->taken = true;
      out.push_back(std::move(*m));
      m = queue.erase(m);
      receive_count.fetch_sub(1);
      if (first_only) break;
    }
    if (queue.empty()) receives.erase(it);
    return out;
  }

  // Drops what groups that ended left (holds `mutex`); the works and buffers are released
  // with `dropped`, outside the lock.
  void purge(std::vector<MessagePtr>& dropped, std::vector<std::shared_ptr<void>>& values) {
    for (auto it = kept.begin(); it != kept.end();) {
      if (std::get<0>(it->first).expired()) {
        values.push_back(std::move(it->second));
        it = kept.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = receives.begin(); it != receives.end();) {
      if (!it->first.first.expired()) {
        ++it;
        continue;
      }
      receive_count.fetch_sub(static_cast<int64_t>(it->second.size()));
      dropped.insert(dropped.end(), it->second.begin(), it->second.end());
      it = receives.erase(it);
    }
    for (auto it = sends.begin(); it != sends.end();) {
      if (it->first.expired()) {
        dropped.push_back(std::move(it->second));
        it = sends.erase(it);
      } else {
        ++it;
      }
    }
  }

  void start_locked() {
    if (thread_started) return;
    std::thread([this] { run(); }).detach();
    thread_started = true;
  }

  // Waits for the parked sends in turn, a second each, and drops what ended groups left.
  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      std::vector<MessagePtr> dropped;
      std::vector<std::shared_ptr<void>> values;
      purge(dropped, values);
      if (!dropped.empty() || !values.empty()) {
        lock.unlock();
        values.clear();  // their works and buffers go here, not under the lock
        dropped.clear();
        lock.lock();
        continue;
      }
      if (sends.empty()) {
        // Receives wait for a later call; only their group's end is looked for, each second.
        if (receives.empty() && kept.empty()) {
          parked.wait(lock);
        } else {
          parked.wait_for(lock, std::chrono::seconds(1));
        }
        continue;
      }
      auto send = std::move(sends.front());
      sends.pop_front();
      lock.unlock();
      bool finished = true;
      try {
        finished = send.second->done ||
                   wait_until(send.second->work, Clock::now() + std::chrono::seconds(1));
      } catch (...) {
        // the peer is gone: nothing will take the bytes
      }
      lock.lock();
      if (!finished) sends.push_back(std::move(send));  // round robin over the parked sends
    }
  }
};

LateMessages& LateMessages::get() {
  static auto* registry = new LateMessages;  // leaked: its works may outlive static teardown
  return *registry;
}

LateMessages::Impl& LateMessages::impl() const {
  static auto* impl = new Impl;
  return *impl;
}

void LateMessages::park(const GroupKey& group, int peer, const std::vector<MessagePtr>& messages) {
  Impl& d = impl();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.start_locked();
  auto& queue = d.receives[{group, peer}];
  std::vector<MessagePtr> front;
  for (const auto& m : messages) {
    if (!m->is_recv) {
      if (!m->done) d.sends.emplace_back(group, m);
      continue;
    }
    if (m->taken) {
      front.push_back(m);
    } else {
      queue.push_back(m);
    }
    d.receive_count.fetch_add(1);
  }
  queue.insert(queue.begin(), front.begin(), front.end());
  if (queue.empty()) d.receives.erase({group, peer});
  d.parked.notify_one();
}

MessagePtr LateMessages::take(const GroupKey& group, int peer, int tag) {
  Impl& d = impl();
  if (d.receive_count.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(d.mutex);
  auto taken = d.take(group, peer, [&](const PostedMessage& m) { return m.tag == tag; }, true);
  return taken.empty() ? nullptr : std::move(taken.front());
}

std::vector<MessagePtr> LateMessages::take_all(const GroupKey& group, int peer,
                                               const std::vector<int>& tags) {
  Impl& d = impl();
  if (d.receive_count.load(std::memory_order_acquire) == 0) return {};
  std::lock_guard<std::mutex> lock(d.mutex);
  return d.take(
      group, peer,
      [&](const PostedMessage& m) {
        return std::find(tags.begin(), tags.end(), m.tag) != tags.end();
      },
      false);
}

bool LateMessages::has(const GroupKey& group, int peer, const std::vector<int>& tags) const {
  const Impl& d = impl();
  if (d.receive_count.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(d.mutex);
  const auto it = d.receives.find({group, peer});
  if (it == d.receives.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(), [&](const MessagePtr& m) {
    return std::find(tags.begin(), tags.end(), m->tag) != tags.end();
  });
}

void LateMessages::admit(const char* call, const GroupKey& group, int peer,
                         const std::string& who) const {
  const Impl& d = impl();
  if (d.receive_count.load(std::memory_order_acquire) < static_cast<int64_t>(kMaxParked)) return;
  std::lock_guard<std::mutex> lock(d.mutex);
  const auto it = d.receives.find({group, peer});
  const size_t parked = it == d.receives.end() ? 0 : it->second.size();
  TORCH_CHECK_VALUE(parked < kMaxParked, call, ": ", parked, " receives from ", who,
                    " left by calls that timed out still wait for their messages (at most ",
                    kMaxParked,
                    " are kept per peer): receive them (late=\"deliver\" or \"drop\" on their "
                    "tags) or make a new group");
}

void LateMessages::keep(const GroupKey& group, int peer, int64_t slot,
                        std::shared_ptr<void> value) {
  Impl& d = impl();
  std::shared_ptr<void> earlier;
  std::lock_guard<std::mutex> lock(d.mutex);
  d.start_locked();
  earlier = std::exchange(d.kept[{group, peer, slot}], std::move(value));
  d.parked.notify_one();
}

std::shared_ptr<void> LateMessages::take_kept(const GroupKey& group, int peer, int64_t slot) {
  Impl& d = impl();
  std::lock_guard<std::mutex> lock(d.mutex);
  const auto it = d.kept.find({group, peer, slot});
  if (it == d.kept.end()) return nullptr;
  auto value = std::move(it->second);
  d.kept.erase(it);
  return value;
}

}  // namespace tensordict::dist::detail
