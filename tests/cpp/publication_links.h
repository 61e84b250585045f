#pragma once
// Links for publication's contract (publication_contract.h): a loopback link, two ends in one
// process with nothing in between (and LoopbackPeerLink, one between two subscribers, which
// relays use), and a link that injects faults into any transport's link (delay, stall, close,
// lose, tamper), which the contract wraps around every transport's ends.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tensordict/errors.h"
#include "wire/publication_link.h"

namespace publication_contract {

namespace pub = tensordict::wire::publication;
using Clock = std::chrono::steady_clock;
using pub::Kind;

/// The two ends of a connection: the publisher's and the subscriber's.
enum class Side { kPublisher = 0, kSubscriber = 1 };

inline bool is_message(Kind kind) { return kind == Kind::kRequest || kind == Kind::kOffer; }

// ---- the loopback -------------------------------------------------------------------------------

/// One connection in memory. Messages go one way per Kind (requests to the publisher, the rest
/// to the subscriber) and are matched in order, as Gloo and UCX match a tag's messages: a send
/// completes once a receive of its kind is posted (so a request nobody takes never completes),
/// its bytes copied then. A message longer than the receive's buffer, or a request or an offer
/// of any length but 64 bytes, is a MalformedPeerDataError from the receive's wait.
class LoopbackWire {
 public:
  struct Message final : pub::Pending {
    at::Tensor buffer;
    Kind kind = Kind::kRequest;
    bool recv = false;
    bool done = false;
    size_t length = 0;   // a receive's, once done
    std::string error;   // a receive's refusal of the message that came
    at::Tensor copy_to;  // a kept receive taken over: its bytes go here once done
  };
  using MessagePtr = std::shared_ptr<Message>;

  MessagePtr post(const at::Tensor& buffer, Kind kind, bool recv) {
    auto m = std::make_shared<Message>();
    m->buffer = buffer;
    m->kind = kind;
    m->recv = recv;
    std::lock_guard<std::mutex> lock(mutex_);
    auto& mine = (recv ? recvs_ : sends_)[kind];
    auto& theirs = (recv ? sends_ : recvs_)[kind];
    if (theirs.empty()) {
      mine.push_back(m);
      return m;
    }
    MessagePtr other = theirs.front();
    theirs.pop_front();
    match(recv ? *other : *m, recv ? *m : *other);
    changed_.notify_all();
    return m;
  }

  bool wait(Message& m, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    // The end across from the one that posted `m`: requests go to the publisher, the rest to
    // the subscriber.
    const bool to_publisher = m.kind == Kind::kRequest;
    const Side mine = m.recv == to_publisher ? Side::kPublisher : Side::kSubscriber;
    const bool& peer_closed = closed_[1 - static_cast<int>(mine)];
    if (!changed_.wait_until(lock, deadline, [&] { return m.done || peer_closed; })) return false;
    if (!m.done) {
      // A clean close where a request or an offer is due, as a pipe's close marker reads.
      TD_CHECK_AS(PeerLostError, m.recv && is_message(m.kind),
                  "the loopback's other end closed: this message cannot complete");
      TD_THROW(PeerClosedError, "the loopback's other end closed");
    }
    TD_CHECK_PEER(m.error.empty(), m.error);
    if (m.copy_to.defined()) {
      m.copy_to.narrow(0, 0, static_cast<int64_t>(m.length))
          .copy_(m.buffer.narrow(0, 0, static_cast<int64_t>(m.length)));
      m.copy_to = at::Tensor();
    }
    return true;
  }

  /// `side` closes its end: what the other end waits for and did not get fails (a clean
  /// close where a request or an offer is due: PeerClosedError; otherwise PeerLostError).
  void close(Side side) {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_[static_cast<int>(side)] = true;
    changed_.notify_all();
  }

