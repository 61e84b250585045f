"""init_remote / from_remote_init and the collectives of tensordict_cpp.TensorDict (bound as
its methods).

The work runs in C++ with the GIL released. As in ``_p2p``, global ranks are turned into ranks
of the group here, by torch.distributed itself, and ``group=None`` becomes torch's default
group: the groups of a Python program live in torch.distributed's Python registry. The C++
side therefore always receives a group and, where a peer is named, its rank in that group.

A layer below ``_td``, as ``_p2p``: the functions take the TensorDict as ``self`` (or its class
as ``cls``) and use only its ``_cpp`` and ``_wrap``, so this module imports nothing of the
package but ``_C`` and ``_p2p``. A sender's tensorclass name is resolved by the function that
the tensorclass layer (above) registers with :func:`_set_tensorclass_resolver` when it is
imported, which the package's ``__init__`` always does.

Metadata travels as pickles in torch's object-collective framing, byte-compatible with the
reference ``tensordict``; our C++ code writes and reads them (a restricted reader that never
imports or calls anything): Python's ``pickle`` never sees bytes from a peer.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from tensordict_cpp import _C
from tensordict_cpp._p2p import Timeout, _late, _seconds


def _group(group: Any) -> Any:
    return _c10d._group_or_default_group(group)


def _group_rank(group: Any, rank: int) -> int:
    """``rank``, a global rank, as a rank of ``group`` (ValueError if it is not a member)."""
    return dist.get_group_rank(group, rank)


def _op(op: Any) -> dist.ReduceOp:
    # ReduceOp.SUM and friends are RedOpType values (isinstance() of ReduceOp says True
    # through a metaclass): the binding takes a real ReduceOp.
    if op is None:
        op = dist.ReduceOp.SUM
    return dist.ReduceOp(op) if isinstance(op, dist.ReduceOp.RedOpType) else op


def _bucket_bytes(bucket_bytes: Any) -> int | None:
    """bucket_bytes as the core takes it (a float is rounded down, as the reference compares
    sizes with it)."""
    if bucket_bytes is None:
        return None
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, float)):
        raise TypeError(f"bucket_bytes must be a number of bytes, got "
                        f"{type(bucket_bytes).__name__}")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {bucket_bytes}.")
    return int(bucket_bytes) or 1


def _flag(name: str, value: Any) -> bool:
    """A bool keyword of ours, refused when it is anything else (TypeError naming it)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _cpp_of(td: Any) -> Any:
    """The ``_C.TensorDict`` behind a tensordict_cpp.TensorDict (its ``_cpp``); TypeError for
    anything else."""
    cpp = getattr(td, "_cpp", None)
    if not isinstance(cpp, _C.TensorDict):
        raise TypeError(f"expected a TensorDict, got {type(td)}")
    return cpp


#: ``resolver(type_str, allow_import)``: the tensorclass a sender names (set by tensorclass).
_tensorclass_resolver: Callable[[str, bool], Any] | None = None


def _set_tensorclass_resolver(resolver: Callable[[str, bool], Any]) -> None:
    """Called by ``tensordict_cpp.tensorclass`` with its ``_resolve_tensorclass_type``."""
    global _tensorclass_resolver
    _tensorclass_resolver = resolver


def _typed(wrap: Any, received: tuple, allow_import: bool):
    """The received TensorDict (``wrap(cpp)``), as the tensorclass the sender named if any.

    The name is looked up among the tensordict_cpp tensorclasses of this process; a module is
    imported only with ``allow_import=True`` (see ``tensorclass._resolve_tensorclass_type``).
    """
    cpp, type_str = received
    td = wrap(cpp)
    if type_str is None:
        return td
    if _tensorclass_resolver is None:  # only when tensordict_cpp.tensorclass was never imported
        raise ValueError(f"the sender's tensorclass {type_str!r} cannot be resolved: "
                         "import tensordict_cpp first")
    return _tensorclass_resolver(type_str, allow_import).from_tensordict(td)


