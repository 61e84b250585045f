#include "ucx_endpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "tensordict/errors.h"
#include "tensordict/memory.h"
#include "ucx_address.h"
#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {
namespace {

constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};

int64_t to_ms(Millis m) { return static_cast<int64_t>(m.count()); }

void on_done(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* ctx = static_cast<CallbackContext*>(user_data);
  ctx->worker->complete(*ctx->op, status, status == UCS_OK ? length : 0);
  ucp_request_free(request);
  ctx->worker->release(ctx);
}

void on_send(void* request, ucs_status_t status, void* user_data) {
  on_done(request, status, 0, user_data);
}

void on_tag_recv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                 void* user_data) {
  on_done(request, status, status == UCS_OK ? info->length : 0, user_data);
}

void on_stream_recv(void* request, ucs_status_t status, size_t length, void* user_data) {
  on_done(request, status, length, user_data);
}

void free_request(void* request, ucs_status_t, void*) { ucp_request_free(request); }

const char* op_name(bool recv) { return recv ? "recv" : "send"; }

}  // namespace

UnreadLimits UnreadLimits::of(const PipeOptions& o) {
  UnreadLimits l;
  l.max_unread_bytes = static_cast<size_t>(o.max_unread_bytes);
  // No receive of the pipe takes a longer message: a storage (or an uncollated leaf), a metadata
  // JSON, a publication's version (its Subscriber's max_total_bytes defaults to the storage
  // limit; above half the memory, it could not be held anyway); the slack covers the framing.
  const int64_t longest = std::max({o.max_storage_bytes.value_or(default_storage_limit_bytes()),
                                    o.max_metadata_bytes, default_storage_limit_bytes()});
  l.max_message_bytes = static_cast<size_t>(longest) + (size_t{64} << 10);
  return l;
}

Endpoint::Endpoint(std::shared_ptr<Worker> worker, std::string peer, const UnreadLimits& limits)
    : worker_(std::move(worker)),
      peer_(std::move(peer)),
      recv_tag_(make_our_tag()),
      limits_(limits),
      handshake_(at::empty({32}, at::kByte)) {
  auto lk = worker_->lock();
  worker_->add_inbox(recv_tag_, this);
}

Endpoint::~Endpoint() {
  // Owners close() first; this covers an endpoint dropped without it.
  auto lk = worker_->lock();
  token_.reset();  // deferred tasks run under the lock: none reaches this endpoint after it
  force_close_locked();
  drop_stash_locked();
  worker_->remove_inbox(recv_tag_);
}

void Endpoint::create_locked(const ucp_ep_params_t& params) {
  ucp_ep_params_t p = params;
  p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &Endpoint::on_error;
  p.err_handler.arg = this;
  const ucs_status_t st = ucp_ep_create(worker_->handle(), &p, &ep_);
  if (st != UCS_OK) ep_ = nullptr;
  TORCH_CHECK(st == UCS_OK, "pipe: cannot create an endpoint to ", peer_, ": ",
              ucs_status_string(st));
}