 private:
  static void match(Message& send, Message& recv) {
    const auto n = static_cast<size_t>(send.buffer.numel());
    if (n > static_cast<size_t>(recv.buffer.numel())) {
      recv.error = c10::str("the loopback's peer sent a message of ", n, " bytes, longer than the ",
                            recv.buffer.numel(), " bytes announced");
    } else if (is_message(recv.kind) && n != pub::kMessageBytes) {
      recv.error = c10::str("the loopback's peer sent a message of ", n, " bytes where ",
                            pub::kMessageBytes, " were expected");
    } else {
      std::memcpy(recv.buffer.data_ptr(), send.buffer.data_ptr(), n);
    }
    recv.length = n;
    recv.done = send.done = true;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<Kind, std::deque<MessagePtr>> sends_, recvs_;
  bool closed_[2] = {false, false};
};

/// One end of a LoopbackWire. A kept request receive is the next post_recv's of a request.
class LoopbackLink final : public pub::Link {
 public:
  LoopbackLink(std::shared_ptr<LoopbackWire> wire, Side side)
      : wire_(std::move(wire)), side_(side) {}

  pub::PendingPtr post_recv(const at::Tensor& buffer, Kind kind) override {
    if (kind == Kind::kRequest && !kept_.empty()) {
      auto m = kept_.front();
      kept_.pop_front();
      m->copy_to = buffer;
      return m;
    }
    return wire_->post(buffer, kind, /*recv=*/true);
  }
  pub::PendingPtr post_send(const at::Tensor& buffer, Kind kind) override {
    return wire_->post(buffer, kind, /*recv=*/false);
  }
  bool wait(const pub::PendingPtr& p, Clock::time_point deadline) override {
    return wire_->wait(static_cast<LoopbackWire::Message&>(*p), deadline);
  }
  bool short_message(const pub::PendingPtr& p) const override {
    const auto& m = static_cast<const LoopbackWire::Message&>(*p);
    return m.length < static_cast<size_t>(m.buffer.numel());
  }
  void keep(const std::vector<pub::PendingPtr>& posted) override {
    for (const auto& p : posted) {
      auto m = std::static_pointer_cast<LoopbackWire::Message>(p);
      if (m->recv && m->kind == Kind::kRequest) kept_.push_back(m);
      held_.push_back(std::move(m));  // the rest: alive as long as the link
    }
  }
  std::string peer() const override {
    return side_ == Side::kPublisher ? "the loopback's subscriber" : "the loopback's publisher";
  }
  std::string no_publisher() const override { return "nothing serves the loopback's other end"; }

 private:
  std::shared_ptr<LoopbackWire> wire_;
  Side side_;
  std::deque<std::shared_ptr<LoopbackWire::Message>> kept_;
  std::vector<std::shared_ptr<LoopbackWire::Message>> held_;
};

/// One end of a link between two subscribers (relayed pieces, docs/wire-format.md §9.9), over
/// two LoopbackWires, one a direction: what this end sends goes on `out`, what it receives
/// comes from `in`, so that either end may be the parent of some version and the child of
/// another without ever taking its own messages.
class LoopbackPeerLink final : public pub::Link {
 public:
  LoopbackPeerLink(std::shared_ptr<LoopbackWire> out, std::shared_ptr<LoopbackWire> in,
                   std::string peer)
      : out_(std::move(out)), in_(std::move(in)), peer_(std::move(peer)) {}

  pub::PendingPtr post_recv(const at::Tensor& buffer, Kind kind) override {
    return in_->post(buffer, kind, /*recv=*/true);
  }
  pub::PendingPtr post_send(const at::Tensor& buffer, Kind kind) override {
    return out_->post(buffer, kind, /*recv=*/false);
  }
  bool wait(const pub::PendingPtr& p, Clock::time_point deadline) override {
    auto& m = static_cast<LoopbackWire::Message&>(*p);
    return (m.recv ? in_ : out_)->wait(m, deadline);
  }
  bool short_message(const pub::PendingPtr& p) const override {
    const auto& m = static_cast<const LoopbackWire::Message&>(*p);
    return m.length < static_cast<size_t>(m.buffer.numel());
  }
  void keep(const std::vector<pub::PendingPtr>& posted) override {
    for (const auto& p : posted)
      held_.push_back(std::static_pointer_cast<LoopbackWire::Message>(p));
  }
  std::string peer() const override { return peer_; }
  std::string no_publisher() const override { return c10::str(peer_, " is a subscriber"); }