def init_remote(self, dst: int | None = None, group: Any = None, device: Any = None,
                use_broadcast: bool = False, _tensorclass_type: str | None = None, *,
                timeout: Timeout = None) -> None:
    """Sends this TensorDict, structure and values, to a rank that does not know it.

    The receiver calls :meth:`from_remote_init`, which returns a consolidated TensorDict; later
    values then go with ``send(dst, consolidated=True)`` into that TensorDict, which copies
    nothing and allocates nothing on the receiver. The TensorDict is consolidated first (a
    copy) unless it is consolidated already. The wire format is the reference ``tensordict``'s
    (a pickled metadata dict in ``send_object_list`` framing, then the storage), so either side
    may run the reference. This TensorDict's metadata is never modified.

    Args:
        dst (int, optional): the receiver's global rank; must not be this rank. Required
            unless ``use_broadcast=True``, which ignores it. Defaults to ``None``.
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        device (torch.device, str or int, optional): point-to-point, the device of the two
            framing messages, as ``send_object_list``'s ``device``. With
            ``use_broadcast=True``, the storage's device if the TensorDict must be
            consolidated. Defaults to ``None``.
        use_broadcast (bool, optional): if ``True``, broadcasts to every rank of the group
            (see :meth:`broadcast`); the others call ``from_remote_init(src=...,
            use_broadcast=True)``. Defaults to ``False``.
        _tensorclass_type (str, optional): a tensorclass's ``"<module>.<qualname>"``, sent as
            the metadata's ``"_tensorclass_type"`` (tensorclasses pass their own). Defaults to
            ``None``.

    Keyword Args:
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together; on expiry, ``DistBackendError`` naming the
            call, the peer, what was in flight and the time waited. Defaults to ``None``:
            each wait runs under the group's own timeout.

    Raises:
        ValueError: if ``dst`` is missing, this rank, or not in ``group``.
        RuntimeError: if the transport fails or a timeout (``timeout``, else the group's) passes.
    """
    pg = _group(group)
    group_dst = None
    if not use_broadcast:
        if dst is None:
            raise ValueError("init_remote: `dst` is required unless use_broadcast=True")
        group_dst = _group_rank(pg, dst)
        _c10d._check_not_self_rank(pg, group_dst, "destination")
    _C.init_remote(self._cpp, group_dst=group_dst, group=pg, device=device,
                   use_broadcast=use_broadcast, _tensorclass_type=_tensorclass_type,
                   timeout=_seconds(timeout))


@classmethod
def from_remote_init(cls, src: int, group: Any = None, device: Any = None,
                     use_broadcast: bool = False, *, max_total_bytes: int | None = None,
                     allow_import: bool = False, timeout: Timeout = None,
                     late: str = "deliver"):
    """Receives what :meth:`init_remote` sends and returns it as a new consolidated
    TensorDict.

    Receive later values into the result with ``recv(src, consolidated=True)``: they land in
    the same storage. The sender's metadata is read by a restricted reader that accepts only
    dicts, lists, tuples, str, int, float, bool and None, within bounds: nothing a peer sends
    is imported or executed. When the sender was a tensorclass, the result is the tensorclass
    of the same ``"<module>.<qualname>"`` among the ``tensordict_cpp`` tensorclasses defined in
    this process (the reference imports the module the sender names; here that takes
    ``allow_import=True``).

    Args:
        src (int): the sender's global rank.
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        device (torch.device, str or int, optional): the device of the result (and,
            point-to-point, of the framing messages). Defaults to ``None``: the CPU
            point-to-point; with ``use_broadcast=True``, the sender's storage device if this
            process has it.
        use_broadcast (bool, optional): must match the sender's. Defaults to ``False``.

    Keyword Args:
        max_total_bytes (int, optional): the largest storage the sender may announce.
            Defaults to ``None``: half of this machine's
            physical memory.
        allow_import (bool, optional): if ``True``, a tensorclass name that no tensorclass of
            this process has is imported (its module, then the class, which must be a
            ``tensordict_cpp`` tensorclass). Defaults to ``False``: an unknown name is an error.
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together; on expiry,
            :class:`~tensordict_cpp.errors.TimeoutError` naming the call, the peer, what was in
            flight and the time waited. Point-to-point, the group stays usable and the late
            transfer is kept for the next ``from_remote_init`` from that peer (see ``late``);
            with ``use_broadcast=True`` Gloo closes the group's connections (a broadcast cannot
            be aborted). Defaults to ``None``: each wait runs under the group's own timeout.
        late (str, optional): point-to-point, what this call does with a transfer from
            ``src`` that an earlier call gave up on: ``"deliver"`` returns it, ``"drop"``
            receives it, drops it and waits for the next. Defaults to ``"deliver"``.

    Raises:
        ValueError: for malformed metadata (a pickle outside the accepted subset, truncated,
            beyond the bounds, or whose layout does not fit the announced size), or a
            tensorclass name that is not known here.
        RuntimeError: if the transport fails or a timeout (``timeout``, else the group's) passes.
    """
    _late(late)
    pg = _group(group)
    group_src = _group_rank(pg, src)
    if not use_broadcast:
        _c10d._check_not_self_rank(pg, group_src, "source")
    received = _C.from_remote_init(group_src, group=pg, device=device,
                                   use_broadcast=use_broadcast,
                                   max_total_bytes=max_total_bytes, timeout=_seconds(timeout),
                                   late=late)
    return _typed(cls._wrap, received, allow_import)


