"""Timeouts that keep the group, from Python, with the reference tensordict on the other rank
(docs/reliability.md, "Timeouts"): a receive whose timeout passes raises our TimeoutError,
leaves its TensorDict unchanged and never writes it afterwards; the late message goes to the
next receive from that peer (late="deliver") or is dropped (late="drop"); a send that timed out
stays queued; the group's other calls go on. Readiness travels on a tag of its own, so that no
step depends on timing."""

import pytest
import torch
import torch.distributed as dist

import conftest
from tensordict_cpp.distributed import run

REF, OURS = 0, 1  # rank 0 runs the reference tensordict, rank 1 ours


def build(cls, fill):
    td = cls({"b": torch.full((3, 2), fill), "a": torch.full((3,), fill),
              "B": torch.full((3, 4), fill, dtype=torch.float64)}, batch_size=[3])
    td["c", "z"] = torch.full((3, 5), fill, dtype=torch.int32)
    return td


def filled_with(td, fill):
    return all((leaf == fill).all() for leaf in td.values(include_nested=True, leaves_only=True))


ready, await_ready = conftest.ready, conftest.await_ready


def receives_after_timeouts(rank, world_size):
    torch.set_num_threads(1)
    from tensordict_cpp import errors
    if rank == REF:
        from tensordict import TensorDict
    else:
        from tensordict_cpp import TensorDict
    for kw in ({}, {"consolidated": True}):
        if rank == OURS:
            td = build(TensorDict, -1)
            if kw:
                td = td.consolidate()
            kept = td["b"]
            for _ in range(3):
                with pytest.raises(errors.TimeoutError, match="The group stays usable"):
                    td.recv(src=REF, timeout=0.3, **kw)
                assert filled_with(td, -1)
            ready(REF)
            for fill in range(1, 6):  # the first lands in the late receive, then in order
                td.recv(src=REF, timeout=20, **kw)
                assert filled_with(td, fill), (kw, fill, td["a"])
            assert td["b"] is kept or td["b"].data_ptr() == kept.data_ptr()
            # late="drop": the late transfer is received and dropped.
            with pytest.raises(errors.TimeoutError):
                td.recv(src=REF, timeout=0.3, **kw)
            ready(REF)
            td.recv(src=REF, timeout=20, late="drop", **kw)
            assert filled_with(td, 7), (kw, td["a"])
        else:
            await_ready(OURS)
            for fill in range(1, 6):
                build(TensorDict, fill).send(dst=OURS, **kw)
            await_ready(OURS)
            for fill in (6, 7):
                build(TensorDict, fill).send(dst=OURS, **kw)
    # A send of ours that timed out stays queued: the reference receives it later.
    if rank == OURS:
        with pytest.raises(errors.TimeoutError, match="the send stays queued"):
            build(TensorDict, 8).send(dst=REF, timeout=0.3)
        ready(REF)
    else:
        await_ready(OURS)
        td = build(TensorDict, 0)
        td.recv(src=OURS)
        assert filled_with(td, 8)
    # from_remote_init after a timed-out one gets the reference's init_remote.
    if rank == OURS:
        with pytest.raises(errors.TimeoutError):
            TensorDict.from_remote_init(src=REF, timeout=0.3)
        ready(REF)
        got = TensorDict.from_remote_init(src=REF, timeout=20)
        assert filled_with(got, 9)
    else:
        await_ready(OURS)
        build(TensorDict, 9).init_remote(dst=OURS)
    # The group lives: a collective and a plain transfer both ways.
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    if rank == REF:
        build(TensorDict, 10).send(dst=OURS)
    else:
        td = build(TensorDict, 0)
        td.recv(src=REF, timeout=20)
        assert filled_with(td, 10)
    dist.barrier()


def test_timeouts_keep_the_group_with_the_reference_on_the_other_rank():
    run(receives_after_timeouts, world_size=2, timeout=120, group_timeout=20)


