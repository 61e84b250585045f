"""Publication: one trainer, many receivers (docs/publication.md).

A :class:`Publisher` hands the newest version of a TensorDict to many :class:`Subscriber`\\ s
over a c10d group, each pulling when it wants; a version travels only to a subscriber that
asks, so a slow, stopped or dead subscriber costs the others nothing. Versions are numbered,
and each Publisher has an epoch of its own, so a subscriber notices a restarted trainer.

>>> pub = Publisher(max_slots=2)                      # on the trainer, rank 0
>>> v = pub.publish(TensorDict.from_module(policy))   # never waits for the subscribers
>>> sub = Subscriber(src=0)                           # on each worker
>>> weights = sub.pull(timeout=30)                    # a new TensorDict, the newest version
>>> v = sub.pull(weights, timeout=0)                  # later: in place, or None (a poll)

The C++ classes (``tensordict::dist::Publisher`` / ``Subscriber``) do the work with the GIL
released; this module maps ranks and classes.
"""
from __future__ import annotations

import datetime
from typing import Any, Union

from tensordict_cpp import _C, _collectives, _reference
from tensordict_cpp._p2p import _seconds
from tensordict_cpp._td import TensorDict
from tensordict_cpp.tensorclass import _type_name, is_tensorclass

__all__ = ["Publisher", "Subscriber"]

#: A wait: seconds (0 polls), a ``datetime.timedelta``, or ``None`` (no limit).
Wait = Union[float, datetime.timedelta, None]


def _cpp(td: Any, call: str) -> tuple:
    """(the ``_C.TensorDict`` sharing ``td``'s leaves, its tensorclass name or None)."""
    if is_tensorclass(td) and not isinstance(td, type):
        return td._tensordict._cpp, _type_name(type(td))
    cpp = getattr(td, "_cpp", None)
    if isinstance(cpp, _C.TensorDict):
        return cpp, None
    if _reference.is_reference(td):
        return _reference.from_reference(td), None
    raise TypeError(f"{call}: expected a TensorDict, a tensorclass or a TensorDictParams, "
                    f"got {type(td).__name__}")