def broadcast(self, src: int, *, group: Any = None, device: Any = None,
              max_total_bytes: int | None = None, _tensorclass_type: str | None = None,
              allow_import: bool = False, timeout: Timeout = None):
    """Sends the TensorDict of rank ``src`` to every rank of the group and returns it on each.

    Every rank of the group calls it; the others may pass any TensorDict (an empty one), which
    is not used. The source consolidates its TensorDict (unless it is consolidated already)
    and broadcasts its metadata, pickled in ``broadcast_object_list`` framing, then its
    storage: the reference ``tensordict``'s wire format. Use the returned TensorDict.

    Args:
        src (int): the source's global rank (translated into a rank of ``group``).

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        device (torch.device, str or int, optional): on the source, the storage's device if
            it must consolidate; elsewhere, the result's device. Defaults to ``None``: the
            source's storage device, if this process has it (RuntimeError otherwise).
        max_total_bytes (int, optional): receivers: the largest storage the source may
            announce. Defaults to ``None``: half of this machine's
            physical memory.
        _tensorclass_type (str, optional): on the source, a tensorclass's
            ``"<module>.<qualname>"``, sent as ``"_tensorclass_type"``. Defaults to ``None``.
        allow_import (bool, optional): receivers: as in :meth:`from_remote_init`. Defaults to
            ``False``.
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together; on expiry, ``DistBackendError`` naming the
            call, the peer, what was in flight and the time waited. Defaults to ``None``:
            each wait runs under the group's own timeout.

    Returns:
        A consolidated TensorDict: on the source, this one if it was consolidated, else a
        consolidated copy; elsewhere a new one, or the tensorclass the source named.

    Raises:
        ValueError: on receivers, for a tensorclass name that is not known here.
    """
    pg = _group(group)
    cpp, type_str = _C.broadcast(self._cpp, _group_rank(pg, src), group=pg, device=device,
                                 max_total_bytes=max_total_bytes,
                                 _tensorclass_type=_tensorclass_type, timeout=_seconds(timeout))
    if pg.rank() == _group_rank(pg, src):
        return self._wrap(cpp)  # the source: a tensorclass wraps its own result
    return _typed(self._wrap, (cpp, type_str), allow_import)


def all_gather(self, *, group: Any = None, max_total_bytes: int | None = None,
               timeout: Timeout = None) -> list:
    """Returns the TensorDict of every rank of the group, on every rank, in rank order.

    Every rank of the group calls it; the structures may differ between ranks. Each rank's
    TensorDict is consolidated (unless it is already); the metadata goes with
    ``all_gather_object`` framing, the storages zero-padded to the largest.

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        max_total_bytes (int, optional): the largest storage any rank may announce. Defaults
            to ``None``: half of this machine's physical memory.
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together; on expiry, ``DistBackendError`` naming the
            call, the peer, what was in flight and the time waited. Defaults to ``None``:
            each wait runs under the group's own timeout.

    Returns:
        A list of new consolidated TensorDicts, one per rank of the group (this one's too).
    """
    return [self._wrap(t) for t in _C.all_gather(self._cpp, group=_group(group),
                                                 max_total_bytes=max_total_bytes,
                                                 timeout=_seconds(timeout))]


