#include "late.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
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

struct LateMessages::Impl {
  using Key = std::pair<const void*, int>;

  mutable std::mutex mutex;
  std::map<Key, std::deque<MessagePtr>> receives;
  std::atomic<int64_t> receive_count{0};

  // Parked sends, waited for by one thread until they complete (or fail), then dropped.
  std::deque<MessagePtr> sends;
  std::condition_variable sends_ready;
  bool reaper_started = false;

  // Takes out of the queue of (group, peer) the parked receives `wanted` accepts, oldest
  // first: only the first with `first_only`. Holds `mutex`.
  template <typename Wanted>
  std::vector<MessagePtr> take(const void* group, int peer, Wanted wanted, bool first_only) {
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

  void reap() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      sends_ready.wait(lock, [&] { return !sends.empty(); });
      MessagePtr send = sends.front();
      lock.unlock();
      bool finished = true;
      try {
        finished = send->done || wait_until(send->work, Clock::now() + std::chrono::seconds(1));
      } catch (...) {
        // the peer is gone: nothing will take the bytes
      }
      lock.lock();
      sends.pop_front();
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

void LateMessages::park(const void* group, int peer, const std::vector<MessagePtr>& messages) {
  Impl& d = impl();
  std::lock_guard<std::mutex> lock(d.mutex);
  auto& queue = d.receives[{group, peer}];
  std::vector<MessagePtr> front;
  for (const auto& m : messages) {
    if (!m->is_recv) {
      if (m->done) continue;
      d.sends.push_back(m);
      if (!d.reaper_started) {
        std::thread([&d] { d.reap(); }).detach();
        d.reaper_started = true;
      }
      d.sends_ready.notify_one();
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
}

MessagePtr LateMessages::take(const void* group, int peer, int tag) {
  Impl& d = impl();
  if (d.receive_count.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(d.mutex);
  auto taken = d.take(group, peer, [&](const PostedMessage& m) { return m.tag == tag; }, true);
  return taken.empty() ? nullptr : std::move(taken.front());
}

std::vector<MessagePtr> LateMessages::take_all(const void* group, int peer,
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

bool LateMessages::has(const void* group, int peer, const std::vector<int>& tags) const {
  const Impl& d = impl();
  if (d.receive_count.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(d.mutex);
  const auto it = d.receives.find({group, peer});
  if (it == d.receives.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(), [&](const MessagePtr& m) {
    return std::find(tags.begin(), tags.end(), m->tag) != tags.end();
  });
}

const void* group_key(const Group& group) {
  return group.process_group() ? static_cast<const void*>(group.process_group().get())
                               : static_cast<const void*>(group.backend().get());
}

}  // namespace tensordict::dist::detail