std::shared_ptr<Op> Endpoint::start(Dir dir, void* data, size_t n, const at::Tensor& owner,
                                    std::function<void(ucs_status_t, size_t)> then,
                                    const Head* head, ucp_tag_message_h message) {
  auto op = std::make_shared<Op>();
  op->owner = owner;
  op->then = std::move(then);
  const bool tag_recv = dir == Dir::kRecv || dir == Dir::kRecvJoined;
  if (ep_ == nullptr && !tag_recv) {
    worker_->complete(*op, UCS_ERR_NOT_CONNECTED, 0);
    return op;
  }
  auto* ctx = new CallbackContext{op, worker_.get()};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = ctx;
  param.cb.send = &on_send;
  ucp_tag_recv_info_t tag_info{};
  size_t length = 0;
  ucs_status_ptr_t req = nullptr;
  switch (dir) {
    case Dir::kSend: req = ucp_tag_send_nbx(ep_, data, n, peer_info_.tag, &param); break;
    case Dir::kSyncSend: req = ucp_tag_send_sync_nbx(ep_, data, n, peer_info_.tag, &param); break;
    case Dir::kRecv:  // receives match on the worker, by our tag (or take a stashed message)
    case Dir::kRecvJoined: {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
      param.recv_info.tag_info = &tag_info;
      param.cb.recv = &on_tag_recv;
      void* buffer = data;
      size_t count = n;
      if (dir == Dir::kRecvJoined) {  // 1 byte into the head, the rest into `data`
        TORCH_INTERNAL_ASSERT(head != nullptr);
        op->head_owner = head->owner;
        op->iov[0] = {head->data, 1};
        op->iov[1] = {data, n};
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        param.datatype = ucp_dt_make_iov();
        buffer = op->iov;
        count = 2;
      }
      req = message != nullptr
                ? ucp_tag_msg_recv_nbx(worker_->handle(), buffer, count, message, &param)
                : ucp_tag_recv_nbx(worker_->handle(), buffer, count, recv_tag_, kFullMask, &param);
      break;
    }
    case Dir::kStreamSend: req = ucp_stream_send_nbx(ep_, data, n, &param); break;
    case Dir::kStreamRecv:
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_STREAM_RECV_FLAG_WAITALL;
      param.cb.recv_stream = &on_stream_recv;
      req = ucp_stream_recv_nbx(ep_, data, n, &length, &param);
      break;
    case Dir::kFlush: req = ucp_ep_flush_nbx(ep_, &param); break;
    case Dir::kClose:  // the orderly close: UCX flushes, then tells the peer
      req = ucp_ep_close_nbx(ep_, &param);
      ep_ = nullptr;
      break;
  }
  if (!UCS_PTR_IS_PTR(req)) {  // completed (or failed) at once: no callback will come
    delete ctx;
    const ucs_status_t st = UCS_PTR_STATUS(req);
    const size_t got = tag_recv ? tag_info.length : length;
    worker_->complete(*op, st, st == UCS_OK ? got : 0);
    return op;
  }
  op->request = req;
  worker_->adopt(ctx);
  if (tag_recv) {
    std::erase_if(recvs_, [](const std::shared_ptr<Op>& o) { return o->done.load(); });
    recvs_.push_back(op);
  }
  return op;
}

void Endpoint::wait_op(const std::shared_ptr<Op>& op, Dir dir, size_t n, const char* what,
                       Millis timeout) {
  const bool recv = dir == Dir::kRecv || dir == Dir::kRecvJoined || dir == Dir::kStreamRecv;
  if (!op->done.load() && !worker_->wait(*op, Clock::now() + timeout)) {
    // The message stream is now out of step: break the endpoint, which completes the operation.
    std::string failure;
    {
      auto lk = worker_->lock();
      break_locked(c10::str(op_name(recv), " ", what, " (", n, " bytes) timed out after ",
                            to_ms(timeout), " ms"));
      failure = failure_;
    }
    worker_->wait(*op, Clock::now() + kTeardownGrace);
    TD_THROW(TimeoutError, op_name(recv), " ", what, ": peer ", peer_, ": ", failure);
  }
  if (op->status == UCS_OK) {
    if (!recv || op->length == n || (dir == Dir::kRecvJoined && op->length == 1)) return;
    const std::string why =
        c10::str("recv ", what, ": peer ", peer_, " sent a message of ", op->length,
                 " bytes where ", dir == Dir::kRecvJoined ? "1 or " : "", n, " were expected");
    fail(why);
    TD_THROW(MalformedPeerDataError, why);
  }
  if (op->status == UCS_ERR_MESSAGE_TRUNCATED) {
    const std::string why = c10::str("recv ", what, ": peer ", peer_,
                                     " sent a message longer than the ", n, " bytes expected");
    fail(why);
    TD_THROW(MalformedPeerDataError, why);
  }
  auto lk = worker_->lock();
  throw_unusable(op_name(recv), what);
}

void Endpoint::throw_unusable(const char* op, const char* what) {
  // UCX lock held by the caller.
  if (malformed_) {
    TD_THROW(MalformedPeerDataError, op, " ", what, ": the pipe to ", peer_,
             " is broken: ", failure_);
  }
  if (!failure_.empty()) {
    TD_THROW(PeerLostError, op, " ", what, ": the pipe to ", peer_, " is broken: ", failure_);
  }
  if (closed_) TD_THROW(PipeClosedError, op, " ", what, ": the pipe to ", peer_, " is closed");
  if (peer_gone_) {
    TD_THROW(PeerLostError, op, " ", what, ": the peer ", peer_, " disconnected or failed");
  }
  TD_THROW(PeerLostError, op, " ", what, ": the pipe to ", peer_, " is not connected");
}

