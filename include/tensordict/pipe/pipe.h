#pragma once
// TensorDictPipe: a point-to-point channel that streams TensorDicts between two processes (or
// two threads) over UCX, addressed by host and port, without a process group. The framing is
// the reference's (docs/wire-format.md §6.1, §6.2); the limits and timeouts are ours
// (docs/pipe.md).

#include <c10/core/Device.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "tensordict/memory.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::pipe {

namespace detail {
class PipeImpl;
struct PipeAccess;
}  // namespace detail

/// Options of a pipe, shared by both ends' constructors (connect, listen, TensorDictServer).
struct PipeOptions {
  /// true: the two-phase consolidated framing (§6.1); false: the uncollated framing (§6.2).
  /// Never negotiated: both ends must pick the same value.
  bool consolidated = true;
  /// Bound on every wait: a connection, an accept, each message of a send or a receive. A
  /// wait that expires breaks the pipe (the stream is out of sync), as a peer error does.
  std::chrono::milliseconds timeout{30000};
  /// Largest metadata JSON (or uncollated header) a receive accepts, checked before allocating.
  int64_t max_metadata_bytes = int64_t{64} << 20;
  /// Largest storage (or sum of uncollated leaves) a receive accepts, checked before allocating.
  /// Unset: half of this machine's physical memory (default_storage_limit_bytes()), resolved
  /// when a pipe is made, so that the default in a signature does not depend on the machine.
  std::optional<int64_t> max_storage_bytes{};
  /// Flow control: how many sent TensorDicts the peer may not yet have started receiving. A
  /// send() beyond that waits (up to `timeout`, then TimeoutError: nothing is sent) until the
  /// peer receives. Large messages wait for the receiver anyway (UCX rendezvous), so this
  /// bounds what a fast producer can make a slow consumer hold in memory.
  int64_t max_unreceived = 16;
  /// The most the peer may leave here unread: its messages that arrived before a receive took
  /// them (UCX would keep them without bound), each charged its length plus about 4 KiB of
  /// UCX's, except one long message (a rendezvous, whose bytes wait at the sender). Beyond it,
  /// or for a message longer than any receive takes, the pipe breaks: the receive that finds it
  /// throws MalformedPeerDataError naming this option, and what was held is dropped. A producer
  /// of ours leaves at most `max_unreceived` TensorDicts unread (about 9 MiB at the default of
  /// 16); a reference producer has no window and breaks the pipe once it runs this far ahead.
  int64_t max_unread_bytes = int64_t{64} << 20;
  /// How long a waiting call progresses UCX itself, with nothing to do, before it sleeps until
  /// the pipe's progress thread wakes it: a reply within the spin costs no thread wake-up
  /// (latency), and a transfer under way is driven at full speed (the spin restarts while UCX
  /// has work); an idle wait costs the CPU of the spin. 0 never spins.
  std::chrono::microseconds spin{100};
  /// How long close() waits, after its close marker (to a peer of ours), for the peer to start
  /// receiving what this end sent. Nothing needs it for delivery: messages already sent stay
  /// readable by the peer after the close. It lets a closing producer see its consumer keep up,
  /// and a ucxx listener finish reading the connection's peer info (docs/pipe.md, "Closing").
  std::chrono::milliseconds linger{0};
};

/// Counters of one pipe end (for monitoring, and for tests of the framing).
struct PipeStats {
  int64_t sends = 0;         // completed send() calls
  int64_t schema_sends = 0;  // of which carried the metadata (flag 0x00)
  int64_t recvs = 0;         // completed recv() calls
  int64_t schema_recvs = 0;  // of which carried the metadata (and allocated)
  int64_t bytes_sent = 0;    // every byte sent on the stream, framing included
  int64_t bytes_received = 0;
};

/// Options of one Pipe::send.
struct PipeSendOptions {
  /// When set, every wait of this send ends by then (TimeoutError), in place of
  /// PipeOptions::timeout per wait: a send queued behind others (asend's send thread) keeps the
  /// deadline of its own call. Already past: TimeoutError at once, nothing sent. A window wait
  /// that expires has sent nothing and the pipe goes on; a later wait that expires breaks it.
  std::optional<std::chrono::steady_clock::time_point> deadline{};
};

/// A message transport the caller supplies, for a pipe over a connection made elsewhere (in
/// Python, a ucxx endpoint: TensorDictPipe(endpoint)). Each call moves exactly one message, in
/// order, and blocks until it is done: send() until the buffer may be reused, recv() until `n`
/// bytes arrived at `data` (a message of another size must throw). Errors are exceptions, which
/// the pipe's calls let through. Called from the threads that call the pipe, one send and one
/// recv at a time. The pipe's timeouts and flow control are the transport's business here.
struct CallerTransport {
  std::function<void(const void* data, size_t n)> send;
  std::function<void(void* data, size_t n)> recv;
  std::function<void()> close{};         // called once by Pipe::close(), may be empty
  std::string peer = "a caller's link";  // for messages
  /// The tag the peer announced in ucxx's peer-info exchange, when known: a peer of ours is
  /// then recognised (and gets the close marker).
  std::optional<uint64_t> peer_tag{};
};
/// CallerTransport's former name (publication over a pipe has a link of its own, PipeLink).
using PipeLink [[deprecated("use CallerTransport")]] = CallerTransport;

