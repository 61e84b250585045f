"""send / recv / isend / irecv of tensordict_cpp.TensorDict (bound as its methods).

A layer below ``_td``: these functions take the TensorDict as ``self`` and use only its ``_cpp``
(the ``_C.TensorDict``), so this module imports nothing of the package but ``_C``. A pipe
(``tensordict_cpp.pipe``, a layer above) is recognised by protocol, not by import: an object
whose class sets ``_tensordict_pipe = True`` and has ``send(td)`` / ``recv(td)`` /
``asend(td)`` / ``arecv(td, device=...)`` taking a TensorDict (see ``_is_pipe``).

The transfers run in C++ with the GIL released. Global ranks (``dst`` / ``src``) are turned
into ranks of the group here, by torch.distributed itself, because the groups a Python program
uses live in torch.distributed's Python registry; everything else is checked by the C++ core,
which raises the reference's ValueError texts.
"""
from __future__ import annotations

import datetime
from typing import Any, Union

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from tensordict_cpp import _C

#: A transfer's ``timeout``: seconds, a ``datetime.timedelta``, or ``None`` (the group's).
Timeout = Union[float, datetime.timedelta, None]


# Paragraphs that several docstrings share, formatted in once (below the functions).
_DOCS = {
    "timeout": """timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together. On expiry it raises
            :class:`~tensordict_cpp.errors.TimeoutError` (a
            ``torch.distributed.DistBackendError``) naming the call, the peer, the tag or key in
            flight and the time waited. The group stays usable: the call's waits are aborted,
            never left to Gloo's own timeout, and what it posted stays posted: a send stays
            queued (its tensors kept until the receiver takes them), a receive waits for the
            next receive from that peer on its tags (see ``late``). With a timeout, received
            bytes land in buffers of the library's own and are copied into this TensorDict once
            the whole transfer is in (one copy more, none without a timeout), so a receive that
            times out leaves it unchanged and never writes it afterwards. Defaults to ``None``:
            each wait runs under the group's own timeout, whose expiry makes Gloo close the
            group's connections. See docs/reliability.md.""",
    "checked": """checked (bool, optional): if ``True`` (on both sides), a header with the byte
            count and a schema of the keys, dtypes and shapes goes before the payload, so that
            a receiver whose TensorDict differs raises an error naming the first difference and
            keeps its values, instead of being aborted by Gloo (sent more bytes than it posted)
            or filled in part (sent fewer). Not in the reference: its peers cannot take part.
            The ``Work`` handles of ``return_early`` / ``return_premature`` are then those of
            the checked messages. See docs/reliability.md. Defaults to ``False``.""",
    "late": """late (str, optional): what this receive does with a message that an earlier
            receive from the same peer on the same tags gave up on (its timeout passed):
            ``"deliver"`` returns it (messages keep their order, this receive gets the late
            one); ``"drop"`` receives it, drops it and waits for the next. Defaults to
            ``"deliver"``.""",
}


def _late(late: str) -> None:
    """Checks ``late`` before anything else of the call (the binding converts it)."""
    if late not in ("deliver", "drop"):
        raise ValueError(f'late must be "deliver" or "drop", got "{late}"')


def _seconds(timeout: Timeout) -> float | None:
    """``timeout`` in seconds, for the core (which refuses one that is not positive)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, a datetime.timedelta or None, "
                        f"got {type(timeout).__name__}")
    return float(timeout)


def _non_member(group: Any) -> bool:
    """Whether ``group`` is what torch's new_group gives a rank outside the group (an int)."""
    return (type(group) is int  # noqa: E721 (not a bool)
            and group == dist.GroupMember.NON_GROUP_MEMBER)


def _resolve(peer: int | None, group: Any, group_peer: int | None):
    """(group, group_peer) for the core; a global peer alone is mapped as torch maps it."""
    if peer is None or group_peer is not None or _non_member(group):
        # No peer, a group peer (with or without a global one), or a non-member's handle: the
        # core validates (and refuses the last, naming the call).
        return peer, group, group_peer
    pg = _c10d._group_or_default_group(group)
    return None, pg, dist.get_group_rank(pg, peer)


def _mapped(peer, group_peer, group):
    return peer is not None and group_peer is None and not _non_member(group)


def _is_pipe(obj: Any) -> bool:
    """Whether ``obj`` is a TensorDictPipe: its class says so with ``_tensordict_pipe = True``
    (the pipe module is above this one, so it cannot be imported here for an isinstance)."""
    return getattr(type(obj), "_tensordict_pipe", False) is True