void Endpoint::send(const void* data, size_t n, const at::Tensor& owner, const char* what,
                    Millis timeout) {
  std::shared_ptr<Op> op;
  {
    auto lk = worker_->lock();
    if (closed_ || peer_gone_ || !failure_.empty() || ep_ == nullptr) throw_unusable("send", what);
    op = start(Dir::kSend, const_cast<void*>(data), n, owner);
  }
  wait_op(op, Dir::kSend, n, what, timeout);
}

Endpoint::CreditPlan::CreditPlan(size_t window)
    : every(std::max<size_t>(1, window / 4)),
      credits(std::max<size_t>(1, (window + 1) / every - 1)) {}

bool Endpoint::credit_available(size_t window, Micros spin) {
  const CreditPlan plan(window);
  if (credit_count_ % plan.every != 0) return true;  // not a credit: nothing to wait for
  // The peer's receipts may wait unprogressed in UCX: progress at least once.
  return worker_->spin_until(
      [&] {
        while (!credits_.empty() && credits_.front()->done.load()) credits_.pop_front();
        return credits_.size() < plan.credits;
      },
      spin, Clock::now() + spin);
}

void Endpoint::arrived_locked(ucp_tag_message_h message, size_t length) {
  if (closed_ || !failure_.empty()) {  // nobody will read it: let UCX release it now
    worker_->discard_locked(message);
    return;
  }
  if (length > limits_.max_message_bytes) {
    worker_->discard_locked(message);
    refuse_locked(c10::str("the peer ", peer_, " sent a message of ", length,
                           " bytes, longer than any this pipe receives (",
                           limits_.max_message_bytes,
                           " bytes: its max_storage_bytes or max_metadata_bytes, or half the "
                           "physical memory, whichever is larger)"));
    return;
  }
  Stashed s;
  s.message = message;
  s.length = length;
  s.charge = UnreadCharge::of(length);
  unread_bytes_ += s.charge;
  stash_.push_back(std::move(s));
  recharge_locked();
  if (unread_bytes_ > limits_.max_unread_bytes) {
    refuse_locked(c10::str("the peer ", peer_, " left ", stash_.size(), " messages (",
                           unread_bytes_,
                           " bytes with UCX's overhead) unread here, over the limit "
                           "of ",
                           limits_.max_unread_bytes, " bytes (PipeOptions::max_unread_bytes)"));
  }
}

void Endpoint::recharge_locked() {
  // The oldest message over kEagerBytes that UCX still holds is charged UCX's overhead only: it
  // may be a rendezvous (its bytes at the sender), and an honest peer has one in flight at most.
  // Every other is charged whole: a later long one was sent eagerly, its bytes here.
  for (auto& s : stash_) {
    if (s.message == nullptr || s.length <= UnreadCharge::kEagerBytes) continue;
    unread_bytes_ = unread_bytes_ - s.charge + UnreadCharge::kOverhead;
    s.charge = UnreadCharge::kOverhead;
    return;  // the later ones were charged whole when they came
  }
}

void Endpoint::refuse_locked(const std::string& why) {
  if (failure_.empty()) malformed_ = true;
  break_locked(why);
}

void Endpoint::drop_stash_locked() {
  // A landing one is cancelled with the other receives, or freed with the worker; one UCX still
  // holds is dropped now, releasing what UCX keeps for it.
  for (auto& s : stash_) {
    if (s.message != nullptr) worker_->discard_locked(s.message);
  }
  stash_.clear();
  landed_bytes_ = 0;
  unread_bytes_ = 0;
}

void Endpoint::land_locked(Stashed& s) {
  // A stream of small messages reuses one buffer (no allocation per message).
  constexpr size_t kSpareBytes = 16 << 10;
  if (s.length <= kSpareBytes && !spare_.defined()) spare_ = bytes_tensor(kSpareBytes);
  const bool spare = s.length <= kSpareBytes && spare_.use_count() == 1;
  s.data = spare ? spare_ : bytes_tensor(std::max<size_t>(s.length, 1));
  s.op = start(Dir::kRecv, s.data.data_ptr(), s.length, s.data, {}, nullptr, s.message);
  s.message = nullptr;
  landed_bytes_ += s.length;
  // Its bytes are ours now, whatever it was charged while UCX held it.
  unread_bytes_ = unread_bytes_ - s.charge + UnreadCharge::of(s.length);
  s.charge = UnreadCharge::of(s.length);
  recharge_locked();
}