def scatter(self, src: int, tensordicts: Sequence | None = None, *, group: Any = None,
            device: Any = None, max_total_bytes: int | None = None, timeout: Timeout = None):
    """Sends ``tensordicts[i]`` from rank ``src`` to the rank of index ``i`` in the group,
    and returns the one this rank receives.

    Every rank of the group calls it; the TensorDict it is called on is not used. The
    structures may differ per rank. Wire format: ``scatter_object_list`` for the metadata,
    then a scatter of the storages zero-padded to the largest, as the reference does.

    Args:
        src (int): the source's global rank (translated into a rank of ``group``).
        tensordicts (list of TensorDict, optional): on the source, one TensorDict per rank of
            the group; ignored elsewhere. Defaults to ``None``.

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        device (torch.device, str or int, optional): receivers: the result's device. Defaults
            to ``None``: the source's storage device, if this process has it.
        max_total_bytes (int, optional): receivers: the largest (padded) storage the source
            may announce. Defaults to ``None``: half of this machine's
            physical memory.
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together; on expiry, ``DistBackendError`` naming the
            call, the peer, what was in flight and the time waited. Defaults to ``None``:
            each wait runs under the group's own timeout.

    Returns:
        A new consolidated TensorDict.

    Raises:
        ValueError: on the source, if ``tensordicts`` is missing or does not hold one
            TensorDict per rank.
    """
    pg = _group(group)
    group_src = _group_rank(pg, src)
    tds = []
    if pg.rank() == group_src:
        if tensordicts is None:
            raise ValueError("scatter: the source rank must pass `tensordicts`")
        tds = [_cpp_of(td) for td in tensordicts]
    return self._wrap(_C.scatter(group_src, tds, group=pg, device=device,
                                 max_total_bytes=max_total_bytes, timeout=_seconds(timeout)))


def gather_and_stack(self, dst: int, group: Any = None, *, max_total_bytes: int | None = None,
                     timeout: Timeout = None):
    """Gathers every other rank's TensorDict on rank ``dst`` and writes them, stacked in rank
    order, into the rows of this TensorDict there.

    Every rank of the group calls it. On ``dst`` the first batch dimension of this TensorDict
    is the group's size - 1 (one row per other rank, in rank order), and it is updated in
    place; elsewhere it is sent, consolidated. Wire format: the reference's on Gloo (an
    all_gather of small headers, then a gather of each storage and its metadata, padded to the
    largest). A reference peer that could not consolidate sends a pickled TensorDict, which is
    refused, never unpickled.

    Args:
        dst (int): the destination's global rank (translated into a rank of ``group``).
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.

    Keyword Args:
        max_total_bytes (int, optional): the largest storage a rank may announce, checked on
            every rank before anything is allocated. Defaults to ``None``: half of this
            machine's physical memory.
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together. Defaults to ``None``: the group's own timeout.

    Returns:
        This TensorDict on ``dst``, ``None`` elsewhere.

    Raises:
        ValueError: on ``dst``, when a received leaf does not fit this TensorDict's rows
            (naming the key); on every rank, for a header outside the bounds.
    """
    pg = _group(group)
    out = _C.gather_and_stack(_cpp_of(self), _group_rank(pg, dst), group=pg,
                              max_total_bytes=max_total_bytes, timeout=_seconds(timeout))
    return None if out is None else self