 private:
  std::shared_ptr<LoopbackWire> out_, in_;
  std::string peer_;
  std::vector<std::shared_ptr<LoopbackWire::Message>> held_;  // alive as long as the link
};

// ---- faults -------------------------------------------------------------------------------------

/// What a test injects into one connection; the FaultyLinks of both its ends obey it. Faults act
/// on waits: what a transport did underneath is its own business.
class Faults {
 public:
  /// The publisher's sends of `kind` complete no sooner than `d` after they were posted.
  void delay(Kind kind, Clock::duration d) {
    std::lock_guard<std::mutex> lock(mutex_);
    delays_[kind] = d;
  }
  /// Messages of `kind` are not taken until release(): both ends' waits on them time out.
  void stall(Kind kind) {
    std::lock_guard<std::mutex> lock(mutex_);
    stalled_.insert(kind);
  }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    stalled_.clear();
    delays_.clear();
    changed_.notify_all();
  }
  /// Each message of `kind` received over this connection (either end), once its wait saw it
  /// in, is handed to `fn` first, which may rewrite its bytes: a peer that forges in flight.
  void tamper(Kind kind, std::function<void(at::Tensor&)> fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    tamper_[kind] = std::move(fn);
  }
  /// `side` closed its end cleanly: the other end's waits on a request or an offer raise
  /// PeerClosedError, its other waits PeerLostError.
  void close(Side side) {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_[static_cast<int>(side)] = true;
    changed_.notify_all();
  }
  /// The connection is lost: every wait of both ends raises PeerLostError.
  void lose() {
    std::lock_guard<std::mutex> lock(mutex_);
    lost_ = true;
    changed_.notify_all();
  }

  /// The publisher's data sends: when the offer before each was posted (an answer's first
  /// message), when it was posted, and when its wait saw it taken (max() while not).
  struct Send {
    Clock::time_point offered, posted, taken = Clock::time_point::max();
  };
  std::vector<Send> data_sends() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return sends_;
  }
  /// Waits until `n` data sends were posted; false after `timeout`.
  bool await_data_sends(size_t n, Clock::duration timeout) const {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return sends_.size() >= n; });
  }

 private:
  friend class FaultyLink;

  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::map<Kind, Clock::duration> delays_;
  std::map<Kind, std::function<void(at::Tensor&)>> tamper_;
  std::set<Kind> stalled_;
  bool closed_[2] = {false, false};
  bool lost_ = false;
  std::vector<Send> sends_;
  Clock::time_point offered_;  // the publisher's last offer
};

/// `inner`, the `side` end of a connection, obeying `faults`. A message is waited on through
/// the link that posted it (std::logic_error otherwise, naming both links).
class FaultyLink final : public pub::Link {
 public:
  FaultyLink(std::shared_ptr<pub::Link> inner, std::shared_ptr<Faults> faults, Side side)
      : inner_(std::move(inner)), faults_(std::move(faults)), side_(side) {}

  pub::PendingPtr post_recv(const at::Tensor& buffer, Kind kind) override {
    auto p = record(kind, true);
    p->buffer = buffer;
    p->inner = inner_->post_recv(buffer, kind);
    return p;
  }
  pub::PendingPtr post_send(const at::Tensor& buffer, Kind kind) override {
    auto p = record(kind, false);  // before the transport may deliver it
    p->inner = inner_->post_send(buffer, kind);
    return p;
  }

