#pragma once
// TensorDictPipe: a point-to-point channel that streams TensorDicts between two processes (or
// two threads) over UCX, addressed by host and port, without a process group. The framing is
// the reference's (docs/wire-format.md §6.1, §6.2); the limits and timeouts are ours
// (docs/pipe.md).

#include <c10/core/Device.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "tensordict/memory.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::pipe {

namespace detail {
struct PipeImpl;
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
  /// Default: half of this machine's physical memory (default_storage_limit_bytes()).
  int64_t max_storage_bytes = default_storage_limit_bytes();
  /// How long close() waits, after sending its close marker, for the peer to read up to it and
  /// leave. UCX drops the bytes a peer has not read yet when the connection goes, so without
  /// this wait a producer that sends then closes could lose its last messages. Only a pipe that
  /// has sent something waits; a peer that is reading (or closing too) ends the wait at once.
  std::chrono::milliseconds linger{10000};
};

/// Counters of one pipe end (for monitoring, and for tests of the framing).
struct PipeStats {
  int64_t sends = 0;             // completed send() calls
  int64_t schema_sends = 0;      // of which carried the metadata (flag 0x00)
  int64_t recvs = 0;             // completed recv() calls
  int64_t schema_recvs = 0;      // of which carried the metadata (and allocated)
  int64_t bytes_sent = 0;        // every byte sent on the stream, framing included
  int64_t bytes_received = 0;
};

/// One end of a pipe. A Pipe is a handle: copies refer to the same connection. Thread-safety:
/// one send() and one recv() may run concurrently (the two directions are independent); calls
/// in the same direction are serialised. close() may be called from any thread at any time and
/// makes pending calls fail promptly. The connection and its progress thread live until close()
/// or until the last handle goes away.
class Pipe {
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

  /// Sends `td`. Consolidated mode: a TensorDict that is not consolidated is consolidated first
  /// (a copy of every leaf, on its device, else the CPU); the metadata travels only when the
  /// schema differs from the previous send's. Uncollated mode: the tensor leaves, nested ones
  /// included, sorted by joined key. Blocks until every byte is handed to UCX and sent; `td`
  /// must not be modified meanwhile. Throws RuntimeError on a closed or broken pipe, a peer
  /// error or a timeout ("Cannot send on a closed pipe." when closed); ValueError for a
  /// TensorDict the wire cannot carry (dtype, non-CPU storage).
  void send(const TensorDict& td);

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
  /// shares it. Idempotent; never throws. On a healthy pipe with no send in flight, a close
  /// marker goes first, so the peer's next recv() sees a clean close (peer_closed()) rather
  /// than a lost connection; then, if this end has sent anything, close() waits up to
  /// `linger` for the peer to read everything (see PipeOptions::linger). Pending calls in
  /// other threads fail with "closed".
  void close() noexcept;
  bool closed() const;
  /// True once a recv() has read the peer's close marker: the peer closed cleanly, after every
  /// message it sent was received. recv() and send() then throw "the peer closed the pipe".
  bool peer_closed() const;

  /// The bound port of a listening pipe (the real one when 0 was asked), else the peer's port.
  int port() const;
  /// "host:port" of the peer as given or as seen by the listener ("" before a client arrives).
  std::string peer() const;
  const PipeOptions& options() const;
  PipeStats stats() const;

  /// Test hooks: send raw bytes on the stream / receive exactly `n` raw bytes, outside the
  /// framing (to inject malformed frames or check the exact bytes sent). Same errors and
  /// timeouts as send()/recv().
  void send_raw(const void* data, size_t n);
  std::string recv_raw(size_t n);

  explicit Pipe(std::shared_ptr<detail::PipeImpl> impl);

 private:
  std::shared_ptr<detail::PipeImpl> impl_;
};

}  // namespace tensordict::pipe
