#pragma once
// What a pipe moves its messages through: a UCX endpoint of ours (ucx_endpoint.h), or a
// transport the caller supplies (CallerTransport, pipe.h; in Python, a ucxx endpoint). No UCX here.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

#include "wire/pipe_frames.h"

namespace tensordict::pipe::detail {

// The pipe's bytes (src/wire/pipe_frames.cpp): flags, peer info, the frame reader.
using namespace ::tensordict::wire::frames;

using Millis = std::chrono::milliseconds;

/// One connection's messages, in order, each sent or received whole. Blocking calls; errors
/// are exceptions. See Endpoint for the UCX one's contract (timeouts, breaking, the window).
class Connection {
 public:
  virtual ~Connection() = default;
  /// Sends one message of `n` bytes at `data` (kept alive by `owner`) and returns when the
  /// buffer may be reused.
  virtual void send(const void* data, size_t n, const at::Tensor& owner, const char* what,
                    Millis timeout) = 0;
  /// The first message of a TensorDict, the flow control's credit: it may return before the
  /// peer has it, holding at most `window` such messages in flight (`owner` keeps them alive).
  virtual void send_credit(const void* data, size_t n, const at::Tensor& owner, const char* what,
                           size_t window, Millis timeout) = 0;
  /// Receives one message of exactly `n` bytes into `data`.
  virtual void recv(void* data, size_t n, const at::Tensor& owner, const char* what,
                    Millis timeout) = 0;
  /// Whether both ends join frames (PeerInfo::joins_frames; a caller's link never does).
  virtual bool joins_frames() const { return false; }
  /// Receives one message of 1 byte into `head`, or of 1 + `n` bytes into `head` then `data`;
  /// returns its length. Only where joins_frames().
  virtual size_t recv_joined(uint8_t* head, const at::Tensor& head_owner, void* data, size_t n,
                             const at::Tensor& owner, const char* what, Millis timeout);
  /// For event loops (Pipe::recv_ready): whether a recv() would find its first message
  /// arrived, or fail at once (the link closed, broken or left by the peer), progressing the
  /// transport for up to `spin` meanwhile. A caller's link cannot tell: true.
  virtual bool recv_would_not_wait(std::chrono::microseconds /*spin*/) { return true; }
  /// For event loops (Pipe::try_recv): progresses the transport from the calling thread until
  /// `decide(peek)` is no longer kIncomplete, or until it has had nothing to do for `spin`;
  /// returns decide's last answer. `peek.peek(i)` looks at the i-th message not yet received:
  /// messages are taken off the transport into a stash, in order, while the stash holds at most
  /// `stash_limit` bytes, and later receives read them from there first, so nothing is lost
  /// or reordered whatever the caller does next. A caller's link cannot look ahead:
  /// kNeedsReceiver.
  virtual Arrival look_ahead(const std::function<Arrival(MessagePeek&)>& /*decide*/,
                             size_t /*stash_limit*/, std::chrono::microseconds /*spin*/) {
    return Arrival::kNeedsReceiver;
  }
  /// For event loops (Pipe::try_send): whether the next send_credit() within `window` would
  /// return without waiting for the peer, driving the transport for up to `spin` until it
  /// would. A caller's link cannot tell: false.
  virtual bool credit_available(size_t /*window*/, std::chrono::microseconds /*spin*/) {
    return false;
  }
  /// Waits up to `timeout` until the peer has every credit message; true when it has.
  virtual bool drain(Millis timeout) = 0;
  virtual void close(Millis timeout) noexcept = 0;
  /// The peer left or failed (known to the transport), as opposed to a fault found by us.
  virtual bool peer_gone() const = 0;
  /// The message stream is out of step: break the connection, recording why.
  virtual void fail(const std::string& why) = 0;
  virtual const std::string& peer() const = 0;
  virtual const PeerInfo& peer_info() const = 0;
  virtual std::string transports() = 0;
};

}  // namespace tensordict::pipe::detail