std::shared_ptr<Op> Endpoint::take_stashed_locked(Dir dir, void* data, size_t n,
                                                  const at::Tensor& owner, const Head* head) {
  Stashed s = std::move(stash_.front());
  stash_.pop_front();
  unread_bytes_ -= s.charge;
  if (s.message != nullptr) {  // straight into the caller's buffer
    recharge_locked();
    return start(dir, data, n, owner, {}, head, s.message);
  }
  landed_bytes_ -= s.length;
  // Landed (or landing) in the stash's buffer: copied into the caller's once there.
  auto op = std::make_shared<Op>();
  op->owner = owner;
  if (head != nullptr) op->head_owner = head->owner;
  auto copy = [worker = worker_.get(), op, buffer = s.data, joined = dir == Dir::kRecvJoined, data,
               n, head_data = head != nullptr ? head->data : nullptr](ucs_status_t st, size_t len) {
    if (st == UCS_OK && len > (joined ? 1 + n : n)) st = UCS_ERR_MESSAGE_TRUNCATED;
    if (st == UCS_OK && len > 0) {
      const auto* bytes = buffer.const_data_ptr<uint8_t>();
      if (joined) {
        head_data[0] = bytes[0];
        std::memcpy(data, bytes + 1, len - 1);
      } else {
        std::memcpy(data, bytes, len);
      }
    }
    worker->complete(*op, st, st == UCS_OK ? len : 0);
  };
  if (s.op->done.load()) {
    copy(s.op->status, s.op->length);
  } else {
    s.op->then = std::move(copy);  // UCX lock held: its completion has not run yet
  }
  return op;
}

Peeked Endpoint::peek_locked(size_t i, size_t stash_limit) {
  if (closed_ || !failure_.empty()) return {Peeked::kUnusable};
  worker_->collect_locked();
  if (closed_ || !failure_.empty()) return {Peeked::kUnusable};  // the peer went over a limit
  // A peer that left sends nothing more: a receive fails at once.
  if (stash_.size() <= i) return {peer_gone_ ? Peeked::kUnusable : Peeked::kNotYet};
  Stashed& s = stash_[i];
  if (s.message != nullptr) {
    // Still UCX's: received into the stash if the look-ahead may hold it, else left for the
    // receive that posts its buffer.
    if (landed_bytes_ + s.length > stash_limit) return {Peeked::kTooLarge, s.length};
    land_locked(s);
  }
  if (!s.op->done.load()) return {Peeked::kNotYet, s.length};  // still landing
  if (s.op->status != UCS_OK) return {Peeked::kUnusable};      // its receive reports why
  return {Peeked::kLanded, s.length, s.data.const_data_ptr<uint8_t>()};
}

Arrival Endpoint::look_ahead(const std::function<Arrival(MessagePeek&)>& decide, size_t stash_limit,
                             Micros spin) {
  struct Peek final : MessagePeek {
    Endpoint& e;
    size_t limit;
    Peek(Endpoint& ep, size_t l) : e(ep), limit(l) {}
    Peeked peek(size_t i) override { return e.peek_locked(i, limit); }
  } peek(*this, stash_limit);
  Arrival answer = Arrival::kIncomplete;
  worker_->spin_until(  // `ready` runs with the UCX lock held
      [&] {
        answer = decide(peek);
        return answer != Arrival::kIncomplete;
      },
      spin, Clock::now() + spin);
  return answer;
}

bool Endpoint::recv_would_not_wait(Micros spin) {
  const auto arrived = [this] {  // UCX lock held
    worker_->collect_locked();
    if (!stash_.empty()) return true;  // the next message is here, unread
    return closed_ || peer_gone_ || !failure_.empty() || ep_ == nullptr;
  };
  return worker_->spin_until(arrived, spin, Clock::now() + spin);
}

void Endpoint::send_credit(const void* data, size_t n, const at::Tensor& owner, const char* what,
                           size_t window, Millis timeout) {
  // Every `every`-th first frame is a synchronous send (a credit), which completes once the
  // peer has matched it; at most `credits` of them may be in flight. Then at most
  // (credits + 1) * every - 1 <= window messages are unreceived, and only one message in
  // `every` pays for the peer's acknowledgement (a round trip's worth of latency).
  const CreditPlan plan(window);
  const size_t every = plan.every, credits = plan.credits;
  const bool credit = credit_count_++ % every == 0;
  if (!credit) return send(data, n, owner, what, timeout);
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::shared_ptr<Op> oldest;
    {
      auto lk = worker_->lock();
      while (!credits_.empty() && credits_.front()->done.load()) credits_.pop_front();
      if (closed_ || peer_gone_ || !failure_.empty() || ep_ == nullptr) {
        throw_unusable("send", what);
      }
      if (credits_.size() < credits) {
        auto op = start(Dir::kSyncSend, const_cast<void*>(data), n, owner);
        if (op->done.load() && op->status != UCS_OK) throw_unusable("send", what);
        if (!op->done.load()) credits_.push_back(std::move(op));
        return;
      }
      oldest = credits_.front();
    }
    if (!worker_->wait(*oldest, deadline)) {
      --credit_count_;  // nothing was sent: the next send is the credit again
      TD_THROW(TimeoutError, "send ", what, ": the peer ", peer_,
               " has not started receiving the "
               "last ",
               window, " messages within ", to_ms(timeout),
               " ms (PipeOptions::max_unreceived); nothing was sent");
    }
  }
}

