"""Publication: one trainer, many receivers (docs/publication.md).

A :class:`Publisher` hands the newest version of a TensorDict to many :class:`Subscriber`\\ s,
each pulling when it wants, over a c10d group or over the UCX pipe (a
:class:`~tensordict_cpp.TensorDictServer` publishes, each connected
:class:`~tensordict_cpp.TensorDictPipe` subscribes); a version travels only to a subscriber
that asks, so a slow, stopped or dead subscriber costs the others nothing. Versions are
numbered, and each Publisher has an epoch of its own, so a subscriber notices a restarted
trainer.

>>> pub = Publisher(max_slots=2)                      # on the trainer, rank 0
>>> v = pub.publish(TensorDict.from_module(policy))   # never waits for the subscribers
>>> sub = Subscriber(src=0)                           # on each worker
>>> weights = sub.pull(timeout=30)                    # a new TensorDict, the newest version
>>> v = sub.pull(weights, timeout=0)                  # later: in place, or None (a poll)

Over the pipe: ``Publisher(server)`` and ``Subscriber(pipe)``, the same methods, and
``await sub.apull(td)`` / ``async for v in sub.updates(td)`` from an event loop.

The C++ classes (``tensordict::dist::Publisher`` / ``Subscriber``, ``tensordict::pipe::...``)
do the work with the GIL released; this module maps ranks, pipes and classes.
"""
from __future__ import annotations

import asyncio
import datetime
import threading
from typing import Any, AsyncIterator, Callable, Union

from tensordict_cpp import _C, _collectives, _reference
from tensordict_cpp._p2p import _seconds
from tensordict_cpp._td import TensorDict
from tensordict_cpp.errors import NoPublisherError
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


def _pipe_class(name: str) -> Any:
    """tensordict_cpp.pipe's class ``name`` (imported late: the pipe is optional)."""
    from tensordict_cpp import pipe
    return getattr(pipe, name)


def _is_pipe_object(obj: Any, name: str) -> bool:
    return hasattr(_C, "Pipe") and isinstance(obj, _pipe_class(name))


def _pipe_end(call: str, given: Any, first: Any, kind: str, name: str) -> tuple:
    """(the ``kind`` a publication runs over, or None over a group; the first argument): given
    as ``name=`` or in place of the first argument (``Publisher(server)``, ``Subscriber(pipe)``).
    TypeError for an object of another class."""
    if given is None and _is_pipe_object(first, kind):
        return first, None
    if given is not None and not _is_pipe_object(given, kind):
        raise TypeError(f"{call}: {name}= takes a {kind}, got {type(given).__name__}")
    return given, first


def _no_group_args(call: str, end: str, **given: bool) -> None:
    """ValueError naming the group's arguments given beside a pipe end."""
    extra = [name for name, is_given in given.items() if is_given]
    if extra:
        raise ValueError(f"{call}: a {end}'s {call.lower()} takes no {' or '.join(extra)}")


