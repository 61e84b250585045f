"""TensorDictPipe and TensorDictServer: stream TensorDicts between processes over UCX.

The transport is the C++ pipe (``tensordict::pipe``, docs/pipe.md): each pipe has its own UCX
worker, driven by a C++ progress thread while nobody waits. The coroutines (:meth:`asend`,
:meth:`arecv`) run on the event loop's own thread without handing anything to another one:
a receive waits on the pipe's event fd (``add_reader``), after a short busy-poll (the ``spin``
option), until every message of its TensorDict has arrived, then receives it on the loop's
thread; a small send of a known schema goes out at once (it never waits for the peer). What
could hold the loop goes to a thread owned by the pipe, one per direction, while the loop keeps
running: a send that would wait for the peer (a new schema, more than 8 KiB, a full
flow-control window) and a receive with a message too large to set aside before it lands (over
1 MiB). No peer can make the loop wait: a stalled or hostile one delays only its own pipe. The
plain methods (:meth:`send`, :meth:`recv`, ...) block the calling thread. Both work with or
without a running event loop: a plain call inside a coroutine blocks that loop for its
duration, but it never deadlocks, since completing it needs no Python code.

>>> async def consumer():
...     pipe = await TensorDictPipe.listen(0)          # returns at once, bound
...     print(pipe.port)                               # give it to the producer
...     async for td in pipe:                          # ends when the producer closes
...         print(td["obs"].sum())
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import torch

from tensordict_cpp import _C
from tensordict_cpp._td import TensorDict
from tensordict_cpp import errors
from tensordict_cpp.errors import PeerClosedError, PipeClosedError

__all__ = ["TensorDictPipe", "TensorDictServer"]

def _cpp_td(td: Any) -> Any:
    """The _C.TensorDict of ours, or of a reference TensorDict (its leaves shared)."""
    # from_tensordict raises the TypeError for anything else.
    return None if td is None else TensorDict.from_tensordict(td)._cpp


def _device(device: Any) -> torch.device | None:
    return None if device is None else torch.device(device)


class _EndpointLoop:
    """The event loop that runs an endpoint's coroutines: the running one when the pipe is
    made, then the one of each asend / arecv / aclose (a new asyncio.run each time works, as
    with the reference's pipe). A plain call with no such loop running runs each message in a
    new event loop of its own, as the reference's plain calls do."""

    def __init__(self) -> None:
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    def bind(self) -> None:
        self.loop = asyncio.get_running_loop()

    def on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def run(self, coro_fn: Callable, *args: Any, timeout: float) -> Any:
        if self.on_loop_thread():
            raise RuntimeError("a pipe over an endpoint cannot block the thread of the "
                               "endpoint's event loop: await asend / arecv / aclose there")
        if self.loop is not None and self.loop.is_running():
            return asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop).result(timeout)
        return asyncio.run(asyncio.wait_for(coro_fn(*args), timeout))


async def _maybe_await(value: Any) -> None:
    if inspect.isawaitable(value):
        await value


