"""Point-to-point transfers between tensordict_cpp processes, started by
tensordict_cpp.distributed.run (spawn, a FileStore per run, Gloo on 127.0.0.1)."""
import builtins
import datetime
import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tensordict_cpp import TensorDict, errors
from tensordict_cpp.distributed import run

RUN = dict(timeout=90, group_timeout=20)


def structure(fill):
    td = TensorDict(b=torch.full((4, 3), fill), a=torch.full((4,), fill), batch_size=[4])
    td["n", "z"] = torch.full((4, 2), fill, dtype=torch.int64)
    td["n", "y"] = torch.full((4,), fill, dtype=torch.float16)
    td["_"] = torch.full((4,), bool(fill))
    return td


def assert_filled(td, fill):
    for key, leaf in td.items(include_nested=True, leaves_only=True):
        assert (leaf == torch.tensor(fill).to(leaf.dtype)).all(), (key, leaf)


def two_ranks(store_dir, rank, world_size):
    torch.set_num_threads(1)
    peer = 1 - rank
    # The example of the issue, unchanged.
    if rank == 0:
        TensorDict(a=torch.ones(4), b=torch.ones(4, 3), batch_size=[4]).send(dst=1)
    else:
        td = TensorDict(a=torch.zeros(4), b=torch.zeros(4, 3), batch_size=[4])
        td.recv(src=0)
        assert td["b"].sum().item() == 12.0

    # Blocking per-leaf with init_tag, then pseudo-random tags; recv returns the last tag.
    for kw in ({"init_tag": 5}, {"init_tag": 3, "pseudo_rand": True}):
        if rank == 0:
            structure(1).send(dst=1, **kw)
        else:
            td = structure(0)
            last = td.recv(src=0, **kw)
            assert_filled(td, 1)
            # 5 leaves: init_tag + 4, or a draw of the reference's generator (0..9999)
            assert last == 9 if not kw.get("pseudo_rand") else 0 <= last < 10000

    # isend(return_early) / irecv(return_premature): torch Work handles.
    if rank == 0:
        works = structure(2).isend(dst=1, init_tag=100, return_early=True)
        assert len(works) == 5 and all(isinstance(w, dist.Work) for w in works)
        for w in works:
            w.wait()
    else:
        td = structure(0)
        works = td.irecv(src=0, init_tag=100, return_premature=True)
        assert len(works) == 5 and all(isinstance(w, dist.Work) for w in works)
        for w in works:
            w.wait()
        assert_filled(td, 2)

    # Blocking isend / irecv, and consolidated both ways.
    if rank == 0:
        assert structure(3).isend(dst=1, init_tag=7) == 7 + 4
        assert structure(4).isend(dst=1, consolidated=True) is None
        structure(5).consolidate().send(dst=1, consolidated=True)
    else:
        td = structure(0)
        assert td.irecv(src=0, init_tag=7) is None
        assert_filled(td, 3)
        target = structure(0).consolidate()
        assert target.irecv(src=0, consolidated=True) is None
        assert_filled(target, 4)
        assert target.recv(src=0, consolidated=True) is None
        assert_filled(target, 5)

    # The GIL is released while a transfer waits: another Python thread keeps running.
    if rank == 0:
        time.sleep(1.0)
        structure(6).send(dst=1)
    else:
        ticks = [0]
        stop = threading.Event()

        def tick():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        t = threading.Thread(target=tick)
        t.start()
        td = structure(0)
        td.recv(src=0)
        stop.set()
        t.join()
        assert_filled(td, 6)
        assert ticks[0] > 100, ticks

    # A standalone group built on a store, never registered: group ranks only.
    store = dist.FileStore(os.path.join(store_dir, "standalone"), 2)
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=20))
    if rank == 0:
        structure(7).send(group=group, group_dst=peer, init_tag=1)
        works = structure(8).isend(group=group, group_dst=peer, return_early=True)
        for w in works:
            w.wait()
    else:
        td = structure(0)
        td.recv(group=group, group_src=peer, init_tag=1)
        assert_filled(td, 7)
        td.irecv(group=group, group_src=peer)
        assert_filled(td, 8)

    # torch's own checks on global ranks: not to oneself (blocking send), not outside the group.
    with pytest.raises(ValueError, match="should not be the same as the rank"):
        structure(0).send(dst=rank)
    with pytest.raises(ValueError, match="not registered"):
        structure(0).send(dst=peer, group=group)
    dist.barrier()