def _pipe_peer(peer: Any, group_peer: int | None, name: str) -> Any:
    """``peer`` when it is a TensorDictPipe (then no group peer is allowed), else None."""
    if peer is None or isinstance(peer, int) or not _is_pipe(peer):
        return None
    if group_peer is not None:
        raise ValueError(f"`group_{name}` cannot be used when `{name}` is a TensorDictPipe.")
    return peer


def _receiver(self: Any, plain: Any, rows: Any) -> tuple:
    """(the core's call, its target) for a receive into ``self``: a TensorDict's ``_cpp``, or
    the rows of a ``_SubTensorDict`` (its ``_rows``), which have calls of their own."""
    target = getattr(self, "_rows", None)
    return (rows, target) if target is not None else (plain, self._cpp)


def send(self, dst: Any = None, *, group: Any = None, group_dst: int | None = None,
         init_tag: int = 0, pseudo_rand: bool = False, consolidated: bool = False,
         checked: bool = False, timeout: Timeout = None) -> None:
    """Sends the leaves of the TensorDict to another rank, with :mod:`torch.distributed`.

    The receiver calls :meth:`recv` on a TensorDict with the same keys, shapes and dtypes; the
    values are written into its tensors. By default each leaf is one message, tagged, and the
    leaves go in the order of the keys sorted by code point at each level, depth first: the
    wire format of the reference ``tensordict``, so either side may run the reference.
    Non-tensor entries are skipped without taking a tag, as the reference skips them: the
    receiver keeps its own. Blocks until every message is delivered (with Gloo: taken by the
    receiver). The GIL is released while waiting.

    Args:
        dst (int or TensorDictPipe, optional): the receiver's global rank. It is translated
            into a rank of ``group`` as ``torch.distributed.send`` translates it, and must not
            be this process's rank. Exclusive with ``group_dst``: give exactly one of them. A
            :class:`~tensordict_cpp.TensorDictPipe` sends through it instead
            (``dst.send(self)``), and the other arguments are ignored. Defaults to ``None``.

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group to send through.
            Defaults to ``None``: the default process group.
        group_dst (int, optional): the receiver's rank within ``group``, which must then be
            given. Exclusive with ``dst``. The messages go straight to ``group``'s backend, so
            ``group`` may be a standalone group built on a store (for example a
            ``torch.distributed.ProcessGroupGloo``) that was never registered with
            ``init_process_group`` or ``new_group``. Defaults to ``None``.
        init_tag (int, optional): the tag of the first leaf; the following leaves take
            ``init_tag + 1``, ``init_tag + 2``, ... The receiver passes the same value. Two
            transfers in flight at once between the same ranks need tag ranges that do not
            overlap. Defaults to ``0``.
        pseudo_rand (bool, optional): if ``True``, the tags are the reference's pseudo-random
            sequence seeded by ``init_tag`` instead, so that transfers from several ranks are
            unlikely to collide. The receiver passes the same value. Defaults to ``False``.
        consolidated (bool, optional): if ``True``, sends every leaf in one message: the
            consolidated storage (see :meth:`consolidate`), consolidating a copy first unless
            the TensorDict is consolidated already. The receiver calls
            ``recv(consolidated=True)`` on a consolidated TensorDict of the same structure.
            ``init_tag`` and ``pseudo_rand`` are then ignored. Defaults to ``False``.
        %(checked)s
        %(timeout)s

    Raises:
        ValueError: if both or neither of ``dst`` and ``group_dst`` are given, if
            ``group_dst`` is given without ``group``, if ``dst`` is this rank or not in
            ``group``, or if ``init_tag`` is negative; if ``group_dst`` is given with a pipe.
        RuntimeError: if the transport fails or a timeout (``timeout``, else the group's) passes
            (``torch.distributed.DistBackendError`` for backend failures).
    """
    pipe = _pipe_peer(dst, group_dst, "dst")
    if pipe is not None:
        pipe.send(self)
        return None
    mapped = _mapped(dst, group_dst, group)
    dst, group, group_dst = _resolve(dst, group, group_dst)
    if mapped:
        # torch.distributed.send refuses to send to oneself.
        _c10d._check_not_self_rank(group, group_dst, "destination")
    _C.send(self._cpp, dst, group=group, group_dst=group_dst, init_tag=init_tag,
            pseudo_rand=pseudo_rand, consolidated=consolidated, checked=checked,
            timeout=_seconds(timeout))