def _over_endpoint(endpoint: Any, listener: Any, options: dict) -> tuple[Any, _EndpointLoop]:
    """A _C.Pipe whose messages go through ``endpoint``'s coroutines ``send(buffer)`` and
    ``recv(buffer)`` (and its ``close()``), on the loop that runs them: a ucxx ``Endpoint``,
    or any object with those methods, the only ones the reference's pipe calls."""
    _require_pipe()
    missing = [m for m in ("send", "recv", "close") if not callable(getattr(endpoint, m, None))]
    if missing:
        raise TypeError(f"TensorDictPipe(endpoint) takes an endpoint with the coroutines "
                        f"send(buffer) and recv(buffer) and a close() (a ucxx Endpoint, or an "
                        f"object of yours); {type(endpoint).__name__} has no "
                        f"{' or '.join(missing)} (use TensorDictPipe.listen or connect for a "
                        f"pipe of its own)")
    loop = _EndpointLoop()
    timeout = float(options.get("timeout", 30.0))
    buffer = memoryview
    if not type(endpoint).__module__.startswith("ucxx"):
        try:  # the reference hands its endpoint numpy arrays (views here: no copy)
            import numpy

            def buffer(view: memoryview) -> Any:
                return numpy.frombuffer(view, dtype=numpy.uint8)
        except ImportError:
            pass

    async def close_both() -> None:
        await _maybe_await(endpoint.close())
        if listener is not None:
            await _maybe_await(listener.close())

    def close() -> None:
        if loop.on_loop_thread():
            loop.loop.create_task(close_both())
        else:
            loop.run(close_both, timeout=timeout)

    tag = (getattr(endpoint, "_tags", None) or {}).get("msg_send")
    pipe = _C.Pipe.over(lambda buf: loop.run(endpoint.send, buffer(buf), timeout=timeout),
                        lambda buf: loop.run(endpoint.recv, buffer(buf), timeout=timeout),
                        close, peer=f"{type(endpoint).__name__} {getattr(endpoint, 'uid', 0):#x}",
                        peer_tag=tag, **options)
    return pipe, loop