class Publisher:
    """Publishes versions of a TensorDict to the :class:`Subscriber`\\ s of a group.

    Each :meth:`publish` copies the TensorDict into one of ``max_slots`` slots that no
    subscriber is receiving and makes it the newest version; a subscriber's pull pins the slot
    it is sent from until it has taken it. So ``publish`` never waits for subscribers, unless
    every slot is pinned. A thread per subscriber answers its pulls. Memory: ``max_slots``
    copies of the TensorDict's bytes.

    Args:
        group (torch.distributed.ProcessGroup, optional): the process group: the default one,
            a registered one, or a standalone group (``ProcessGroupGloo`` on a store). Defaults
            to ``None``: the default process group.

    Keyword Args:
        max_slots (int, optional): how many versions may be in flight at once. Defaults to 2.
        subscribers (list of int, optional): the subscribers' global ranks (for a standalone
            group, its ranks). Defaults to ``None``: every other rank of the group.
        channel (int, optional): 0 to 65535; several publications share a group on channels
            of their own. Defaults to 0.
    """

    def __init__(self, group: Any = None, *, max_slots: int = 2,
                 subscribers: list[int] | None = None, channel: int = 0) -> None:
        pg = _collectives._group(group)
        ranks = [] if subscribers is None else [self._rank(pg, r) for r in subscribers]
        self._cpp = _C.Publisher(group=pg, max_slots=max_slots, subscribers=ranks,
                                 channel=channel)

    @staticmethod
    def _rank(pg: Any, rank: int) -> int:
        try:
            return _collectives._group_rank(pg, rank)
        except (ValueError, RuntimeError):
            return rank  # a standalone group: its own ranks (the core checks them)

    def publish(self, td: Any, *, timeout: Wait = None) -> int:
        """Makes a copy of ``td`` the newest version and returns its number (1, 2, ...).

        ``td`` is a TensorDict, a lazy stack, a tensorclass or a ``TensorDictParams``; it may
        change its keys or shapes between versions (subscribers then read the new schema).

        Keyword Args:
            timeout (float or datetime.timedelta, optional): how long to wait when every slot
                is pinned by a subscriber still receiving it. Defaults to ``None``: no limit.

        Raises:
            TimeoutError: (:class:`tensordict_cpp.errors.TimeoutError`) when every slot stayed
                pinned for ``timeout``, naming the subscribers that pin them.
            ValueError: for a leaf that cannot travel.
        """
        cpp, tensorclass_type = _cpp(td, "publish")
        return self._cpp.publish(cpp, timeout=_seconds(timeout),
                                 _tensorclass_type=tensorclass_type)

    @property
    def epoch(self) -> int:
        """This publisher's epoch: random, never 0, another for every Publisher."""
        return self._cpp.epoch

    @property
    def version(self) -> int:
        """The newest version published; 0 before the first."""
        return self._cpp.version

    def stats(self) -> list[dict]:
        """Per subscriber: ``rank`` (in the group), ``version`` (the last it received whole:
        its acknowledgement, no extra message), ``pulls``, ``pinned`` (the version it is
        receiving now, or None), ``waiting`` (a pull of it waits for a version), ``lost`` and
        ``error``."""
        return self._cpp.stats()

    def wait_for_subscribers(self, timeout: Wait) -> None:
        """Waits until every subscriber has pulled once (or been lost), at most ``timeout``;
        :class:`tensordict_cpp.errors.TimeoutError` naming the ranks that have not (ranks that
        run no Subscriber, such as the reference ``tensordict``, which has none)."""
        self._cpp.wait_for_subscribers(_seconds(timeout))

    def close(self) -> None:
        """Stops serving (pulls waiting for a version raise NoPublisherError). Idempotent."""
        self._cpp.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Subscriber:
    """Pulls versions from the :class:`Publisher` on rank ``src``.

    :meth:`pull` fills a TensorDict with the newest version newer than the one this subscriber
    holds: the bytes land in a buffer of the subscriber's own and are copied into the
    TensorDict's leaves once the whole version is in, so the TensorDict changes only inside
    ``pull``, only to one whole version, never torn. One thread pulls at a time.

    Args:
        src (int): the publisher's global rank (for a standalone group, its rank there).
        group (torch.distributed.ProcessGroup, optional): the publisher's group. Defaults to
            ``None``: the default process group.

    Keyword Args:
        channel (int, optional): the publisher's channel. Defaults to 0.
        max_total_bytes (int, optional): the largest storage the publisher may announce.
            Defaults to ``None``: half of this machine's physical memory.
    """

    def __init__(self, src: int, group: Any = None, *, channel: int = 0,
                 max_total_bytes: int | None = None) -> None:
        pg = _collectives._group(group)
        self._cpp = _C.Subscriber(Publisher._rank(pg, src), group=pg, channel=channel,
                                  max_total_bytes=max_total_bytes)

    def pull(self, td: Any = None, *, timeout: Wait = None, min_version: int | None = None,
             allow_import: bool = False) -> Any:
        """Fills ``td`` with the newest version newer than the one held, and returns its number;
        with no ``td``, returns the version as a new TensorDict (the tensorclass the publisher
        published, if any), to fill with later pulls.

        Args:
            td (TensorDict, optional): the TensorDict to fill: the publisher's keys, dtypes and
                shapes (a ``TensorDictParams`` from ``from_module(policy, as_module=True)``
                updates the live module, its Parameters the same objects). Defaults to
                ``None``: a new one.

        Keyword Args:
            timeout (float or datetime.timedelta, optional): the longest to wait for a newer
                version; then the pull returns None, ``td`` unchanged, the group usable. 0
                polls: it takes what has arrived and waits for nothing (a version still on
                its way is taken by a later pull). Defaults to ``None``: until one is published.
            min_version (int, optional): wait for at least this version of the publisher's
                current epoch. Defaults to ``None``: any newer than the one held (a version of
                a new epoch is newer than any of the old one).
            allow_import (bool, optional): as :meth:`TensorDict.from_remote_init`'s, for a new
                TensorDict of a tensorclass. Defaults to ``False``.

        Returns:
            The version's number, or the new TensorDict; None when the timeout passed first.

        Raises:
            SchemaMismatchError: when ``td``'s keys, dtypes or shapes are not the version's,
                naming the first difference (``td`` unchanged).
            NoPublisherError: when ``src`` took no request within the timeout (no Publisher
                runs there on this channel: not yet, or it runs the reference ``tensordict``),
                or its Publisher closed.
            MalformedPeerDataError: for bytes that break the publication messages.
            PeerLostError: when the publisher's connection broke.
        """
        wait = _seconds(timeout)
        if td is None:
            got = self._cpp.pull_new(timeout=wait, min_version=min_version)
            if got is None:
                return None
            cpp, _version, tensorclass_type = got
            return _collectives._typed(TensorDict._wrap, (cpp, tensorclass_type), allow_import)
        cpp, _ = _cpp(td, "pull")
        return self._cpp.pull_into(cpp, timeout=wait, min_version=min_version)

    @property
    def version(self) -> int:
        """The version held (0: none)."""
        return self._cpp.version

    @property
    def epoch(self) -> int:
        """The epoch of the version held (0: none); it changes when the publisher restarts."""
        return self._cpp.epoch
