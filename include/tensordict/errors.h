#pragma once
// Error types beyond c10's. c10 already gives ValueError (TORCH_CHECK_VALUE), TypeError
// (TORCH_CHECK_TYPE) and Error (TORCH_CHECK). Ours name what a caller acts on: a missing key
// (Python KeyError, as the reference raises), and the failure kinds of a transfer. Each derives
// from the c10 type the same failure was thrown as before, so every existing catch site still
// catches it; the Python binding maps each to a class of tensordict_cpp.errors that derives from
// the built-in type raised before (docs/errors.md has the table).

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>

namespace tensordict {

/// A key (or a level of a nested key) is absent. Python: KeyError.
class KeyError : public c10::Error {
 public:
  using c10::Error::Error;
};

/// A transfer waited past its deadline (the call's timeout, or the group's). Python:
/// tensordict_cpp.errors.TimeoutError, a TimeoutError and a torch DistBackendError.
class TimeoutError : public c10::DistBackendError {
 public:
  using c10::DistBackendError::DistBackendError;
};

/// The peer went away during a transfer: its connection reset or closed, its endpoint failed.
/// Python: tensordict_cpp.errors.PeerLostError, a torch DistBackendError.
class PeerLostError : public c10::DistBackendError {
 public:
  using c10::DistBackendError::DistBackendError;
};

/// An operation on a pipe this process closed. Python: PipeClosedError, a RuntimeError.
class PipeClosedError : public c10::Error {
 public:
  using c10::Error::Error;
};

/// The peer closed the pipe cleanly (its close marker arrived). Python: PeerClosedError, a
/// RuntimeError.
class PeerClosedError : public c10::Error {
 public:
  using c10::Error::Error;
};

/// A checked receive (or a receive into an existing TensorDict) found that the sender's
/// TensorDict has other keys, dtypes or shapes. Python: SchemaMismatchError, a RuntimeError.
class SchemaMismatchError : public c10::Error {
 public:
  using c10::Error::Error;
};

/// A Subscriber's publisher does not answer: its rank has taken no request within the pull's
/// timeout (it runs no Publisher on that channel: none yet, or the reference tensordict,
/// which has none), or it closed. Python: NoPublisherError, a RuntimeError.
class NoPublisherError : public c10::Error {
 public:
  using c10::Error::Error;
};

/// A value whose leading dims do not start with the batch size of the level it is set in (a
/// tensor's shape, a nested level's or a non-tensor entry's batch size), or a batch size that an
/// entry's leading dims do not start with. A c10::ValueError, as it was thrown before; Python:
/// BatchSizeError, a RuntimeError as the reference raises it, and a ValueError.
class BatchSizeError : public c10::ValueError {
 public:
  using c10::ValueError::ValueError;
};

/// Bytes from a peer that break the wire format (docs/wire-format.md): bad metadata, lengths,
/// offsets, dtypes, pickles or frames. Python: MalformedPeerDataError, a ValueError.
class MalformedPeerDataError : public c10::ValueError {
 public:
  using c10::ValueError::ValueError;
};

namespace detail {
template <class E>
[[noreturn]] void throw_error(const char* func, const char* file, uint32_t line,
                              const std::string& msg) {
  throw E(c10::SourceLocation{func, file, line}, msg);
}
}  // namespace detail

}  // namespace tensordict

/// Throws tensordict::Type (one of the classes above) with the message c10::str(...) builds.
#define TD_THROW(Type, ...)                              \
  ::tensordict::detail::throw_error<::tensordict::Type>( \
      __func__, __FILE__, static_cast<uint32_t>(__LINE__), ::c10::str(__VA_ARGS__))

/// Like TORCH_CHECK, but throws tensordict::Type.
#define TD_CHECK_AS(Type, cond, ...)    \
  if (C10_UNLIKELY_OR_CONST(!(cond))) { \
    TD_THROW(Type, __VA_ARGS__);        \
  }

/// Like TORCH_CHECK, but throws tensordict::MalformedPeerDataError: a fault in a peer's bytes.
#define TD_CHECK_PEER(cond, ...) TD_CHECK_AS(MalformedPeerDataError, cond, __VA_ARGS__)

/// Like TORCH_CHECK, but throws tensordict::BatchSizeError.
#define TD_CHECK_BATCH(cond, ...) TD_CHECK_AS(BatchSizeError, cond, __VA_ARGS__)
/// Like TORCH_CHECK, but throws tensordict::KeyError.
#define TD_CHECK_KEY(cond, ...) TD_CHECK_AS(KeyError, cond, __VA_ARGS__)
