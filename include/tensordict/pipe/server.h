#pragma once
// TensorDictServer: a UCX listener that accepts many clients and hands each one a Pipe, either
// one at a time (accept()) or to a handler that runs concurrently per client (serve()).

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensordict/pipe/pipe.h"

namespace tensordict::pipe {

namespace detail {
struct ServerImpl;
}  // namespace detail

/// A listening server. The server owns one UCX worker (and its progress thread), its listener,
/// and the pipes of serve()'s handlers; close() closes those, and every pipe accept() handed
/// out that is still open, and joins every thread it started. A pipe from accept() lives as
/// long as its caller's handles (the last one going closes it); the server forgets it once
/// closed, as it forgets each finished handler, so that clients coming and going cost it
/// nothing that lasts. What a client may hold before it is a pipe is bounded too (docs/pipe.md,
/// "Limits and safety").
/// Thread-safety: all methods may be called from any thread. Not copyable; movable.
class TensorDictServer {
 public:
  /// Binds `host`:`port` at once (port 0: a free port, see port()). The default host is
  /// loopback; "0.0.0.0" (or "::") listens on every interface. `options` apply to every pipe.
  /// Throws RuntimeError when the address cannot be bound, ValueError for a bad port or host.
  explicit TensorDictServer(int port = 0, const std::string& host = "127.0.0.1",
                            const PipeOptions& options = {});
  ~TensorDictServer();  // close()
  TensorDictServer(TensorDictServer&&) noexcept;
  TensorDictServer& operator=(TensorDictServer&&) noexcept;

  int port() const;

  /// The next client's pipe, waiting up to `timeout` (default: the options' timeout); nullopt
  /// when none arrived in time or the server is closed. Not to be mixed with serve().
  std::optional<Pipe> accept(std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  /// Starts serving: every client, present and future, gets its own thread that runs
  /// handler(pipe); the pipe is closed when the handler returns. Returns at once. An exception
  /// from a handler is caught and kept (see handler_errors()), except the errors of pipes that
  /// close() itself broke. RuntimeError when already serving or closed.
  void serve(std::function<void(Pipe&)> handler);

  /// The exceptions the handlers threw, in the order they ended: the latest 1,000.
  std::vector<std::exception_ptr> handler_errors() const;
  /// Number of clients accepted so far.
  int64_t clients() const;

  /// Stops accepting, closes the listener and every accepted pipe (so blocked handlers fail
  /// promptly), joins every handler and the accept thread, then releases the worker.
  /// Idempotent; never throws.
  void close() noexcept;

 private:
  std::unique_ptr<detail::ServerImpl> impl_;
};

}  // namespace tensordict::pipe
