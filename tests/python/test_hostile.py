"""A hostile or broken peer, and faults of the caller's own, seen from Python: a raw
torch.distributed rank sends crafted bytes to our receiver (real Gloo on 127.0.0.1), which
raises the documented Python error; per-call timeouts; leaves that cannot travel. The C++
suite (tests/cpp/dist_hostile_test.cpp) plays every case and measures the receiver's memory."""
import datetime
import functools
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from tensordict_cpp import TensorDict
from tensordict_cpp.distributed import run

RUN = dict(timeout=90, group_timeout=20)


def raw_object_then_storage(obj_bytes, storage_bytes):
    """What init_remote sends (torch's object framing, then the storage), from crafted parts."""
    dist.send(torch.tensor([len(obj_bytes)], dtype=torch.long), dst=1)
    dist.send(torch.frombuffer(bytearray(obj_bytes), dtype=torch.uint8), dst=1)
    if storage_bytes is not None:
        dist.send(torch.zeros(storage_bytes, dtype=torch.uint8), dst=1)


def hostile_peer(rank, world_size):
    torch.set_num_threads(1)
    # The reference's metadata of that TensorDict, as its consolidate() writes it.
    metadata = {"cls": "TensorDict", "non_tensors": {},
                "leaves": {"a": ("torch.float32", [1024], 0, 4096, 0)},
                "cls_metadata": {"device": None, "names": [], "batch_size": [],
                                 "is_locked": False}}

    # A storage message shorter than announced: refused, never bytes nobody sent.
    if rank == 0:
        raw_object_then_storage(pickle.dumps({**metadata, "_total_bytes": 4096}), 8)
    else:
        with pytest.raises(ValueError, match="storage message is shorter than the 4096 bytes"):
            TensorDict.from_remote_init(src=0)

    # A storage beyond what this machine holds: refused before anything is allocated.
    if rank == 0:
        raw_object_then_storage(pickle.dumps({**metadata, "_total_bytes": 32 << 30}), None)
    else:
        with pytest.raises(ValueError, match="this receiver accepts 0 to"):
            TensorDict.from_remote_init(src=0)

    # One long string read back through the memo 400 times: the reader's memory budget.
    if rank == 0:
        s = "s" * (8 << 20)
        raw_object_then_storage(pickle.dumps([s] * 400), None)
    else:
        with pytest.raises(ValueError, match="the values read would take more than"):
            TensorDict.from_remote_init(src=0)
    dist.barrier()


def test_a_hostile_peer_gets_value_errors():
    run(hostile_peer, world_size=2, **RUN)


def own_faults(rank, world_size):
    torch.set_num_threads(1)
    td = TensorDict(b=torch.zeros(2), a=torch.zeros(2), batch_size=[2])
    with pytest.raises(ValueError, match="Invalid source rank"):
        td.recv(src=rank)
    with pytest.raises(ValueError, match="Invalid source rank"):
        TensorDict.from_remote_init(src=rank)
    with pytest.raises(ValueError, match="max_total_bytes must be non-negative, got -1"):
        TensorDict.from_remote_init(src=1 - rank, max_total_bytes=-1)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        td.recv(src=1 - rank, timeout=-1)
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        td.recv(src=1 - rank, timeout="1")
    meta = TensorDict(x=TensorDict(m=torch.empty(2, device="meta"), batch_size=[2]),
                      batch_size=[2])
    with pytest.raises(ValueError, match=r"send: leaf \('x', 'm'\) is on the meta device"):
        meta.send(dst=1 - rank)
    with pytest.raises(ValueError, match=r"recv: leaf \('x', 'm'\) is on the meta device"):
        meta.recv(src=1 - rank)
    sparse = TensorDict(s=torch.eye(2).to_sparse(), batch_size=[2])
    with pytest.raises(ValueError, match="send: leaf 's' is a sparse tensor"):
        sparse.send(dst=1 - rank)

    # Rank 0 sends nothing: rank 1's per-call timeouts end the waits, on groups of their own
    # (each leaves its receives parked on its group for a later receive).
    groups = [dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20)) for _ in range(2)]
    if rank == 1:
        for group, timeout in zip(groups, (0.4, datetime.timedelta(milliseconds=400))):
            start = time.monotonic()
            with pytest.raises(dist.DistBackendError,
                               match=r"recv: timed out after 0\.\d+ s \(the call's timeout of "
                                     r"400 ms\) waiting for rank 0: tag 3 \(key 'a'\)"):
                td.recv(src=0, group=group, init_tag=3, timeout=timeout)
            assert time.monotonic() - start < 2.0
    else:
        time.sleep(2.5)


def test_own_faults_and_timeouts():
    run(own_faults, world_size=2, **RUN)


def test_a_key_that_is_not_a_string_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"key 1 \(int\) is not a str"):
        TensorDict({1: torch.zeros(2)}, batch_size=[2])


def test_a_nested_tensor_leaf_is_a_type_error_naming_it():
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match="cannot set key 'n' to a nested"):
        TensorDict(n=nested, batch_size=[2])
