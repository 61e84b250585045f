#pragma once
// Gloo's failures, told apart in one place. Gloo reports what goes wrong with a work as untyped
// exceptions: gloo::IoException (a plain std::exception) or a c10::Error carrying Gloo's text.
// Every wait of the c10d layer (the Waiter, the works handed to callers, publication's
// GroupLink, the watch of a lost peer) asks classify() what one means and raises the typed
// error of docs/errors.md for it. Private to the c10d layer.

#include <exception>
#include <string>

namespace tensordict::dist::detail {

/// What an exception from a wait on a Gloo work means.
enum class GlooFailure {
  kOther,    // one of ours already (TimeoutError, PeerLostError, ...), or a c10 error that is not
             // the transport's: raised as it is
  kTimeout,  // Gloo's own timeout passed ("Timed out waiting 30000ms for recv operation"), which
             // closes the group's connections
  kLost,     // the connection broke ("Connection closed by peer", "Connection reset by peer"), or
             // any exception that is not a c10::Error (gloo::IoException)
};

GlooFailure classify(const std::exception& e);

/// `e`'s message without a C++ backtrace.
std::string message_of(const std::exception& e);

/// Rethrows `e`, the exception being handled, as the failure it is: PeerLostError, saying where
/// (`where`), for a lost connection or Gloo's own timeout (after which the group's connections
/// are closed); as it is otherwise.
[[noreturn]] void rethrow_lost(const std::exception& e, const std::string& where);

}  // namespace tensordict::dist::detail