def all_reduce(self, op: Any = None, *, group: Any = None, async_op: bool = False,
               bucket_bytes: int | None = None, check_buckets: bool = False,
               timeout: Timeout = None) -> list | None:
    """Reduces every leaf in place over the group, so that every rank holds the result.

    One ``torch.distributed.all_reduce`` per leaf, in insertion order (depth first): every rank
    must hold the same keys, inserted in the same order, with the same shapes and dtypes.

    Args:
        op (torch.distributed.ReduceOp, optional): the reduction. Defaults to ``None``: SUM.

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.
        async_op (bool, optional): if ``True``, returns the ``Work`` of each leaf without
            waiting; call ``wait()`` on each before using the TensorDict. Defaults to
            ``False``.
        bucket_bytes (int, optional): pack the leaves into flat buckets of at most this many
            bytes and reduce one bucket per collective, as the reference does: each leaf that
            is not contiguous alone first, then the others grouped by device and dtype (groups
            in order of first appearance), packed in leaf order; a larger leaf alone. Many
            small leaves then cost a few collectives instead of one each. Every rank must pass
            the same value: ranks whose buckets differ post collectives of different sizes, and
            Gloo aborts a rank that receives more bytes than it posted for (SIGABRT, "Received
            data size doesn't match expected size"), whose peers then raise ``PeerLostError``;
            as with the reference. ValueError when not positive. Defaults to ``None``: one
            collective per leaf.
        check_buckets (bool, optional): ours, off the reference's wire: first all-gather a hash
            of each rank's bucket layout and raise ``ValueError`` naming ``bucket_bytes`` on
            every rank when they differ, instead of the abort. One small collective more; every
            rank of the group must pass it (a reference rank cannot). Defaults to ``False``.
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together; on expiry, ``DistBackendError`` naming the
            call, the peer, what was in flight and the time waited. Defaults to ``None``:
            each wait runs under the group's own timeout.

    Returns:
        With ``async_op=True``, the list of ``Work`` objects (one per leaf, or per bucket: a
        bucket's ``wait()`` also writes its values back into the leaves; a lost peer raises
        ``PeerLostError`` there, a timeout ``TimeoutError``); otherwise ``None``.
    """
    return _C.all_reduce(self._cpp, _op(op), async_op=async_op, group=_group(group),
                         timeout=_seconds(timeout), bucket_bytes=_bucket_bytes(bucket_bytes),
                         check_buckets=_flag("check_buckets", check_buckets))


def reduce(self, dst: int, op: Any = None, async_op: bool = False,
           return_premature: bool = False, group: Any = None, *,
           bucket_bytes: int | None = None, check_buckets: bool = False,
           timeout: Timeout = None) -> list | None:
    """Reduces every leaf over the group into rank ``dst``, in place.

    One ``torch.distributed.reduce`` per leaf, keys sorted by code point at each level, depth
    first, on ``group`` at every level. Afterwards rank ``dst`` holds the result; the other
    ranks' values are undefined (Gloo leaves partial results).

    Args:
        dst (int): the global rank that receives the result (translated into a rank of
            ``group``).
        op (torch.distributed.ReduceOp, optional): the reduction. Defaults to ``None``: SUM.
        async_op (bool, optional): if ``True``, every leaf's reduction is posted before any is
            waited on. Defaults to ``False``.
        return_premature (bool, optional): with ``async_op=True``, returns the ``Work`` objects
            without waiting; call ``wait()`` on each before using the TensorDict. Defaults to
            ``False``.
        group (torch.distributed.ProcessGroup, optional): the process group. Defaults to
            ``None``: the default process group.

    Keyword Args:
        bucket_bytes (int, optional): as for :meth:`all_reduce`, in reduce's leaf order; only
            rank ``dst`` takes a bucket's values back into its leaves. Defaults to ``None``.
        check_buckets (bool, optional): as for :meth:`all_reduce`. Defaults to ``False``.
        timeout (float or datetime.timedelta, optional): the longest the call may wait for
            its messages, all of them together; on expiry, ``DistBackendError`` naming the
            call, the peer, what was in flight and the time waited. Defaults to ``None``:
            each wait runs under the group's own timeout.

    Returns:
        The list of ``Work`` objects (per leaf, or per bucket) with ``async_op=True`` and
        ``return_premature=True``; otherwise ``None``.
    """
    pg = _group(group)
    return _C.reduce(self._cpp, _group_rank(pg, dst), _op(op), async_op=async_op,
                     return_premature=return_premature, group=pg, timeout=_seconds(timeout),
                     bucket_bytes=_bucket_bytes(bucket_bytes),
                     check_buckets=_flag("check_buckets", check_buckets))
