"""The failure kinds of a transfer, as typed exceptions (docs/errors.md has the table).

Each class mirrors one of include/tensordict/errors.h and derives from the built-in type the
same failure raised before, so every existing ``except RuntimeError`` / ``except ValueError`` /
``except TimeoutError`` still catches it. The C++ binding (python/csrc/module.cpp) raises them.

This module imports nothing from the rest of the package: the C++ module looks its classes
up while it is being imported, and a caller may import it to catch errors without the rest.
"""
import builtins

from torch.distributed import DistBackendError

__all__ = ["TimeoutError", "PeerLostError", "PipeClosedError", "PeerClosedError",
           "SchemaMismatchError", "MalformedPeerDataError", "NoPublisherError", "InvalidKeyError",
           "BatchSizeError"]


class TimeoutError(DistBackendError, builtins.TimeoutError):  # noqa: A001 - mirrors the C++ name
    """A transfer waited past its deadline: the call's ``timeout``, the group's, or the pipe's."""


class PeerLostError(DistBackendError):
    """The peer went away mid-transfer: its connection reset or closed, its endpoint failed."""


class PipeClosedError(RuntimeError):
    """An operation on a pipe that this process closed."""


class PeerClosedError(RuntimeError):
    """The peer closed the pipe cleanly: its close marker arrived."""


class SchemaMismatchError(RuntimeError):
    """A checked receive found that the sender's TensorDict has other keys, dtypes or shapes."""


class NoPublisherError(RuntimeError):
    """A Subscriber's publisher does not answer: none runs on its rank and channel, or it closed."""


# Both bases: bad metadata, lengths, offsets, dtypes and pickles raised ValueError before, bad
# pipe frames and checked-transfer headers RuntimeError.
class MalformedPeerDataError(ValueError, RuntimeError):
    """Bytes from a peer that break the wire format (docs/wire-format.md)."""


# RuntimeError as the reference raises it ("batch dimension mismatch ..."), ValueError as ours
# did before: either ``except`` catches it. Raised by the constructor, ``td[key] = value``,
# ``set``, a tensorclass field, and a ``td.batch_size = ...`` that an entry's leading dims do not
# start with.
class BatchSizeError(RuntimeError, ValueError):
    """A value whose leading dims do not start with the batch size of the level it is set in."""


# KeyError as the reference raises it ("Only NestedKeys are supported"), TypeError as what the
# fault is: either ``except`` catches it.
class InvalidKeyError(KeyError, TypeError):
    """A key that is neither a str nor a non-empty (possibly nested) tuple of str."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""