/// One end of a pipe. A Pipe is a handle: copies refer to the same connection. Thread-safety:
/// one send() and one recv() may run concurrently (the two directions are independent); calls
/// in the same direction are serialised. close() may be called from any thread at any time and
/// makes pending calls fail promptly. The connection and its progress thread live until close()
/// or until the last handle goes away. Made by listen(), connect(), over() and
/// TensorDictServer only.
class Pipe final {
 public:
  /// Binds a listener on `host`:`port` and returns at once, without waiting for the client:
  /// the first send()/recv() (or accept()) waits for it, up to the timeout. Port 0 binds a free
  /// port (see port()). The default host is loopback; pass "0.0.0.0" (or "::") to listen on
  /// every interface. The pipe serves the first client only; later ones are rejected.
  /// Throws RuntimeError when the address cannot be bound, ValueError for a bad port or host.
  static Pipe listen(int port, const std::string& host = "127.0.0.1",
                     const PipeOptions& options = {});
  /// Connects to a listener and waits (up to the timeout) until the connection is up.
  /// Throws RuntimeError when the peer is unreachable or refuses, or on timeout.
  static Pipe connect(const std::string& host, int port, const PipeOptions& options = {});
  /// A pipe over `link`, connected already: the framing, limits and validation of this class
  /// on a transport of the caller's. ValueError when send or recv is empty.
  static Pipe over(CallerTransport link, const PipeOptions& options = {});

  /// Sends `td`. Consolidated mode: a TensorDict that is not consolidated is consolidated first
  /// (a copy of every leaf, on its device, else the CPU); the metadata travels only when the
  /// schema differs from the previous send's. Uncollated mode: the tensor leaves, nested ones
  /// included, sorted by joined key. Blocks until every byte is handed to UCX and sent; `td`
  /// must not be modified meanwhile. Throws RuntimeError on a closed or broken pipe, a peer
  /// error or a timeout ("Cannot send on a closed pipe." when closed); ValueError for a
  /// TensorDict the wire cannot carry (dtype, non-CPU storage).
  void send(const TensorDict& td, const PipeSendOptions& send_options = {});

  /// Receives one TensorDict. Consolidated mode: on a new schema the metadata is validated
  /// (the safe rebuild) and a storage of its size is allocated on `device` (default: the
  /// sender's device string, which must exist here); the result's leaves are views of it. On
  /// the same schema nothing is allocated: the bytes land in the storage of `td` when given and
  /// matching, else of the previous receive's result, which is returned again with its leaves
  /// updated in place. Clone a result to keep it. Uncollated mode: a new TensorDict every
  /// time, on `device` (default CPU); `td` is ignored. Throws RuntimeError on a closed or
  /// broken pipe, a peer error, a timeout, an unknown flag byte, a length over the caps, or a
  /// same-schema message with nothing to receive into; ValueError for invalid metadata.
  TensorDict recv(const std::optional<TensorDict>& td = std::nullopt,
                  std::optional<at::Device> device = std::nullopt);

  /// Listening pipe: waits (up to the timeout) until the client has connected. Connected pipe:
  /// returns at once. send() and recv() call it; it exists so a caller can wait explicitly.
  void accept();

  /// Closes the connection, the listener if any, and the progress thread once no other pipe
  /// shares it. Idempotent; never throws; returns promptly whether or not the peer reads (at
  /// most `linger`, then a bounded flush). What was sent stays readable by the peer. On a
  /// healthy pipe to a peer of ours with no send in flight, a close marker goes first, so the
  /// peer's recv() tells a clean close (peer_closed()) from a lost connection. Pending calls in
  /// other threads fail with "closed".
  void close() noexcept;
  bool closed() const;
  /// True once a recv() found the peer's clean close: its close marker (a peer of ours), or a
  /// disconnect between two messages (a reference peer, which has no marker); every message
  /// it sent was received. recv() and send() then throw "the peer closed the pipe".
  bool peer_closed() const;

  /// The bound port of a listening pipe (the real one when 0 was asked), else the peer's port.
  int port() const;
  /// "host:port" of the peer as given or as seen by the listener ("" before a client arrives).
  std::string peer() const;
  /// The UCX transports and devices the connection's lanes use, as UCX chose them (for
  /// example "tcp/lo, posix/memory, cma/memory"); "" before a client arrives.
  std::string transports() const;
  /// True when the peer is tensordict-cpp (recognised in the connection's peer-info
  /// exchange): then close() sends it the close marker. A peer on the reference's ucxx pipe
  /// gets the reference's messages only.
  bool peer_is_tensordict_cpp() const;
  const PipeOptions& options() const;
  PipeStats stats() const;