  bool wait(const pub::PendingPtr& pending, Clock::time_point deadline) override {
    auto& p = static_cast<Pending&>(*pending);
    if (p.owner != this) {
      // A message is waited on through the link that posted it: another link's wait would
      // apply its own connection's faults and watch its own peer, not the message's.
      throw std::logic_error(c10::str("FaultyLink: a wait on the link to ", peer(),
                                      " for a message posted on the link to ", p.owner->peer(),
                                      " (", p.recv ? "receive" : "send", ")"));
    }
    Faults& f = *faults_;
    {
      std::unique_lock<std::mutex> lock(f.mutex_);
      for (;;) {
        throw_injected(p, lock);
        const auto delay = f.delays_.find(p.kind);
        const auto ready = !p.recv && side_ == Side::kPublisher && delay != f.delays_.end()
                               ? p.posted + delay->second
                               : Clock::time_point::min();
        const bool held = f.stalled_.count(p.kind) > 0 || Clock::now() < ready;
        if (!held) break;
        if (Clock::now() >= deadline) return false;
        f.changed_.wait_until(lock, std::min(deadline, std::max(ready, Clock::now() + kLook)));
      }
    }
    if (!inner_->wait(p.inner, deadline)) return false;
    if (p.recv && !p.tampered) {
      std::function<void(at::Tensor&)> fn;
      {
        std::lock_guard<std::mutex> lock(f.mutex_);
        const auto t = f.tamper_.find(p.kind);
        if (t != f.tamper_.end()) fn = t->second;
      }
      p.tampered = true;
      if (fn) fn(p.buffer);
    }
    if (p.send_index >= 0) {
      std::lock_guard<std::mutex> lock(f.mutex_);
      auto& s = f.sends_[static_cast<size_t>(p.send_index)];
      s.taken = std::min(s.taken, Clock::now());
    }
    return true;
  }

  bool short_message(const pub::PendingPtr& p) const override {
    return inner_->short_message(static_cast<const Pending&>(*p).inner);
  }
  void keep(const std::vector<pub::PendingPtr>& posted) override {
    std::vector<pub::PendingPtr> inner;
    for (const auto& p : posted) inner.push_back(static_cast<const Pending&>(*p).inner);
    inner_->keep(inner);
  }
  std::string peer() const override { return inner_->peer(); }
  std::string no_publisher() const override { return inner_->no_publisher(); }

 private:
  static constexpr auto kLook = std::chrono::milliseconds(5);

  struct Pending final : pub::Pending {
    FaultyLink* owner = nullptr;  // the link that posted it
    pub::PendingPtr inner;
    Kind kind = Kind::kRequest;
    bool recv = false;
    Clock::time_point posted;
    at::Tensor buffer;        // a receive's
    bool tampered = false;    // a receive's bytes were handed to Faults::tamper's function
    int64_t send_index = -1;  // in Faults::sends_, for a publisher's data send
  };

  std::shared_ptr<Pending> record(Kind kind, bool recv) {
    auto p = std::make_shared<Pending>();
    p->owner = this;
    p->kind = kind;
    p->recv = recv;
    p->posted = Clock::now();
    if (side_ == Side::kPublisher && !recv && kind == Kind::kOffer) {
      std::lock_guard<std::mutex> lock(faults_->mutex_);
      faults_->offered_ = p->posted;
    }
    if (side_ == Side::kPublisher && !recv && kind == Kind::kData) {
      std::lock_guard<std::mutex> lock(faults_->mutex_);
      p->send_index = static_cast<int64_t>(faults_->sends_.size());
      faults_->sends_.push_back({faults_->offered_, p->posted});
      faults_->changed_.notify_all();
    }
    return p;
  }

  void throw_injected(const Pending& p, std::unique_lock<std::mutex>& lock) {
    const Faults& f = *faults_;
    const bool lost = f.lost_;
    const bool closed = f.closed_[1 - static_cast<int>(side_)];
    if (!lost && !closed) return;
    lock.unlock();
    if (lost) TD_THROW(PeerLostError, "the connection to ", peer(), " was lost");
    TD_CHECK_AS(PeerLostError, p.recv && is_message(p.kind), peer(), " closed its end: the ",
                p.recv ? "receive" : "send", " cannot complete");
    TD_THROW(PeerClosedError, peer(), " closed its end");
  }

  std::shared_ptr<pub::Link> inner_;
  std::shared_ptr<Faults> faults_;
  Side side_;
};

}  // namespace publication_contract