std::shared_ptr<Op> Endpoint::post_recv(Dir dir, void* data, size_t n, const at::Tensor& owner,
                                        const char* what, const Head* head) {
  auto lk = worker_->lock();
  // A peer that left may have left messages behind: they stay readable, in order.
  if (closed_ || !failure_.empty()) throw_unusable("recv", what);
  // The messages that came before any receive was posted go first: a receive posted now would
  // match the next one UCX still has.
  if (!stash_.empty()) return take_stashed_locked(dir, data, n, owner, head);
  auto op = start(dir, data, n, owner, {}, head);
  if (!op->done.load() && peer_gone_) ucp_request_cancel(worker_->handle(), op->request);
  return op;
}

std::shared_ptr<Op> Endpoint::post_message(bool recv, bool sync, void* data, size_t n,
                                           const at::Tensor& owner, const char* what) {
  if (recv) return post_recv(Dir::kRecv, data, n, owner, what);
  auto lk = worker_->lock();
  if (closed_ || peer_gone_ || !failure_.empty() || ep_ == nullptr) throw_unusable("send", what);
  return start(sync ? Dir::kSyncSend : Dir::kSend, data, n, owner);
}

bool Endpoint::wait_message(const std::shared_ptr<Op>& op, Clock::time_point deadline, bool recv,
                            const char* what) {
  if (!op->done.load() && !worker_->wait(*op, deadline)) return false;
  if (op->status == UCS_OK) return true;
  if (op->status == UCS_ERR_MESSAGE_TRUNCATED) {
    const std::string why =
        c10::str("recv ", what, ": peer ", peer_, " sent a message longer than expected");
    fail(why);
    TD_THROW(MalformedPeerDataError, why);
  }
  auto lk = worker_->lock();
  throw_unusable(op_name(recv), what);
}

void Endpoint::recv(void* data, size_t n, const at::Tensor& owner, const char* what,
                    Millis timeout) {
  wait_op(post_recv(Dir::kRecv, data, n, owner, what), Dir::kRecv, n, what, timeout);
}

size_t Endpoint::recv_joined(uint8_t* head, const at::Tensor& head_owner, void* data, size_t n,
                             const at::Tensor& owner, const char* what, Millis timeout) {
  const Head h{head, head_owner};
  const auto op = post_recv(Dir::kRecvJoined, data, n, owner, what, &h);
  wait_op(op, Dir::kRecvJoined, 1 + n, what, timeout);
  return op->length;
}

bool Endpoint::drain(Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  std::deque<std::shared_ptr<Op>> credits;
  {
    auto lk = worker_->lock();
    credits = credits_;
  }
  for (const auto& op : credits) {
    if (!worker_->wait(*op, deadline)) return false;
  }
  return true;
}

bool Endpoint::closed() const {
  auto lk = worker_->lock();
  return closed_;
}

bool Endpoint::peer_gone() const {
  auto lk = worker_->lock();
  return peer_gone_;
}

void Endpoint::force_close_locked() {
  // Receives belong to the worker, not the endpoint: cancel ours, or they would wait forever.
  for (const auto& op : recvs_) {
    if (!op->done.load() && op->request != nullptr) {
      ucp_request_cancel(worker_->handle(), op->request);
    }
  }
  recvs_.clear();
  if (ep_ == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  param.cb.send = &free_request;
  // A forced close completes every outstanding send of the endpoint with an error.
  const ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &param);
  (void)req;  // a request, if any, is freed by its callback
  ep_ = nullptr;
  worker_->notify();
}

void Endpoint::break_locked(const std::string& why) {
  if (failure_.empty()) failure_ = why;
  force_close_locked();
  drop_stash_locked();
  // What UCX still holds for us goes too (the worker hands it here, and this drops it), so that
  // no message of the peer's outlives the endpoint in a shared worker.
  worker_->collect_locked();
}

