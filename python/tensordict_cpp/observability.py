"""Logging and counters of transfers (docs/observability.md).

Log lines come from the C++ core: one per transfer at "info" (kind, peer, tags, bytes, duration;
the UCX transports of each pipe connection), one per message at "debug". They go to the logger
``tensordict_cpp``. The level comes from the environment variable ``TENSORDICT_LOG``
(``info`` or ``debug``), or from :func:`set_log_level`. When ``TENSORDICT_LOG`` asks for lines and
neither that logger nor the root logger has a handler, one that writes to stderr is added, so that
the lines show without configuring ``logging``.

>>> import tensordict_cpp
>>> tensordict_cpp.set_log_level("info")
>>> sorted(tensordict_cpp.transfer_stats("pipe"))
['bytes_received', 'bytes_sent', 'messages_received', 'messages_sent', 'seconds', 'transfers']
"""
from __future__ import annotations

import atexit
import logging
import os

from tensordict_cpp import _C

__all__ = ["set_log_level", "log_level", "transfer_stats", "reset_transfer_stats"]

logger = logging.getLogger("tensordict_cpp")
_LEVELS = {"info": logging.INFO, "debug": logging.DEBUG}


def _forward(level: str, line: str) -> None:
    logger.log(_LEVELS[level], line)


def set_log_level(level: str) -> None:
    """Which lines the core writes: ``"off"``, ``"info"`` (one per transfer) or ``"debug"`` (one
    per message as well). ValueError for anything else."""
    _C.set_log_level(level)
    if level in _LEVELS and logger.level == logging.NOTSET:
        logger.setLevel(_LEVELS[level])


def log_level() -> str:
    """The core's level: ``"off"``, ``"info"`` or ``"debug"``."""
    return _C.log_level()


def transfer_stats(channel: str = "process_group") -> dict:
    """What this process moved since it started (or the last :func:`reset_transfer_stats`) on
    ``channel``: ``"process_group"`` (send/recv and their forms, the collectives, init_remote, on
    Gloo or any c10d backend) or ``"pipe"``. A dict of ``transfers`` (completed calls),
    ``messages_sent``, ``messages_received``, ``bytes_sent``, ``bytes_received`` and ``seconds``
    (time spent in the completed calls)."""
    return _C.transfer_stats(channel)


def reset_transfer_stats() -> None:
    """Sets every counter of both channels to zero."""
    _C.reset_transfer_stats()


_C.set_log_sink(_forward)
# The sink calls into Python from C++ threads: it must be gone before the interpreter is.
atexit.register(_C.set_log_sink, None)
_env = os.environ.get("TENSORDICT_LOG", "")
if _env in _LEVELS:
    set_log_level(_env)
    if not logger.handlers and not logging.getLogger().handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("tensordict_cpp: %(message)s"))
        logger.addHandler(_handler)
