#pragma once
// The UCX worker of the pipe: a UCP context and worker, the lock every UCX call holds, the
// progress thread, and the operations (Op) that endpoints post on it. Endpoints and listeners
// (ucx_endpoint.h, ucx_listener.h) are made on a worker and share it.
//
// Threads: every UCX call is made with the worker's UCX lock held (UCS_THREAD_MODE_SERIALIZED).
// A thread that waits for an operation progresses the worker itself for a bounded time (the
// spin), so a small message costs no thread wake-up; after that it sleeps, and the worker's
// progress thread drives UCX from the worker's event fd. The progress thread also serves
// connection requests and handshakes while nobody waits. Callbacks only record a status,
// notify, and queue follow-up work (defer); they never throw.

#include <ucp/api/ucp.h>

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tensordict::pipe::detail {

using Clock = std::chrono::steady_clock;
using Micros = std::chrono::microseconds;

/// One UCX operation. UCX completes it from a callback on whichever thread progresses the
/// worker; `status` and `length` are written before `done` is set.
struct Op {
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  size_t length = 0;
  at::Tensor owner;         // keeps the buffer alive until UCX is done with it
  at::Tensor head_owner;    // and the head's, for a joined receive
  ucp_dt_iov_t iov[2]{};    // a joined receive's buffers (UCX reads them until it completes)
  void* request = nullptr;  // the UCX request while in flight (UCX lock)
  // Run (deferred, UCX lock held) with the status and length once the operation completes.
  std::function<void(ucs_status_t, size_t)> then;
};

/// What a request's completion callback needs: the operation (alive until UCX calls back, even
/// when the waiting thread gave up) and the worker to notify. Linked into the worker's list of
/// outstanding requests (UCX lock) until the callback frees it.
struct CallbackContext {
  std::shared_ptr<Op> op;
  class Worker* worker;
  CallbackContext* prev = nullptr;
  CallbackContext* next = nullptr;
};

/// Where the worker puts a tag message that arrived before a receive matched it: the endpoint
/// whose receive tag it carries (ucx_endpoint.h). Called with the UCX lock held, outside UCX's
/// callbacks; the message is the inbox's to receive or drop (Worker::discard_locked).
class Inbox {
 public:
  virtual void arrived_locked(ucp_tag_message_h message, size_t length) = 0;

 protected:
  ~Inbox() = default;
};

/// A UCP context and worker, the UCX lock, and the progress thread. Shared (shared_ptr) by the
/// pipes, endpoints and listeners made on it; the last reference joins the thread and releases
/// UCX, so it must not be dropped inside a UCX callback.
class Worker {
 public:
  /// `spin`: how long a waiting thread progresses UCX itself before it sleeps.
  static std::shared_ptr<Worker> create(Micros spin);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// The UCX lock. Held for every UCX call and for the state that callbacks change.
  std::unique_lock<std::recursive_mutex> lock() { return std::unique_lock(ucx_mu_); }
  ucp_worker_h handle() const { return worker_; }  // UCX lock

  /// Queues `task` to run with the UCX lock held, after the progress call in which a callback
  /// asked for it (UCX calls are not made from inside callbacks). UCX lock.
  void defer(std::function<void()> task) { deferred_.push_back(std::move(task)); }

  /// Waits until `ready()` or `deadline`: progresses UCX for up to the spin, then sleeps until
  /// notify(). Returns ready(). `ready` is called without the UCX lock.
  bool wait_until(const std::function<bool()>& ready, Clock::time_point deadline);
  /// Progresses UCX from this thread, at least once, until `ready()` (called with the UCX lock
  /// held, so it may look at UCX), or until UCX has had nothing to do for `spin`, or
  /// `deadline`; never sleeps. Returns ready(). The progress thread stands aside meanwhile and
  /// is resumed when this returns false. wait_until's spin.
  bool spin_until(const std::function<bool()>& ready, Micros spin, Clock::time_point deadline);
  bool wait(const Op& op, Clock::time_point deadline) {
    return wait_until([&] { return op.done.load(); }, deadline);
  }
  /// Wakes the threads sleeping in wait_until (callbacks call it after completing something).
  void notify();

  /// Runs `task` on the progress thread about every kPeriod, without the UCX lock, until
  /// remove_periodic(key), which waits for a run under way (so not from a task, nor with the UCX
  /// lock held). For housekeeping that no UCX event announces (ucx_listener.h's sweep).
  static constexpr Micros kPeriod{100000};
  void add_periodic(const void* key, std::function<void()> task);
  void remove_periodic(const void* key);

  /// Event loops' wake-ups (Pipe::event_fd): while watched, the eventfd `fd` is written after
  /// every progress call that did something (a message arrived, an operation completed), so
  /// that a loop waiting on it looks again. Thread-safe.
  void watch(int fd);
  void unwatch(int fd);

  /// Registers (unregisters) `inbox` as the owner of the tag messages sent to `tag`. UCX lock.
  void add_inbox(uint64_t tag, Inbox* inbox) { inboxes_[tag] = inbox; }
  void remove_inbox(uint64_t tag) { inboxes_.erase(tag); }
  /// Takes every tag message that no receive matched off UCX's unexpected queue, where UCX
  /// would keep it without bound: each goes to the inbox of its tag, in the order it arrived;
  /// one whose tag no endpoint here owns is dropped, since no receive would ever match it.
  /// Runs after every progress call that did something. UCX lock.
  void collect_locked();
  /// Drops a message taken off the unexpected queue: a receive into no buffer, which UCX
  /// completes as truncated, releasing what it held (a rendezvous's sender is told, and keeps
  /// its bytes). UCX lock.
  void discard_locked(ucp_tag_message_h message);

  /// Completes `op` (from a callback or an immediate completion) and notifies. UCX lock.
  void complete(Op& op, ucs_status_t status, size_t length);
  /// Links / unlinks and deletes the context of an outstanding request (UCX lock).
  void adopt(CallbackContext* ctx);
  void release(CallbackContext* ctx);

 private:
  explicit Worker(Micros spin) : spin_(spin) {}
  bool progress_locked();
  void loop();
  void wake_loop();

  const Micros spin_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int ucp_fd_ = -1;   // the worker's event fd (UCP_FEATURE_WAKEUP)
  int wake_fd_ = -1;  // our eventfd: wakes the progress thread from poll()

  std::recursive_mutex ucx_mu_;
  std::vector<std::function<void()>> deferred_;   // UCX lock
  std::unordered_map<uint64_t, Inbox*> inboxes_;  // UCX lock: by receive tag
  // Requests UCX has not called back yet (UCX lock). One still outstanding when the worker is
  // destroyed (a close that timed out on a peer that stopped reading) never will be: its
  // context, with the operation and the buffer it holds, is freed then.
  CallbackContext* outstanding_ = nullptr;

  std::mutex periodic_mu_;  // guards `periodic_` and is held while the tasks run
  std::vector<std::pair<const void*, std::function<void()>>> periodic_;
  Clock::time_point next_periodic_{};  // the progress thread's
  void run_periodic();

  std::mutex watch_mu_;
  std::vector<int> watched_;           // watch_mu_
  std::atomic<int> watched_count_{0};  // watched_.size(), read on every progress
  void signal_watchers();

  std::atomic<int> spinners_{0};  // threads progressing UCX in wait_until
  std::atomic<int> sleepers_{0};  // threads asleep in wait_until
  std::mutex cv_mu_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// TORCH_CHECKs that a UCX call named `what` returned UCS_OK (RuntimeError with UCX's reason).
void check_ucs(ucs_status_t status, const char* what);

}  // namespace tensordict::pipe::detail