def test_late_must_be_deliver_or_drop():
    from tensordict_cpp import TensorDict
    td = TensorDict(a=torch.zeros(2), batch_size=[2])
    with pytest.raises(ValueError, match='late must be "deliver" or "drop", got "later"'):
        td.recv(src=1, group=None, late="later")


def hundred_timeouts(rank, world_size):
    torch.set_num_threads(1)
    from tensordict_cpp import TensorDict, errors
    for kw in ({}, {"consolidated": True}):
        if rank == 1:
            td = build(TensorDict, -1)
            if kw:
                td = td.consolidate()
            timeouts = 0
            for _ in range(100):
                try:
                    td.recv(src=0, timeout=0.01, **kw)
                except errors.TimeoutError:
                    timeouts += 1
            assert timeouts == 100 and filled_with(td, -1)
            ready(0)
            ok = 0
            for fill in range(1, 101):
                td.recv(src=0, timeout=20, **kw)
                ok += filled_with(td, fill)
            assert ok == 100, (kw, ok)
        elif rank == 0:
            await_ready(1)
            for fill in range(1, 101):
                build(TensorDict, fill).send(dst=1, **kw)
    # The group's other pairs.
    for src, dst in ((0, 2), (2, 1), (1, 2), (2, 0)):
        if rank == src:
            build(TensorDict, 50 + src).send(dst=dst, init_tag=40)
        elif rank == dst:
            td = build(TensorDict, 0)
            td.recv(src=src, init_tag=40, timeout=20)
            assert filled_with(td, 50 + src)
    dist.barrier()


def test_a_hundred_timeouts_then_a_hundred_transfers_on_three_ranks():
    run(hundred_timeouts, world_size=3, timeout=120, group_timeout=20)


def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def late_messages_end_with_their_group(rank, world_size):
    """What timed-out calls leave belongs to their group: destroy_process_group() releases it
    (the receives' buffers, the sends' tensors), and the next group never meets it."""
    import os
    import time
    from tensordict_cpp import TensorDict, errors
    torch.set_num_threads(1)
    store_dir = os.environ["TD_TEST_STORE_DIR"]

    def group(n):  # a new default group, on a store of its own
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store{n}",
                                rank=rank, world_size=2)

    td = TensorDict(a=torch.zeros(4), batch_size=[])  # on the group run() made
    if rank == 0:
        with pytest.raises(errors.TimeoutError):
            td.recv(src=1, timeout=0.3)
        before = _rss_mb()
        for _ in range(10):  # ten 64 MiB sends nobody receives, each timed out and kept
            big = TensorDict(x=torch.ones(16 << 20), batch_size=[])
            with pytest.raises(errors.TimeoutError):
                big.send(dst=1, init_tag=100, timeout=0.05)
        kept = _rss_mb() - before
        ready(1)
        await_ready(1)  # rank 1 sent 9 on this group: it landed in the late receive
    else:
        await_ready(0)
        TensorDict(a=torch.full((4,), 9.0), batch_size=[]).send(dst=0)
        ready(0)
    dist.destroy_process_group()
    group(2)
    if rank == 0:
        deadline = time.monotonic() + 5
        while _rss_mb() - before > 100 and time.monotonic() < deadline:
            time.sleep(0.1)
        after = _rss_mb() - before
        print(f"ten timed-out 64 MiB sends kept {kept:.0f} MB; {after:.0f} MB once the group ended")
        assert kept > 500 and after < 100, (kept, after)
        td.recv(src=1, timeout=10)
        assert (td["a"] == 11).all(), td["a"]  # the new group's message, not the old one's 9
    else:
        TensorDict(a=torch.full((4,), 11.0), batch_size=[]).send(dst=0)
    dist.barrier()  # run() destroys this group


def test_late_messages_end_with_their_group(tmp_path, monkeypatch):
    monkeypatch.setenv("TD_TEST_STORE_DIR", str(tmp_path))
    run(late_messages_end_with_their_group, world_size=2, timeout=120)