def test_two_ranks(tmp_path):
    run(functools.partial(two_ranks, str(tmp_path)), world_size=2, **RUN)


def subgroup_ranks(rank, world_size):
    torch.set_num_threads(1)
    sub = dist.new_group([0, 2])  # global 2 is rank 1 of sub
    if rank == 0:
        structure(1).send(dst=2, group=sub)
        structure(2).send(group=sub, group_dst=1)
        structure(3).isend(dst=2, group=sub)
        with pytest.raises(ValueError, match="not part of group"):
            structure(0).send(dst=1, group=sub)
    elif rank == 2:
        td = structure(0)
        td.recv(src=0, group=sub)
        assert_filled(td, 1)
        td.recv(group=sub, group_src=0)
        assert_filled(td, 2)
        td.irecv(src=0, group=sub)
        assert_filled(td, 3)
    dist.barrier()


def test_global_ranks_map_into_a_subgroup_as_torch_maps_them():
    run(subgroup_ranks, world_size=3, **RUN)


def failing(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank one failed on purpose")
    time.sleep(60)


def test_run_fails_fast_with_the_failing_rank_error():
    start = time.monotonic()
    with pytest.raises(tmp.ProcessRaisedException, match="rank one failed on purpose"):
        run(failing, world_size=2, **RUN)
    assert time.monotonic() - start < 45


SCRIPT = """\
import torch
from tensordict_cpp import TensorDict
from tensordict_cpp.distributed import run

print("top level")

def send_recv(rank, world_size):
    if rank == 0:
        td = TensorDict(a=torch.ones(4), b=torch.ones(4, 3), batch_size=[4])
        td.send(dst=1)
    else:
        td = TensorDict(a=torch.zeros(4), b=torch.zeros(4, 3), batch_size=[4])
        td.recv(src=0)
        print(td["b"].sum())
"""


def test_run_as_written_in_a_script_prints_tensor_12(tmp_path):
    # Under the guard: the ranks import the script again, but run its top level only once.
    script = tmp_path / "example.py"
    script.write_text(SCRIPT + 'if __name__ == "__main__":\n    run(send_recv)\n')
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # The script and each rank (which imports it again) print the top level's line, on one
    # pipe at once: their words may interleave, so they are counted, not read in order.
    assert out.stdout.count("top level") == 3, out.stdout
    assert out.stdout.count("tensor(12.)") == 1, out.stdout


def test_run_without_the_main_guard_is_refused(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(SCRIPT + "run(send_recv)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert "outside `if __name__ == \"__main__\":`" in out.stderr, out.stderr
    assert out.stdout.split() == ["top", "level"]  # no rank was started


def test_run_with_env_variables_set_in_part_names_the_missing_ones(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="set only in part: WORLD_SIZE, MASTER_PORT missing"):
        run(failing, world_size=2, **RUN)


def checked_ranks(rank, world_size):
    torch.set_num_threads(1)
    # A match moves the data as usual, per leaf and consolidated.
    for consolidated in (False, True):
        if rank == 0:
            structure(3).send(dst=1, checked=True, consolidated=consolidated)
        else:
            td = structure(0)
            td = td.consolidate() if consolidated else td
            td.recv(src=0, checked=True, consolidated=consolidated)
            assert_filled(td, 3)
    # A mismatch names the key and the dtypes, and the receiver keeps its values.
    if rank == 0:
        structure(4).isend(dst=1, init_tag=7, checked=True)
    else:
        td = structure(0)
        td["n", "y"] = torch.zeros(4, dtype=torch.float32)
        with pytest.raises(RuntimeError, match=r"key \('n', 'y'\) has dtype torch.float16 on the "
                                               r"sender and torch.float32 here"):
            td.irecv(src=0, init_tag=7, checked=True)
        assert_filled(td, 0)
    # The pair is still in step afterwards.
    if rank == 0:
        structure(5).send(dst=1, checked=True)
    else:
        td = structure(0)
        td.recv(src=0, checked=True)
        assert_filled(td, 5)


def test_checked_transfers_name_a_mismatch():
    run(checked_ranks, world_size=2, **RUN)


def typed_error_ranks(rank, world_size):
    torch.set_num_threads(1)
    # A checked receive whose TensorDict differs: SchemaMismatchError, still a RuntimeError.
    if rank == 0:
        structure(4).send(dst=1, checked=True)
    else:
        td = structure(0)
        td["n", "y"] = torch.zeros(4, dtype=torch.float32)
        with pytest.raises(errors.SchemaMismatchError,
                           match=r"key \('n', 'y'\) has dtype torch.float16 on the sender"):
            td.recv(src=0, checked=True)
        assert_filled(td, 0)
    # A receive with a timeout and no sender: tensordict_cpp.errors.TimeoutError, which is
    # also the built-in TimeoutError and a DistBackendError. On a group of its own: Gloo closes
    # a group's connections once a wait timed out.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    if rank == 1:
        with pytest.raises(errors.TimeoutError, match=r"recv: timed out after") as info:
            structure(0).recv(src=0, group=group, timeout=0.5)
        assert isinstance(info.value, builtins.TimeoutError)
        assert isinstance(info.value, dist.DistBackendError)
    else:
        time.sleep(2.5)


def test_transfer_failures_raise_the_typed_errors():
    run(typed_error_ranks, world_size=2, **RUN)


def non_member_ranks(rank, world_size):
    import torch.distributed as dist
    group = dist.new_group([0, 1])  # every rank calls it; rank 2 is not in it
    if rank == 2:
        assert group == dist.GroupMember.NON_GROUP_MEMBER
        td = TensorDict(a=torch.ones(2), batch_size=[2])
        # torch's own send would only warn and return; ours refuses the handle.
        with pytest.raises(ValueError, match="send: this process is not a member of the group"):
            td.send(dst=0, group=group)
        with pytest.raises(ValueError, match="not a member of the group"):
            td.all_reduce(group=group)
    # Nobody leaves before the others are past new_group: a rank that exits while a peer is
    # still connecting its pairs fails that peer's connectFullMesh.
    dist.barrier()


def test_a_non_member_s_group_handle_is_refused():
    run(non_member_ranks, world_size=3, **RUN)


def forward_without_a_copy(rank, world_size):
    """A forwarding rank: a TensorDict received over c10d (from_remote_init, recv(consolidated=True))
    is consolidated, so sending it on copies nothing: the forwarding rank's peak memory does
    not grow by its 64 MiB (a consolidation would add them)."""
    from test_hostile_inputs import peak_mb, rss_mb

    torch.set_num_threads(1)
    n = 64 << 20
    if rank == 0:
        td = TensorDict(x=torch.full((n,), 3, dtype=torch.uint8)).consolidate()
        td.init_remote(dst=1)
        back = TensorDict(x=torch.zeros(n, dtype=torch.uint8)).consolidate()
        back.recv(src=1, consolidated=True)
        assert bool((back["x"] == 3).all())
    else:
        got = TensorDict.from_remote_init(src=0)
        assert got.is_consolidated()
        base = rss_mb()
        got.send(dst=0, consolidated=True)
        grown = peak_mb() - base
        assert grown < 16, f"sending a received TensorDict on grew the peak by {grown:.0f} MB"
    dist.barrier()


def test_a_tensordict_received_over_c10d_is_sent_on_without_a_copy():
    run(forward_without_a_copy, world_size=2, **RUN)