def recv(self, src: Any = None, *, group: Any = None, group_src: int | None = None,
         init_tag: int = 0, pseudo_rand: bool = False, consolidated: bool = False,
         checked: bool = False, timeout: Timeout = None, late: str = "deliver") -> Any:
    """Receives what :meth:`send` or :meth:`isend` sends, writing it into this TensorDict's
    tensors in place.

    The TensorDict must already have the sender's keys, shapes and dtypes: no structure travels
    with per-leaf messages. Blocks until every leaf has arrived; the GIL is released while
    waiting. See :meth:`send` for the wire format.

    Args:
        src (int or TensorDictPipe, optional): the sender's global rank, translated into a
            rank of ``group`` as ``torch.distributed.recv`` translates it. Exclusive with
            ``group_src``: give exactly one of them. A :class:`~tensordict_cpp.TensorDictPipe`
            receives from it instead and RETURNS the received TensorDict
            (``src.recv(self)``: this TensorDict is filled only if it is consolidated with the
            sender's layout); the other arguments are ignored. Defaults to ``None``.

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group to receive
            through. Defaults to ``None``: the default process group.
        group_src (int, optional): the sender's rank within ``group``, which must then be
            given. Exclusive with ``src``. As with :meth:`send`, ``group`` may be a standalone
            group built on a store. Defaults to ``None``.
        init_tag (int, optional): the ``init_tag`` the sender used. Defaults to ``0``.
        pseudo_rand (bool, optional): the ``pseudo_rand`` the sender used. Defaults to
            ``False``.
        consolidated (bool, optional): if ``True``, receives one message into the consolidated
            storage of this TensorDict, which must be consolidated (see :meth:`consolidate`)
            with the sender's layout; this updates every leaf. ``init_tag`` and
            ``pseudo_rand`` are ignored. Defaults to ``False``.
        %(checked)s
        %(timeout)s
        %(late)s

    Returns:
        The tag of the last leaf received (``init_tag - 1`` without leaves), or ``None`` with
        ``consolidated=True``; from a pipe, the received TensorDict.

    Raises:
        ValueError: if both or neither of ``src`` and ``group_src`` are given, if
            ``group_src`` is given without ``group``, if ``src`` is not in ``group``, or with
            ``consolidated=True`` on a TensorDict that is not consolidated; if ``group_src``
            is given with a pipe.
        RuntimeError: if the transport fails or a timeout (``timeout``, else the group's) passes.
    """
    _late(late)
    pipe = _pipe_peer(src, group_src, "src")
    if pipe is not None:
        return pipe.recv(self)
    mapped = _mapped(src, group_src, group)
    src, group, group_src = _resolve(src, group, group_src)
    if mapped:
        # torch.distributed.recv refuses to receive from oneself (Gloo has no pair to itself).
        _c10d._check_not_self_rank(group, group_src, "source")
    call, target = _receiver(self, _C.recv, _C.recv_rows)
    return call(target, src, group=group, group_src=group_src, init_tag=init_tag,
                pseudo_rand=pseudo_rand, consolidated=consolidated, checked=checked,
                timeout=_seconds(timeout), late=late)


def isend(self, dst: int | None = None, *, group: Any = None, group_dst: int | None = None,
          init_tag: int = 0, pseudo_rand: bool = False, return_early: bool = False,
          consolidated: bool = False, checked: bool = False,
          timeout: Timeout = None) -> int | list | None:
    """Sends the leaves to another rank with every message in flight at once.

    Same messages as :meth:`send` (the receiver may call :meth:`irecv` or :meth:`recv`), but all
    of them are posted before any is waited on. By default the call then waits for them, with
    the GIL released; with ``return_early=True`` it returns their ``Work`` handles at once.
    Unlike :meth:`send`, ``dst`` may be this process's own rank.

    Args:
        dst (int, optional): the receiver's global rank, translated into a rank of ``group``
            as ``torch.distributed.isend`` translates it. Exclusive with ``group_dst``: give
            exactly one of them. Defaults to ``None``.

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        group_dst (int, optional): the receiver's rank within ``group``, which must then be
            given; ``group`` may be a standalone group. Exclusive with ``dst``. Defaults to
            ``None``.
        init_tag (int, optional): the tag of the first leaf, as in :meth:`send`. Defaults to
            ``0``.
        pseudo_rand (bool, optional): pseudo-random tags seeded by ``init_tag``, as in
            :meth:`send`. Defaults to ``False``.
        return_early (bool, optional): if ``True``, returns the list of
            ``torch.distributed.Work`` handles (one per leaf in wire order, or one for a
            consolidated message) without waiting. Call ``wait()`` on each before changing or
            freeing the TensorDict. Defaults to ``False``.
        consolidated (bool, optional): if ``True``, one message carrying the consolidated
            storage, as ``send(consolidated=True)``; a TensorDict that is not consolidated is
            consolidated (copied) on every call. Defaults to ``False``.
        %(checked)s
        %(timeout)s

    Returns:
        With ``return_early=True``, the list of ``Work`` handles. Otherwise the tag of the last
        leaf sent, or ``None`` with ``consolidated=True``.

    Raises:
        ValueError: if both or neither of ``dst`` and ``group_dst`` are given, or ``group_dst``
            is given without ``group``, or ``dst`` is not in ``group``.
        RuntimeError: if the transport fails (when waiting: here, or in ``Work.wait()``).
    """
    dst, group, group_dst = _resolve(dst, group, group_dst)
    call = _C.isend_early if return_early else _C.isend
    return call(self._cpp, dst, group=group, group_dst=group_dst, init_tag=init_tag,
                pseudo_rand=pseudo_rand, consolidated=consolidated, checked=checked,
                timeout=_seconds(timeout))


