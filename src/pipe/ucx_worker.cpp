#include "ucx_worker.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace tensordict::pipe::detail {
namespace {

// ucp_worker_progress calls the progress thread makes before it looks at its wake-up fd again:
// while a peer streams faster than we read, UCX always has more to do.
constexpr int kProgressBurst = 64;
// The TCP transport's segment size (see Worker::create).
constexpr const char* kTcpSegment = "256K";

}  // namespace

void check_ucs(ucs_status_t status, const char* what) {
  TORCH_CHECK(status == UCS_OK, "pipe: ", what, " failed: ", ucs_status_string(status));
}

std::shared_ptr<Worker> Worker::create(Micros spin) {
  TORCH_CHECK_VALUE(spin.count() >= 0, "pipe: spin must not be negative");
  std::shared_ptr<Worker> w(new Worker(spin));
  ucp_config_t* config = nullptr;
  check_ucs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  // Shared memory takes part in a connection with peer error handling only when asked: without
  // it, two processes on one host talk over TCP loopback (UCX's client-server connections
  // leave posix/sysv out). The user's UCX_MM_ERROR_HANDLING wins.
  if (std::getenv("UCX_MM_ERROR_HANDLING") == nullptr) {
    check_ucs(ucp_config_modify(config, "MM_ERROR_HANDLING", "y"), "ucp_config_modify");
  }
  // UCX's TCP transport moves a rendezvous in fragments of its send segment, 8 KB by default:
  // one send() and a copy on each side per 8 KB. Segments of kTcpSegment carry 100 MB over
  // loopback about 4.5x faster (docs/pipe.md, "Speed"); small messages are unchanged. The
  // receive segment must hold a send segment, so both change together, and only when the user
  // set neither.
  if (std::getenv("UCX_TCP_TX_SEG_SIZE") == nullptr &&
      std::getenv("UCX_TCP_RX_SEG_SIZE") == nullptr) {
    check_ucs(ucp_config_modify(config, "TCP_TX_SEG_SIZE", kTcpSegment), "ucp_config_modify");
    check_ucs(ucp_config_modify(config, "TCP_RX_SEG_SIZE", kTcpSegment), "ucp_config_modify");
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // Tags carry the frames, the stream API the peer-info exchange (as ucxx's endpoints do).
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
  const ucs_status_t st = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  check_ucs(st, "ucp_init");
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // every call holds the UCX lock
  check_ucs(ucp_worker_create(w->context_, &wparams, &w->worker_), "ucp_worker_create");
  check_ucs(ucp_worker_get_efd(w->worker_, &w->ucp_fd_), "ucp_worker_get_efd");
  w->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  TORCH_CHECK(w->wake_fd_ >= 0, "pipe: eventfd failed: ", std::strerror(errno));
  w->thread_ = std::thread([raw = w.get()] { raw->loop(); });
  return w;
}

Worker::~Worker() {
  if (thread_.joinable()) {
    stop_ = true;
    wake_loop();
    thread_.join();
  }
  // Every endpoint and listener was closed by its owner before the last reference went. What
  // their peers sent and nobody read is dropped first (UCX warns about each message still in its
  // queue when the worker goes).
  if (worker_ != nullptr) {
    inboxes_.clear();
    collect_locked();
    ucp_worker_destroy(worker_);
  }
  while (outstanding_ != nullptr) release(outstanding_);  // never called back now
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Worker::adopt(CallbackContext* ctx) {
  ctx->next = outstanding_;
  if (outstanding_ != nullptr) outstanding_->prev = ctx;
  outstanding_ = ctx;
}

void Worker::release(CallbackContext* ctx) {
  (ctx->prev != nullptr ? ctx->prev->next : outstanding_) = ctx->next;
  if (ctx->next != nullptr) ctx->next->prev = ctx->prev;
  delete ctx;
}

void Worker::wake_loop() {
  const uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof(one));
}

void Worker::notify() {
  if (sleepers_.load() == 0) return;  // seq_cst with the waiter's increment: see wait_until
  {
    std::lock_guard<std::mutex> lk(cv_mu_);
  }
  cv_.notify_all();
}

void Worker::add_periodic(const void* key, std::function<void()> task) {
  std::lock_guard<std::mutex> lk(periodic_mu_);
  periodic_.emplace_back(key, std::move(task));
}

void Worker::remove_periodic(const void* key) {
  std::lock_guard<std::mutex> lk(periodic_mu_);
  std::erase_if(periodic_, [key](const auto& p) { return p.first == key; });
}

void Worker::run_periodic() {
  const auto now = Clock::now();
  if (now < next_periodic_) return;
  next_periodic_ = now + kPeriod;
  std::lock_guard<std::mutex> lk(periodic_mu_);
  for (auto& p : periodic_) p.second();
}

void Worker::watch(int fd) {
  std::lock_guard<std::mutex> lk(watch_mu_);
  watched_.push_back(fd);
  watched_count_.store(static_cast<int>(watched_.size()));
}

void Worker::unwatch(int fd) {
  std::lock_guard<std::mutex> lk(watch_mu_);
  const auto it = std::find(watched_.begin(), watched_.end(), fd);
  if (it != watched_.end()) watched_.erase(it);
  watched_count_.store(static_cast<int>(watched_.size()));
}

void Worker::signal_watchers() {
  std::lock_guard<std::mutex> lk(watch_mu_);
  const uint64_t one = 1;
  for (const int fd : watched_) [[maybe_unused]]
    auto n = ::write(fd, &one, sizeof(one));
}

void Worker::complete(Op& op, ucs_status_t status, size_t length) {
  op.status = status;
  op.length = length;
  op.request = nullptr;
  op.owner = at::Tensor();
  op.head_owner = at::Tensor();
  if (op.then) {
    defer([then = std::move(op.then), status, length] { then(status, length); });
    op.then = nullptr;
  }
  op.done.store(true);
  notify();
}

void Worker::collect_locked() {
  ucp_tag_recv_info_t info{};
  // A mask of 0 matches any tag: the oldest message of the whole queue, which this keeps short.
  while (ucp_tag_message_h message = ucp_tag_probe_nb(worker_, 0, 0, /*remove=*/1, &info)) {
    const auto it = inboxes_.find(info.sender_tag);
    if (it != inboxes_.end()) {
      it->second->arrived_locked(message, info.length);
    } else {
      discard_locked(message);
    }
  }
}

void Worker::discard_locked(ucp_tag_message_h message) {
  static uint8_t sink;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
  param.cb.recv = [](void* request, ucs_status_t, const ucp_tag_recv_info_t*, void*) {
    ucp_request_free(request);
  };
  // Completed at once (the status says truncated), or later through the callback, which frees it.
  [[maybe_unused]] ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(worker_, &sink, 0, message, &param);
}

bool Worker::progress_locked() {
  bool any = ucp_worker_progress(worker_) != 0;
  if (any) collect_locked();
  while (!deferred_.empty()) {
    auto tasks = std::move(deferred_);
    deferred_.clear();
    for (auto& task : tasks) task();
    any = true;
  }
  if (any && watched_count_.load() > 0) signal_watchers();
  return any;
}

bool Worker::wait_until(const std::function<bool()>& ready, Clock::time_point deadline) {
  if (ready()) return true;
  if (spin_.count() > 0) {
    if (spin_until(ready, spin_, deadline)) return true;
  } else {
    wake_loop();  // the progress thread takes over (it may have been standing aside)
  }
  std::unique_lock<std::mutex> lk(cv_mu_);
  sleepers_.fetch_add(1);  // before ready() is read again: notify() cannot miss this sleeper
  const bool ok = cv_.wait_until(lk, deadline, ready);
  sleepers_.fetch_sub(1);
  return ok;
}

bool Worker::spin_until(const std::function<bool()>& ready, Micros spin,
                        Clock::time_point deadline) {
  // A reply that arrives within the spin costs no wake-up. The spin restarts whenever UCX had
  // work, so that a long transfer (a rendezvous's fragments) is driven here at full speed
  // rather than by the progress thread's wake-ups. The progress thread stands aside meanwhile
  // (it only watches its wake-up fd).
  auto spin_end = std::min(deadline, Clock::now() + spin);
  spinners_.fetch_add(1);
  bool ok = false;
  while (!ok) {
    bool busy = false;
    {
      // Several progress calls per lock and per clock reading: each costs more than a call.
      auto lk = lock();
      for (int i = 0; i < 16 && !ok; ++i) {
        busy = progress_locked() || busy;
        ok = ready();
      }
    }
    if (ok) break;
    const auto now = Clock::now();
    if (busy) spin_end = std::min(deadline, now + spin);
    if (now >= spin_end) break;
  }
  spinners_.fetch_sub(1);
  if (!ok) wake_loop();  // the caller will wait for the progress thread: resume it now
  return ok;
}

void Worker::loop() {
  while (!stop_.load()) {
    run_periodic();
    if (spinners_.load() > 0) {
      // A waiting thread is progressing UCX; watch only our fd (it writes it when it stops)
      // and look again soon (it stops without writing when its operation completed).
      pollfd fd{wake_fd_, POLLIN, 0};
      if (::poll(&fd, 1, 1) > 0) {
        uint64_t value = 0;
        [[maybe_unused]] auto n = ::read(wake_fd_, &value, sizeof(value));
      }
      continue;
    }
    ucs_status_t armed;
    {
      auto lk = lock();
      for (int i = 0; i < kProgressBurst && progress_locked(); ++i) {
      }
      collect_locked();  // cheap when empty; covers a message no progress count reported
      armed = ucp_worker_arm(worker_);
    }
    if (armed == UCS_ERR_BUSY) continue;  // more events already: progress again
    // Sleep in the kernel until UCX or a waiter has something; the poll timeout only bounds
    // the cost of an event UCX might not signal.
    pollfd fds[2] = {{ucp_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 2, 100);
    if (fds[1].revents & POLLIN) {
      uint64_t value = 0;
      [[maybe_unused]] auto n = ::read(wake_fd_, &value, sizeof(value));
    }
  }
}

}  // namespace tensordict::pipe::detail