class Publisher:
    """Publishes versions of a TensorDict to the :class:`Subscriber`\\ s of a group, or of a
    :class:`~tensordict_cpp.TensorDictServer`'s pipes.

    Each :meth:`publish` copies the TensorDict into one of ``max_slots`` slots that no
    subscriber is receiving and makes it the newest version; a subscriber's pull pins the slot
    it is sent from until it has taken it. So ``publish`` never waits for subscribers, unless
    every slot is pinned. A thread per subscriber answers its pulls (over a server, the
    server's thread for each client). Memory: ``max_slots`` copies of the TensorDict's bytes.

    Args:
        group (torch.distributed.ProcessGroup or TensorDictServer, optional): the process group:
            the default one, a registered one, or a standalone group (``ProcessGroupGloo`` on a
            store); or a server, as ``server=``. Defaults to ``None``: the default process
            group.

    Keyword Args:
        server (TensorDictServer, optional): publish to every client of this server, present
            and future, instead of a group; the server then serves nothing else (do not call its
            ``accept`` or ``serve``). A client that is not a tensordict_cpp peer (the reference's
            pipe) is recorded as lost in :meth:`stats` and its pipe closed. Defaults to
            ``None``.
        max_slots (int, optional): how many versions may be in flight at once. Defaults to 2.
        subscribers (list of int, optional): the subscribers' global ranks (for a standalone
            group, its ranks). Defaults to ``None``: every other rank of the group.
        channel (int, optional): 0 to 65535; several publications share a group on channels
            of their own. Defaults to 0.
        transport (str, optional): ``"auto"``: the slots live in shared memory, which
            subscribers on this host map and pull from without a message (the others, or those
            that cannot map it, are served over their socket); ``"shm"``: the same, but raise
            when no shared memory can be made; ``"socket"``: every subscriber over its socket.
            :meth:`stats` says which each got. Defaults to ``"auto"``.
        route (str, optional): how a version reaches the subscribers that wait for it over
            the group: ``"star"``, whole to each from here; ``"chain"``, once, in pieces that
            each subscriber forwards to the next as they arrive, so this process sends about one
            copy whatever their number, and the others of a host read them from its first
            subscriber's shared memory (docs/publication.md, "Relays"); ``"tree"``, the
            same, but half of the pieces go down each of two binary trees in which each
            subscriber forwards in one at most (a double binary tree: for many hosts, where a
            chain's length costs more than a tree's depth). A relay that stalls, crawls, dies
            or forges is left by the next one for this publisher, and is a leaf of later routes
            (:meth:`stats`' ``routed_around``). Over a group only. Defaults to ``"star"``.
    """

    def __init__(self, group: Any = None, *, server: Any = None, max_slots: int = 2,
                 subscribers: list[int] | None = None, channel: int = 0,
                 transport: str = "auto", route: str = "star") -> None:
        server, group = _pipe_end("Publisher", server, group, "TensorDictServer", "server")
        self._server = server
        if server is not None:
            _no_group_args("Publisher", "server", group=group is not None,
                           subscribers=subscribers is not None, channel=channel != 0,
                           route=route != "star")
            self._cpp = _C.PipePublisher(server._cpp, max_slots=max_slots, transport=transport)
            return
        pg = _collectives._group(group)
        ranks = [] if subscribers is None else [self._rank(pg, r) for r in subscribers]
        self._cpp = _C.Publisher(group=pg, max_slots=max_slots, subscribers=ranks,
                                 channel=channel, transport=transport, route=route)

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
        """Per subscriber: ``rank`` (in the group; None over a server), ``peer`` ("rank 2", or
        the pipe's peer "127.0.0.1:40123"), ``version`` (the last it received whole: its
        acknowledgement, no extra message), ``pulls``, ``pinned`` (the version it is receiving
        now, or None), ``waiting`` (a pull of it waits for a version), ``lost``, ``error``, and
        ``transport``: ``"shm"`` (it maps the slots in shared memory), ``"socket"``, or
        ``"socket (shared memory refused: <why>)"``; with ``route="chain"`` or ``"tree"``,
        ``relayed_from`` (the rank the last relayed version's pieces came from, -1 for this
        publisher; None when it was sent whole), ``relayed_second`` (``"tree"``: the same for
        the second half of its pieces; else None) and ``routed_around`` (None, or why a
        subscriber left this one as its relay: it is a leaf of later routes)."""
        return self._cpp.stats()

    def wait_for_subscribers(self, timeout: Wait, *, count: int | None = None) -> None:
        """Waits until ``count`` subscribers have pulled once (or been lost), at most
        ``timeout``; :class:`tensordict_cpp.errors.TimeoutError` naming those that have not
        (ranks that run no Subscriber, such as the reference ``tensordict``, which has none).

        Keyword Args:
            count (int, optional): how many subscribers to wait for. Over a group, defaults to
                every subscriber (a larger count raises ValueError); over a server, required
                (clients connect at any time: a ValueError without it). Defaults to ``None``.
        """
        if count is not None and count < 0:
            raise ValueError(f"wait_for_subscribers: count must not be negative, got {count}")
        self._cpp.wait_for_subscribers(_seconds(timeout), count=count)

    def close(self) -> None:
        """Stops serving (pulls waiting for a version raise NoPublisherError). Idempotent."""
        self._cpp.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Subscriber:
    """Pulls versions from the :class:`Publisher` on rank ``src``, or at the other end of a
    :class:`~tensordict_cpp.TensorDictPipe`.

    :meth:`pull` fills a TensorDict with the newest version newer than the one this subscriber
    holds: the bytes land in a buffer of the subscriber's own and are copied into the
    TensorDict's leaves once the whole version is in, so the TensorDict changes only inside
    ``pull``, only to one whole version, never torn. One pull runs at a time (a second waits
    for the first). From an event loop, :meth:`apull` and :meth:`updates` pull on a thread of
    their own, so that no publisher can hold the loop.

    Args:
        src (int or TensorDictPipe): the publisher's global rank (for a standalone group, its
            rank there); or a pipe, as ``pipe=``.
        group (torch.distributed.ProcessGroup, optional): the publisher's group. Defaults to
            ``None``: the default process group.

    Keyword Args:
        pipe (TensorDictPipe, optional): pull from the server at the other end of this pipe
            (made by ``TensorDictPipe.connect``), instead of a group; the pipe then carries the
            publication only (its send and recv raise). Defaults to ``None``.
        channel (int, optional): the publisher's channel (over a group). Defaults to 0.
        max_total_bytes (int, optional): the largest storage the publisher may announce.
            Defaults to ``None``: half of this machine's physical memory (over a pipe, its
            ``max_storage_bytes``).
        transport (str, optional): ``"auto"``: pull from the publisher's slots in shared memory
            when it offers them and they map (the same host and user), else over the socket;
            ``"shm"``: the same, but a pull raises RuntimeError, naming why, when they cannot
            be had; ``"socket"``: always over the socket. :attr:`transport` says which.
            Defaults to ``"auto"``.

    Raises:
        NoPublisherError: over a pipe whose peer is not a tensordict_cpp peer (the reference's
            pipe has no Publisher).
    """

    def __init__(self, src: Any = None, group: Any = None, *, pipe: Any = None,
                 channel: int = 0, max_total_bytes: int | None = None,
                 transport: str = "auto") -> None:
        pipe, src = _pipe_end("Subscriber", pipe, src, "TensorDictPipe", "pipe")
        self._pipe = pipe
        self._lock = threading.Lock()  # one pull at a time
        if pipe is not None:
            _no_group_args("Subscriber", "pipe", src=src is not None, group=group is not None,
                           channel=channel != 0)
            self._cpp = _C.PipeSubscriber(pipe._cpp, max_total_bytes=max_total_bytes,
                                          transport=transport)
            return
        if src is None:
            raise TypeError("Subscriber: src, the publisher's rank, is required over a group")
        pg = _collectives._group(group)
        self._cpp = _C.Subscriber(Publisher._rank(pg, src), group=pg, channel=channel,
                                  max_total_bytes=max_total_bytes, transport=transport)

    def pull(self, td: Any = None, *, timeout: Wait = None, min_version: int | None = None,
             allow_import: bool = False, zero_copy: bool = False) -> Any:
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
                version; then the pull returns None, ``td`` unchanged, the group or pipe
                usable. 0 polls: it takes what has arrived and waits for nothing (a version
                still on its way is taken by a later pull). Defaults to ``None``: until one is
                published.
            min_version (int, optional): wait for at least this version of the publisher's
                current epoch. Defaults to ``None``: any newer than the one held (a version of
                a new epoch is newer than any of the old one).
            allow_import (bool, optional): as :meth:`TensorDict.from_remote_init`'s, for a new
                TensorDict of a tensorclass. Defaults to ``False``.
            zero_copy (bool, optional): over shared memory (:attr:`transport` ``"shm"``), the
                leaves become views of the publisher's slot instead of copies (the same tensor
                objects: a ``TensorDictParams``' Parameters then view it). The slot is
                read-only (a write into a view kills this process with SIGSEGV, never changes
                what others read) and stays pinned, never rewritten, until the next pull that
                takes a version or :meth:`release`. Over a socket, ignored. Defaults to
                ``False``.

        Returns:
            The version's number, or the new TensorDict; None when the timeout passed first.

        Raises:
            SchemaMismatchError: when ``td``'s keys, dtypes or shapes are not the version's,
                naming the first difference (``td`` unchanged).
            NoPublisherError: when the publisher's side has taken none of this subscriber's
                requests within the timeout (no Publisher runs there: not yet, or it runs the
                reference ``tensordict``; one that took requests before is slow or stopped,
                and the pull returns None), or its Publisher closed (then
                :attr:`publisher_closed` is True).
            MalformedPeerDataError: for bytes that break the publication messages.
            PeerLostError: when the publisher's connection broke.
        """
        wait = _seconds(timeout)
        into = None if td is None else _cpp(td, "pull")[0]
        with self._lock:
            if into is not None:
                return self._cpp.pull_into(into, timeout=wait, min_version=min_version,
                                           zero_copy=zero_copy)
            got = self._cpp.pull_new(timeout=wait, min_version=min_version, zero_copy=zero_copy)
        if got is None:
            return None
        cpp, _version, tensorclass_type = got
        return _collectives._typed(TensorDict._wrap, (cpp, tensorclass_type), allow_import)

    async def apull(self, td: Any = None, *, timeout: Wait = None,
                    min_version: int | None = None, allow_import: bool = False,
                    zero_copy: bool = False) -> Any:
        """:meth:`pull` as a coroutine: the pull runs on a thread of its own while the event
        loop goes on. Cancelled, it makes the pull return within 100 ms and waits for that, so
        ``td`` is never written after the cancellation (it holds its old version, or the whole
        new one if the pull had completed)."""
        return await _in_thread(
            lambda: self.pull(td, timeout=timeout, min_version=min_version,
                              allow_import=allow_import, zero_copy=zero_copy),
            self._cpp.interrupt)

    async def updates(self, td: Any, *, timeout: Wait = None,
                      zero_copy: bool = False) -> AsyncIterator[int]:
        """Pulls each new version into ``td`` and yields its number: ``async for v in
        sub.updates(td)``. Ends when the publisher closes; a version not published within
        ``timeout`` (default: no limit) raises :class:`tensordict_cpp.errors.TimeoutError`."""
        from tensordict_cpp.errors import TimeoutError as PullTimeout
        if td is None:
            raise TypeError("updates: pass the TensorDict to fill (pull() without one makes it)")
        while True:
            try:
                version = await self.apull(td, timeout=timeout, zero_copy=zero_copy)
            except NoPublisherError:
                if self.publisher_closed:
                    return
                raise
            if version is None:
                raise PullTimeout(f"updates: no new version within {timeout} s")
            yield version

    @property
    def version(self) -> int:
        """The version held (0: none)."""
        return self._cpp.version

    @property
    def epoch(self) -> int:
        """The epoch of the version held (0: none); it changes when the publisher restarts."""
        return self._cpp.epoch

    @property
    def publisher_closed(self) -> bool:
        """Whether a pull found the publisher closed."""
        return self._cpp.publisher_closed

    @property
    def transport(self) -> str:
        """How this subscriber pulls: ``"shm"``, ``"socket"``, or ``"socket (shared memory
        refused: <why>)"``. ``"socket"`` until the first pull has asked."""
        return self._cpp.transport

    @property
    def routed_around(self) -> list[str]:
        """The relays (a publisher's ``route="chain"``) this subscriber stopped taking a
        version's pieces from, for the publisher, the newest last: who, at which piece, and
        why. Empty over a pipe."""
        return list(self._cpp.routed_around)

    def release(self) -> None:
        """Unpins the slot that the last ``zero_copy`` pull left the TensorDict viewing: the
        publisher may then rewrite it, so the views' contents may change. Nothing over a
        socket."""
        with self._lock:
            self._cpp.release()


async def _in_thread(fn: Callable[[], Any], interrupt: Callable[[bool], None]) -> Any:
    """Runs ``fn`` on a daemon thread of its own (an interpreter that exits does not wait for a
    pull) and awaits it. Cancelled, it calls ``interrupt(True)``, waits for ``fn`` to return,
    then ``interrupt(False)``, and re-raises."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            outcome: tuple = (fn(), None)
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting task
            outcome = (None, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody awaits
            pass

    thread = threading.Thread(target=run, name="td-subscriber-pull", daemon=True)
    thread.start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        interrupt(True)
        try:
            while not done.done():
                await asyncio.sleep(0.005)
        finally:
            interrupt(False)
        raise