class _LoopWatch:
    """A pipe's event fd (``Pipe.event_fd``) registered with one event loop, shared by the
    pipe's coroutines waiting on that loop. Used on the loop's thread only."""

    def __init__(self, cpp: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._cpp, self._loop, self._fd = cpp, loop, cpp.event_fd()
        self._users = 0
        self._waiting: list[asyncio.Future] = []

    def acquire(self) -> None:
        if self._users == 0:
            self._cpp.watch(True)  # before the caller's next look: no event is missed
            self._loop.add_reader(self._fd, self._fire)
        self._users += 1

    def release(self) -> bool:
        """True when no coroutine uses it any more (then it is unregistered)."""
        self._users -= 1
        if self._users == 0:
            self._loop.remove_reader(self._fd)
            self._cpp.watch(False)
        return self._users == 0

    def _fire(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # another loop's reader of the same pipe read it first
            pass
        self.wake()

    def wake(self) -> None:
        waiting, self._waiting = self._waiting, []
        for fut in waiting:  # every waiter looks again: an event says only "maybe"
            if not fut.done():
                fut.set_result(None)

    async def next_event(self, timeout: float) -> None:
        """Returns at the pipe's next event or after ``timeout`` seconds."""
        fut = self._loop.create_future()
        self._waiting.append(fut)
        timer = self._loop.call_later(timeout, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            timer.cancel()


def _require_pipe() -> None:
    if not hasattr(_C, "Pipe"):
        raise ImportError("tensordict_cpp was built without the UCX pipe: pip install "
                          "libucx-cu12 and rebuild with TENSORDICT_BUILD_PIPE=ON")


class TensorDictPipe:
    """One end of a point-to-point channel that streams TensorDicts over UCX.

    Create one with :meth:`listen` on one side and :meth:`connect` on the other (or their
    ``_sync`` forms), not with the constructor. The framing is the reference
    ``tensordict._ucxx.TensorDictPipe``'s: with ``consolidated=True`` the first message, and
    each message with a new structure, carries the metadata and the consolidated storage; the
    next ones carry the storage only, which the receiver writes into the TensorDict it
    returned last, without allocating. With ``consolidated=False`` each message carries a JSON
    header and every tensor leaf, and each receive returns a new TensorDict. Non-tensor
    entries travel in both modes (in the metadata, or in the header's ``non_tensors``).

    The messages are the reference's, as UCX tag messages after ucxx's connection handshake, so
    either end may be the reference's pipe (``tensordict._ucxx``, over ucxx). One send and one
    receive may run at once (the two directions are independent); calls in the same direction
    run one after the other, in the order they were made. ``close()`` returns promptly: what
    was sent stays readable by the peer. To a peer of ours it first sends a close marker, so
    that the peer's ``async for`` ends cleanly after the last message; a reference peer's
    disconnect between two messages counts as its clean close.

    A pipe is a context manager and an async context manager (both close it), and an async
    iterator: ``async for td in pipe`` receives until the peer closes the pipe cleanly (or
    this end is closed), and raises every other error.

    .. warning::
        With ``consolidated=True``, each receive with the same structure overwrites and returns
        the same TensorDict, whichever task, loop or thread made it (concurrent consumers of
        one pipe share it): ``clone()`` it to keep it, or pass a consolidated TensorDict of
        your own with the sender's layout (``arecv(mine)``) to receive into that instead.

    Keyword Args (of :meth:`listen` and :meth:`connect`):
        consolidated (bool): the framing; both ends must agree. Defaults to ``True``.
        timeout (float): seconds any wait may take (connect, accept, each message), and an
            :meth:`asend`'s whole call (time queued behind earlier ones included). An expired
            wait breaks the pipe, except where nothing was received or sent: an :meth:`arecv`
            waiting on its loop, a send waiting for the window. Defaults to ``30``.
        max_metadata_bytes (int): the largest metadata a receive accepts. Defaults to 64 MiB.
        max_storage_bytes (int | None): the largest storage a receive accepts. ``None`` (the
            default): half of this machine's physical memory.
        max_unreceived (int): flow control: how many sent TensorDicts the peer may not yet
            have started receiving before a send waits (then raises TimeoutError after
            ``timeout``, having sent nothing). Defaults to ``16``.
        max_unread_bytes (int): the most the peer may leave here unread (its messages that
            arrived before a receive took them, each charged its length plus about 4 KiB;
            one long message, a rendezvous, is charged 4 KiB). Beyond it the pipe breaks
            and the next receive raises ``MalformedPeerDataError`` naming it. Defaults to
            64 MiB.
        spin (float): seconds a waiting call progresses UCX itself, idle, before it sleeps (low
            latency for quick replies, at the cost of the CPU of the spin). Defaults to
            ``0.0001``.
        linger (float): seconds ``close()`` waits for the peer to start receiving what was
            sent (not needed for delivery). Defaults to ``0``.
    """

    # The marker by which TensorDict.send / recv / asend / arecv (tensordict_cpp._p2p, a layer
    # below that cannot import this module) recognise a pipe as their `dst` / `src`: they then
    # call its send(td) / recv(td) / asend(td) / arecv(td, device=...).
    _tensordict_pipe = True

    def __init__(self, endpoint: Any, *, listener: Any = None, **options: Any) -> None:
        """A pipe over ``endpoint``, as the reference's constructor takes it: a ucxx
        ``Endpoint`` (from ``ucxx.create_endpoint`` or a ``ucxx.create_listener`` callback),
        or any object with the methods the reference's pipe calls, the coroutines
        ``send(buffer)`` and ``recv(buffer)`` (a buffer is a uint8 numpy array, or a
        memoryview without numpy: ``recv`` fills it whole) and ``close()`` (a coroutine or
        not). Pipe options are keywords (``consolidated=True``, ...), and ``listener`` is
        closed with the pipe, if given. The endpoint's coroutines run on the event loop of the
        latest :meth:`asend` / :meth:`arecv` / :meth:`aclose` (or the one running when the pipe
        is made); the plain methods called from other threads use that loop while it runs, and
        otherwise run each message in a new event loop, as the reference's. Our framing, limits
        and validation apply; each message waits at most ``timeout``. :meth:`listen` and
        :meth:`connect` make a pipe with a UCX connection of its own instead.

        Raises:
            TypeError: if ``endpoint`` lacks one of those methods.
        """
        self._endpoint_loop: _EndpointLoop | None = None
        if not isinstance(endpoint, _C.Pipe):
            endpoint, self._endpoint_loop = _over_endpoint(endpoint, listener, options)
        self._cpp = endpoint
        self._lock = threading.Lock()
        self._send_ex: concurrent.futures.ThreadPoolExecutor | None = None
        self._recv_ex: concurrent.futures.ThreadPoolExecutor | None = None
        # Calls handed to those threads and not finished: while any is, later calls of that
        # direction follow them there, so that calls keep their order.
        self._queued = {"send": 0, "recv": 0}
        self._watches: dict[asyncio.AbstractEventLoop, _LoopWatch] = {}
        self._send_line: list[object] = []  # asends waiting for room in the window, in order
        self._last: TensorDict | None = None  # so a same-schema receive returns the same object
        self._orphan: concurrent.futures.Future | None = None  # see arecv

    # ---- creation ----------------------------------------------------------------------------
    @classmethod
    def listen_sync(cls, port: int = 0, host: str = "127.0.0.1", **options: Any) -> "TensorDictPipe":
        """Binds ``host``:``port`` and returns at once, without waiting for the client: the
        first send or receive (or :meth:`accept`) waits for it, up to ``timeout``. Port 0 binds
        a free port (see :attr:`port`). The pipe serves its first client only.

        Raises:
            RuntimeError: if the address cannot be bound.
            ValueError: for a bad port or host.
        """
        _require_pipe()
        return cls(_C.Pipe.listen(port=port, host=host, **options))

    @classmethod
    def connect_sync(cls, host: str, port: int, **options: Any) -> "TensorDictPipe":
        """Connects to a listening pipe or server, waiting up to ``timeout``.

        Raises:
            RuntimeError: if the peer is unreachable or refuses, or on timeout.
        """
        _require_pipe()
        return cls(_C.Pipe.connect(host=host, port=port, **options))

    @classmethod
    async def listen(cls, port: int = 0, host: str = "127.0.0.1", **options: Any) -> "TensorDictPipe":
        """:meth:`listen_sync` as a coroutine. Unlike the reference it does not wait for the
        client, so one task can listen, then connect, then exchange."""
        return await asyncio.to_thread(cls.listen_sync, port, host, **options)

    @classmethod
    async def connect(cls, host: str, port: int, **options: Any) -> "TensorDictPipe":
        """:meth:`connect_sync` as a coroutine."""
        return await asyncio.to_thread(cls.connect_sync, host, port, **options)

    def accept(self) -> None:
        """Listening pipe: waits (up to ``timeout``) for the client. Connected pipe: returns."""
        self._cpp.accept()

    async def aaccept(self) -> None:
        """:meth:`accept` as a coroutine."""
        await self._submit("recv", self._cpp.accept)

    # ---- transfers ---------------------------------------------------------------------------
    def send(self, td: TensorDict) -> None:
        """Sends ``td`` and waits until it is sent; blocks the calling thread (in a coroutine,
        prefer :meth:`asend`). A TensorDict that is not consolidated is consolidated (copied)
        first, on each call: consolidate it once and update it in place to avoid the copy.

        Raises:
            RuntimeError: on a closed or broken pipe, a peer error or a timeout: a
                :class:`~tensordict_cpp.errors.PipeClosedError` ("Cannot send on a closed
                pipe.") when this end is closed, a
                :class:`~tensordict_cpp.errors.PeerClosedError` after the peer closed it.
            ValueError: for a TensorDict the wire cannot carry.
            TypeError: if ``td`` is neither a tensordict_cpp.TensorDict nor a reference
                ``tensordict.TensorDict`` (sent as it is: its leaves are shared, not copied).
        """
        self._cpp.send(_cpp_td(td))

    async def asend(self, td: TensorDict) -> None:
        """:meth:`send` as a coroutine. ``td`` must stay unchanged until it returns. A send that
        cannot wait for the peer (a consolidated TensorDict of the previous send's schema, up to
        8 KiB, to a peer of ours) is made on the loop's thread: at once with room in the
        flow-control window, else after waiting on the loop for the peer's receipts (behind
        earlier asends); any other runs on the pipe's send thread. Cancelled while it waits for
        room, it has sent nothing; once on the thread, the send completes (or fails) in the
        background."""
        cpp_td = _cpp_td(td)
        # Its own deadline, from this call: time spent in line behind earlier asends counts.
        deadline = time.monotonic() + self._timeout()
        if self._endpoint_loop is not None:
            self._endpoint_loop.bind()
        elif not self._queued["send"]:
            # Behind asends waiting for room in the window, this one waits in line too. A full
            # window busy-polls for the pipe's spin first: the receipts are often under way.
            attempt = "window_full" if self._send_line else self._cpp.try_send(cpp_td, True)
            if attempt == "sent":
                return
            if attempt == "window_full" and await self._send_when_room(cpp_td, deadline):
                return
        await self._submit("send", self._send_by, cpp_td, deadline)

    def _send_by(self, cpp_td: Any, deadline: float) -> None:
        # On the send thread: every wait of the send ends by the asend's deadline (raising
        # TimeoutError at once, having sent nothing, when it passed in the queue).
        self._cpp.send(cpp_td, timeout=deadline - time.monotonic())

    async def _send_when_room(self, cpp_td: Any, deadline: float) -> bool:
        """Waits on the loop, in line behind earlier asends, until the flow-control window has
        room, and sends; TimeoutError, having sent nothing, at ``deadline``. False when the
        send turned out to need the thread after all."""
        token = object()
        self._send_line.append(token)
        attempt = "window_full"

        def sent_or_cannot() -> bool:
            nonlocal attempt
            if self._send_line[0] is not token:
                return False
            attempt = self._cpp.try_send(cpp_td)
            return attempt != "window_full"

        try:
            await self._until(sent_or_cannot, lambda: errors.TimeoutError(
                f"send: the peer {self._cpp.peer} has not started receiving the last "
                f"TensorDicts within {self._timeout():g} s (max_unreceived); nothing was sent"),
                deadline)
        finally:
            self._send_line.remove(token)
            if self._send_line:  # the next in line looks again now
                watch = self._watches.get(asyncio.get_running_loop())
                if watch is not None:
                    watch.wake()
        return attempt == "sent"

    def recv(self, td: TensorDict | None = None, *, device: Any = None) -> TensorDict:
        """Receives one TensorDict and returns it; blocks the calling thread (in a coroutine,
        prefer :meth:`arecv`).

        Args:
            td (TensorDict, optional): a consolidated TensorDict to receive into when its
                layout matches the message. Otherwise the pipe returns the TensorDict of its
                previous receive (same structure) or a new one: use the return value. A
                reference ``tensordict.TensorDict`` is taken as one of ours sharing its leaves
                (it does not carry the reference's consolidation, so a new one is returned).

        Keyword Args:
            device: the device of a newly allocated storage. Defaults to the sender's device
                with ``consolidated=True``, else the CPU. Only the CPU is supported here.

        Raises:
            RuntimeError: on a closed or broken pipe, a peer error, a timeout, a clean close by
                the peer (:class:`~tensordict_cpp.errors.PeerClosedError`, "the peer closed
                the pipe", see :attr:`peer_closed`), or framing errors (unknown flag, sizes
                over the caps, a same-schema message with nothing to receive into); a
                :class:`~tensordict_cpp.errors.PipeClosedError` when this end is closed.
            ValueError: for invalid metadata from the peer.
        """
        return self._recv_blocking(td, device)

    async def arecv(self, td: TensorDict | None = None, *, device: Any = None) -> TensorDict:
        """:meth:`recv` as a coroutine.

        It receives on the loop's thread only a TensorDict whose messages have all arrived (at
        most 1 MiB together), and never waits there for the peer: until they have, it waits
        on the pipe's event fd (after a busy-poll of ``spin`` seconds), without a thread, and
        each message that arrives is set aside in order. A TensorDict with a larger message
        is received on the pipe's receive thread instead, while the loop keeps running.
        Waiting longer than ``timeout`` for a whole TensorDict raises ``TimeoutError`` having
        received nothing, and leaves the pipe usable: the part that arrived is kept for the
        next :meth:`arecv`.

        Cancelling it (``asyncio.wait_for`` included) returns at once, loses nothing and leaves
        the pipe usable: cancelled while waiting on the loop, it has received nothing (what
        arrived is kept, in order, for the next receive); cancelled while the receive thread
        was receiving, the message is returned by the next :meth:`arecv` (which then ignores
        its own arguments), or its error raised there (a timeout there breaks the pipe, as
        :meth:`recv`'s does).
        """
        if self._endpoint_loop is not None:
            self._endpoint_loop.bind()
            return await self._arecv_on_thread(td, device)
        # Read without the lock: a stale answer only sends this call to the thread, in order.
        if self._orphan is None and not self._queued["recv"]:
            into, dev = _cpp_td(td), _device(device)
            got = self._cpp.try_recv(into, device=dev, spin=True)  # busy-polls for the spin
            if type(got) is str and got == "not_arrived":
                got = await self._when_arrived(into, dev)
            if type(got) is not str:  # received whole, on the loop's thread
                return self._wrap(td, into, got)
        return await self._arecv_on_thread(td, device)

    async def _when_arrived(self, into: Any, device: Any) -> Any:
        """Waits on the loop until try_recv receives (the TensorDict) or needs the thread
        ("would_wait"); TimeoutError, having received nothing, after the pipe's timeout."""
        got: Any = "not_arrived"

        def arrived() -> bool:
            nonlocal got
            if self._orphan is not None or self._queued["recv"]:
                got = "would_wait"  # in line behind a receive on the thread
            else:
                got = self._cpp.try_recv(into, device=device)
            return type(got) is not str or got != "not_arrived"

        await self._until(arrived, lambda: errors.TimeoutError(
            f"recv: no whole TensorDict from {self._cpp.peer or 'a client'} within "
            f"{self._timeout():g} s (the pipe's timeout); nothing was received, the pipe stays "
            f"usable (what arrived is kept for the next receive)"),
            time.monotonic() + self._timeout())
        return got

    async def _until(self, ready: Callable[[], bool],
                     timeout_error: Callable[[], BaseException], deadline: float) -> None:
        """Waits on the pipe's event fd, on the running loop, until ``ready()`` (looked at
        after each event), or raises ``timeout_error()`` at ``deadline`` (time.monotonic())."""
        loop = asyncio.get_running_loop()
        with self._lock:
            watch = self._watches.get(loop)
            if watch is None:
                watch = self._watches[loop] = _LoopWatch(self._cpp, loop)
            watch.acquire()
        try:
            while not ready():  # looked at after watching: no event is missed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise timeout_error()
                await watch.next_event(remaining)
        finally:
            with self._lock:
                if watch.release():  # idle: a loop that ends leaves nothing behind
                    del self._watches[loop]

    async def _arecv_on_thread(self, td: Any, device: Any) -> TensorDict:
        with self._lock:
            cf, self._orphan = self._orphan, None
        if cf is None or cf.cancelled():
            cf = self._submit_future("recv", self._recv_blocking, td, device)
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            if not cf.cancelled():  # already running: it will complete; keep its result
                with self._lock:
                    self._orphan = cf
            raise

    def _recv_blocking(self, td: Any, device: Any) -> Any:
        into = _cpp_td(td)
        return self._wrap(td, into, self._cpp.recv(into, device=_device(device)))

    def _wrap(self, td: Any, into: Any, out: Any) -> Any:
        """The Python TensorDict of ``out``, received into ``into`` (``td``'s): the same
        object as before when the receive landed in place."""
        if into is not None and not isinstance(td, TensorDict) and into.is_same(out):
            return td  # a reference TensorDict, received into its own tensors
        # The same C++ TensorDict as before (same schema): the same Python object too. No lock:
        # the C++ pipe runs one receive at a time, and each call compares with its own result.
        for known in (self._last, td):
            if known is not None and known._cpp.is_same(out):
                self._last = known
                return known
        self._last = TensorDict._wrap(out)
        return self._last

    # ---- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the pipe (see the class description) and joins its threads. Idempotent.
        Returns promptly whether or not the peer reads (waiting at most ``linger`` seconds, 0 by
        default, for it to start): what was sent stays readable by the peer. In a coroutine,
        prefer :meth:`aclose`. Pending calls in other threads or tasks fail."""
        self._cpp.close()
        with self._lock:
            executors, self._send_ex, self._recv_ex = (self._send_ex, self._recv_ex), None, None
        for ex in executors:
            if ex is not None:
                ex.shutdown(wait=True)  # prompt: the close failed the calls they were running

    async def aclose(self) -> None:
        """:meth:`close` as a coroutine."""
        if self._endpoint_loop is not None:
            self._endpoint_loop.bind()
        await asyncio.to_thread(self.close)

    @property
    def closed(self) -> bool:
        """Whether this end was closed."""
        return self._cpp.closed

    @property
    def peer_closed(self) -> bool:
        """Whether the peer closed the pipe cleanly (its close marker was received, after
        every message it sent)."""
        return self._cpp.peer_closed

    @property
    def port(self) -> int:
        """The bound port of a listening pipe, else the peer's port."""
        return self._cpp.port

    @property
    def peer(self) -> str:
        """``"host:port"`` of the peer ("" before a client arrives)."""
        return self._cpp.peer

    @property
    def consolidated(self) -> bool:
        return self._cpp.consolidated

    def stats(self) -> dict[str, int]:
        """Counters: sends, schema_sends (those with metadata), recvs, schema_recvs,
        bytes_sent, bytes_received (framing included)."""
        return self._cpp.stats()

    def __enter__(self) -> "TensorDictPipe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "TensorDictPipe":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __aiter__(self) -> "TensorDictPipe":
        return self

    async def __anext__(self) -> TensorDict:
        try:
            return await self.arecv()
        except (PeerClosedError, PipeClosedError):
            # A clean end: the peer's close marker, or this end closed on purpose. Anything
            # else (a lost peer, a timeout, a framing error) is raised.
            raise StopAsyncIteration from None

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("peer closed" if self.peer_closed else "open")
        return f"TensorDictPipe(port={self.port}, peer={self.peer!r}, {state})"

    # ---- helpers -----------------------------------------------------------------------------
    def _executor(self, op: str) -> concurrent.futures.ThreadPoolExecutor:
        # One thread per direction, made on first use: calls keep their order, and a blocked
        # receive never waits behind another pipe's work (as it could in a shared pool).
        name = f"_{op}_ex"
        with self._lock:
            ex = getattr(self, name)
            if ex is None:
                if self._cpp.closed:  # no thread for a pipe that close() will not see again
                    raise PipeClosedError(f"Cannot {op} on a closed pipe.")
                ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"td-pipe-{op}")
                setattr(self, name, ex)
            return ex

    def _submit_future(self, op: str, fn: Callable, *args: Any) -> concurrent.futures.Future:
        ex = self._executor(op)
        with self._lock:
            self._queued[op] += 1
        try:
            cf = ex.submit(fn, *args)
        except BaseException:
            self._finished(op)
            raise
        cf.add_done_callback(lambda _: self._finished(op))
        return cf

    def _finished(self, op: str) -> None:
        with self._lock:
            self._queued[op] -= 1

    async def _submit(self, op: str, fn: Callable, *args: Any) -> Any:
        return await asyncio.wrap_future(self._submit_future(op, fn, *args))

    def _timeout(self) -> float:
        return self._cpp.timeout


# The handler errors a server keeps (the latest), as the C++ server does: a client that makes
# its handler fail on every reconnect must not grow the server.
_MAX_HANDLER_ERRORS = 1000


class TensorDictServer:
    """A listener that accepts many clients and gives each one a :class:`TensorDictPipe`.

    Binds at once (port 0: a free port, see :attr:`port`). Get the pipes with :meth:`serve`,
    ``async for pipe in server`` or :meth:`accept`. :meth:`close` stops accepting and closes
    every pipe the server handed out, so handlers blocked in a receive fail promptly; it is
    idempotent. A server is a context manager and an async context manager.

    Args:
        port (int): the port; 0 picks a free one. Defaults to ``0``.
        host (str): the address to bind; ``"0.0.0.0"`` listens on every interface. Defaults to
            ``"127.0.0.1"``.

    Keyword Args:
        the pipe options of :class:`TensorDictPipe` (``consolidated``, ``timeout``, ...), for
        every accepted pipe.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", **options: Any) -> None:
        _require_pipe()
        self._cpp = _C.PipeServer(port=port, host=host, **options)
        self._closed = False
        self._lock = threading.Lock()
        self._accept_ex = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="td-server-accept")
        self._pipes: list[TensorDictPipe] = []
        self._tasks: set[asyncio.Task] = set()
        self.handler_errors: list[BaseException] = []
        """Exceptions raised by :meth:`serve`'s handlers, except those caused by close() or
        by a clean close of their client: the latest 1,000."""

    @property
    def port(self) -> int:
        return self._cpp.port

    @property
    def clients(self) -> int:
        """Number of clients accepted so far."""
        return self._cpp.clients

    @property
    def closed(self) -> bool:
        return self._closed

    def accept_sync(self, timeout: float | None = None) -> TensorDictPipe | None:
        """The next client's pipe, waiting up to ``timeout`` seconds (default: the pipes'
        timeout); ``None`` when none came in time or the server is closed."""
        try:
            cpp = self._cpp.accept(timeout=timeout)
        except RuntimeError:
            if self._closed:
                return None
            raise
        if cpp is None:
            return None
        pipe = TensorDictPipe(cpp)
        with self._lock:
            if self._closed:  # close() ran meanwhile: it did not see this one
                closing = True
            else:
                closing = False
                # Clients come and go: the server keeps only the pipes still open.
                self._pipes = [p for p in self._pipes if not p.closed]
                self._pipes.append(pipe)
        if closing:
            pipe.close()
            return None
        return pipe

    async def accept(self, timeout: float | None = None) -> TensorDictPipe | None:
        """:meth:`accept_sync` as a coroutine."""
        return await asyncio.wrap_future(self._accept_ex.submit(self.accept_sync, timeout))

    async def __aiter__(self) -> AsyncIterator[TensorDictPipe]:
        """Yields each new client's pipe until the server is closed."""
        while not self._closed:
            pipe = await self.accept(1.0)  # close() wakes it at once; the slice only bounds
            if pipe is not None:
                yield pipe

    async def serve(self, handler: Callable[[TensorDictPipe], Awaitable[None] | None]) -> None:
        """Accepts clients until :meth:`close`, running ``handler(pipe)`` for each as its own
        task; each pipe is closed when its handler returns. Returns once the server is closed
        and every handler has finished (close() makes blocked receives fail promptly).
        Handler exceptions go to :attr:`handler_errors`; cancelling serve cancels the
        handlers."""
        try:
            async for pipe in self:
                task = asyncio.ensure_future(self._run_handler(handler, pipe))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            tasks = list(self._tasks)
            if not self._closed:  # cancelled: take the handlers down with it
                for t in tasks:
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_handler(self, handler: Callable, pipe: TensorDictPipe) -> None:
        try:
            result = handler(pipe)
            if inspect.isawaitable(result):
                await result
        except Exception as err:  # noqa: BLE001 - kept for the caller, as the C++ server does
            if not (self._closed or pipe.peer_closed):
                self.handler_errors.append(err)
                del self.handler_errors[:-_MAX_HANDLER_ERRORS]
        finally:
            await pipe.aclose()

    def close(self) -> None:
        """Stops accepting, closes every pipe handed out, and joins the server's threads.
        In a coroutine, prefer :meth:`aclose`."""
        with self._lock:
            self._closed = True
            pipes, self._pipes = self._pipes, []
        self._cpp.close()  # closes the listener and the C++ side of every accepted pipe
        for pipe in pipes:
            pipe.close()
        self._accept_ex.shutdown(wait=True)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> "TensorDictServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "TensorDictServer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