def irecv(self, src: int | None = None, *, group: Any = None, group_src: int | None = None,
          return_premature: bool = False, init_tag: int = 0, pseudo_rand: bool = False,
          consolidated: bool = False, checked: bool = False,
          timeout: Timeout = None, late: str = "deliver") -> list | None:
    """Receives the leaves with every receive posted at once, into this TensorDict in place.

    Takes what :meth:`isend` or :meth:`send` sends. By default the call waits until everything
    has arrived, with the GIL released; with ``return_premature=True`` it returns the ``Work``
    handles at once.

    Args:
        src (int, optional): the sender's global rank, translated into a rank of ``group`` as
            ``torch.distributed.irecv`` translates it. Exclusive with ``group_src``: give
            exactly one of them. Defaults to ``None``.

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        group_src (int, optional): the sender's rank within ``group``, which must then be
            given; ``group`` may be a standalone group. Exclusive with ``src``. Defaults to
            ``None``.
        return_premature (bool, optional): if ``True``, returns the list of
            ``torch.distributed.Work`` handles (one per leaf in wire order, or one for a
            consolidated message) without waiting. The leaves hold the received values only
            after each handle's ``wait()`` has returned: do not read or write them before.
            Defaults to ``False``.
        init_tag (int, optional): the ``init_tag`` the sender used. Defaults to ``0``.
        pseudo_rand (bool, optional): the ``pseudo_rand`` the sender used. Defaults to
            ``False``.
        consolidated (bool, optional): if ``True``, one message into the consolidated storage,
            as ``recv(consolidated=True)``; the TensorDict must be consolidated. Defaults to
            ``False``.
        %(checked)s
        %(timeout)s
        %(late)s

    Returns:
        With ``return_premature=True``, the list of ``Work`` handles; otherwise ``None``.

    Raises:
        ValueError: if both or neither of ``src`` and ``group_src`` are given, or
            ``group_src`` is given without ``group``, or ``src`` is not in ``group``.
        RuntimeError: if the transport fails (when waiting: here, or in ``Work.wait()``).
    """
    _late(late)
    call, target = _receiver(self, _C.irecv_premature if return_premature else _C.irecv,
                             _C.irecv_rows)
    if return_premature and call is _C.irecv_rows:
        if not target.is_view:
            raise ValueError("irecv(return_premature=True) into a _SubTensorDict with an index "
                             "tensor or mask: its rows are written back when the receives "
                             "complete; use irecv() or recv()")
        # Basic indices: the view's leaves are the parent's storage, the Works land there.
        call, target = _C.irecv_premature, target.view()
    src, group, group_src = _resolve(src, group, group_src)
    works = call(target, src, group=group, group_src=group_src, init_tag=init_tag,
                 pseudo_rand=pseudo_rand, consolidated=consolidated, checked=checked,
                 timeout=_seconds(timeout), late=late)
    return works if return_premature else None


async def asend(self, dst: Any) -> None:
    """Sends the TensorDict through a :class:`~tensordict_cpp.TensorDictPipe`:
    ``await dst.asend(self)``.

    Raises:
        TypeError: if ``dst`` is not a TensorDictPipe.
    """
    if not _is_pipe(dst):
        raise TypeError(f"asend: dst must be a TensorDictPipe, got {type(dst)}")
    await dst.asend(self)


async def arecv(self, src: Any, *, device: Any = None) -> Any:
    """Receives from a :class:`~tensordict_cpp.TensorDictPipe` and RETURNS the received
    TensorDict: ``await src.arecv(self, device=device)``. This TensorDict is filled only if it
    is consolidated with the sender's layout; use the return value.

    Raises:
        TypeError: if ``src`` is not a TensorDictPipe.
    """
    if not _is_pipe(src):
        raise TypeError(f"arecv: src must be a TensorDictPipe, got {type(src)}")
    return await src.arecv(self, device=device)


for _f in (send, recv, isend, irecv):
    _f.__doc__ = _f.__doc__ % _DOCS
del _f