  // ---- For event loops (docs/pipe.md, "From an event loop") -------------------------------
  // A loop waits for a pipe without a thread of its own: it watches event_fd(), calls
  // try_recv() (recv() only when that says kWouldWait, on another thread) and try_send() before
  // send(). tensordict_cpp.pipe's asend / arecv are built on these; no peer can make them wait.

  /// An eventfd owned by the pipe that turns readable, while watched, when the pipe may have
  /// progressed: a message arrived, an operation completed, a client connected, the pipe
  /// closed. Register it with the loop and read it to clear it; spurious wake-ups happen.
  int event_fd();
  /// Starts (true) or stops (false) writing event_fd(); counted, so watchers nest.
  void watch(bool on);
  /// Whether recv() would start without waiting for the peer: the next TensorDict's first
  /// message has arrived, or recv() would throw at once (closed, broken, the peer gone). Drives
  /// UCX from the calling thread for up to `spin` meanwhile (a busy-poll). recv() then waits
  /// only for the rest of a TensorDict the peer is sending. A listening pipe without its client:
  /// false. A pipe over a caller's link: true (it cannot tell).
  bool recv_ready(std::chrono::microseconds spin = std::chrono::microseconds(0));
  /// Bytes the last recv() took from the stream, framing included: about what the next
  /// same-schema one moves.
  int64_t last_recv_bytes() const;
  /// What try_recv() did.
  enum class RecvAttempt {
    kReceived,    // received, as recv() would have
    kNotArrived,  // nothing received: part of the next TensorDict has not arrived; try again
                  // after an event (what arrived is kept, in order, for the next receive)
    kWouldWait,   // nothing received: this receive needs to wait for the peer (a message over
                  // kTryRecvStashBytes, another receive running, a caller's link); use recv()
  };
  /// The most bytes try_recv() takes off the transport ahead of a receive (its stash).
  static constexpr size_t kTryRecvStashBytes = size_t{1} << 20;
  /// Receives as recv() does when that cannot wait for the peer: every message of the next
  /// TensorDict has arrived whole (at most kTryRecvStashBytes together; they are moved aside
  /// as they arrive, so a partial TensorDict is kept for the next call), or recv() would throw
  /// at once (then it throws, as recv() would). Otherwise returns nullopt with `*attempt` set,
  /// having received nothing. Drives UCX from the calling thread for up to `spin` meanwhile (a
  /// busy-poll). Never waits for the peer: an event loop calls it on its own thread.
  std::optional<TensorDict> try_recv(RecvAttempt* attempt,
                                     const std::optional<TensorDict>& td = std::nullopt,
                                     std::optional<at::Device> device = std::nullopt,
                                     std::chrono::microseconds spin = std::chrono::microseconds(0));
  /// What try_send() did.
  enum class SendAttempt {
    kSent,        // sent, as send() would have
    kWindowFull,  // nothing sent: only the flow-control window is full; try again after an
                  // event (the peer's receipts arrive as events)
    kWouldWait,   // nothing sent: this send may wait for the peer; use send()
  };
  /// Sends `td` as send() does when that cannot wait: the pipe is connected, no other send runs,
  /// and `td` is consolidated with the schema of the previous send and a storage the peer takes
  /// as one message without a rendezvous (a peer of ours, at most 8 KiB: docs/wire-format.md
  /// §6.8), with room in the flow-control window. Otherwise returns at once, having sent
  /// nothing; with the window full it first drives UCX for up to `spin` for the peer's
  /// receipts (a busy-poll). Same errors as send() once it sends.
  SendAttempt try_send(const TensorDict& td,
                       std::chrono::microseconds spin = std::chrono::microseconds(0));

  /// Test hooks, not API: only the project's tests, benchmarks and the Python binding's test
  /// hooks can make the key (TestKey: src/core/include/core/testing.h, not installed).
  /// send_raw sends `n` raw bytes at `data` as one message on the stream, outside the framing
  /// (to inject malformed frames); the pipe sends no close marker after it. recv_raw receives
  /// one message of exactly `n` raw bytes (to check the exact bytes sent). Same errors and
  /// timeouts as send()/recv().
  void send_raw(const TestKey& key, const void* data, size_t n);
  std::string recv_raw(const TestKey& key, size_t n);

 private:
  // Only the library makes a Pipe from its state: listen(), connect(), over(), and
  // TensorDictServer's accepted pipes, through PipeAccess (src/pipe/pipe_impl.h), which
  // publication uses too.
  friend struct detail::PipeAccess;
  explicit Pipe(std::shared_ptr<detail::PipeImpl> impl);

  std::shared_ptr<detail::PipeImpl> impl_;
};

}  // namespace tensordict::pipe