void Endpoint::fail(const std::string& why) {
  auto lk = worker_->lock();
  break_locked(why);
}

void Endpoint::on_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t /*status*/) {
  // Inside a progress call (UCX lock held): record, and leave the UCX calls to after it.
  auto* self = static_cast<Endpoint*>(arg);
  self->peer_gone_ = true;
  // A failed endpoint must be closed with force; no more messages will come from the peer, so
  // a receive that matched nothing yet never will (force_close_locked cancels it). UCX may call
  // this outside a progress call (closing an endpoint), so the task may run after the endpoint
  // is gone: it holds the endpoint's token, which the destructor drops under the UCX lock.
  self->worker_->defer([token = std::weak_ptr<Endpoint*>(self->token_)] {
    if (auto alive = token.lock()) (*alive)->force_close_locked();
  });
  self->worker_->notify();
}

void Endpoint::close(Millis timeout) noexcept {
  std::shared_ptr<Op> op;
  {
    auto lk = worker_->lock();
    if (closed_) return;
    closed_ = true;
    // A healthy endpoint closes in flush mode: what was sent is delivered, and the peer sees an
    // orderly disconnect. Bounded, as every wait; otherwise by force.
    if (ep_ != nullptr && !peer_gone_ && failure_.empty()) op = start(Dir::kClose, nullptr, 0, {});
    force_close_locked();  // cancels our receives; the endpoint is gone already after kClose
    drop_stash_locked();
    worker_->collect_locked();  // and drops what UCX still holds for us
  }
  if (op) worker_->wait(*op, Clock::now() + std::min(timeout, kTeardownGrace));
}

std::string Endpoint::transports() {
  auto lk = worker_->lock();
  if (ep_ == nullptr) return "";
  ucp_transport_entry_t entries[16];
  ucp_ep_attr_t attr{};
  attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
  attr.transports.entries = entries;
  attr.transports.num_entries = 16;
  attr.transports.entry_size = sizeof(ucp_transport_entry_t);
  if (ucp_ep_query(ep_, &attr) != UCS_OK) return "";
  std::vector<std::string> seen;
  std::string out;
  for (unsigned i = 0; i < attr.transports.num_entries; ++i) {
    // A lane without a device is the connection manager's (the sockaddr "tcp/"), not data.
    const char* device = entries[i].device_name;
    if (device == nullptr || *device == '\0') continue;
    std::string one = c10::str(entries[i].transport_name, "/", device);
    if (std::find(seen.begin(), seen.end(), one) != seen.end()) continue;  // one per transport
    out += (out.empty() ? "" : ", ") + one;
    seen.push_back(std::move(one));
  }
  return out;
}

std::shared_ptr<Endpoint> Endpoint::connect(std::shared_ptr<Worker> worker, const std::string& host,
                                            int port, Millis timeout, const UnreadLimits& limits) {
  const SockAddr addr = resolve(host, port, /*passive=*/false);
  auto ep = std::make_shared<Endpoint>(worker, c10::str(host, ":", port), limits);
  const auto deadline = Clock::now() + timeout;
  auto left = [&] {
    return std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
  };
  try {
    std::shared_ptr<Op> op;
    {
      auto lk = worker->lock();
      ucp_ep_params_t params{};
      params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
      params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr.storage);
      params.sockaddr.addrlen = addr.length;
      ep->create_locked(params);
      // ucxx's exchange: the connecting side receives the listener's info first.
      op = ep->start(Dir::kStreamRecv, ep->handshake_.data_ptr<uint8_t>() + 16, 16, ep->handshake_);
    }
    ep->wait_op(op, Dir::kStreamRecv, 16, "the peer info", left());
    ep->peer_info_ = read_peer_info(ep->handshake_.data_ptr<uint8_t>() + 16);
    write_peer_info(ep->recv_tag_, ep->handshake_.data_ptr<uint8_t>());
    {
      auto lk = worker->lock();
      op = ep->start(Dir::kStreamSend, ep->handshake_.data_ptr(), 16, ep->handshake_);
    }
    ep->wait_op(op, Dir::kStreamSend, 16, "the peer info", left());
  } catch (const c10::Error& e) {
    ep->close(Millis(0));
    TD_THROW(PeerLostError, "connect: cannot connect to ", host, ":", port, ": ",
             e.what_without_backtrace());
  }
  return ep;
}

}  // namespace tensordict::pipe::detail
