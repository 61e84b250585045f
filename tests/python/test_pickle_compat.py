"""Our restricted pickle reader/writer against Python's pickle, and the inputs it must refuse."""
import io
import os
import pickle
import pickletools
import subprocess

import pytest
import torch
from tensordict import TensorDict

from conftest import built


def roundtrip(data: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([str(built("pickle_roundtrip"))], input=data, capture_output=True, timeout=30)


def reference_metadata():
    td = TensorDict(a=torch.ones(4), b=torch.ones(4, 3, dtype=torch.int64), batch_size=[4])
    td["c", "d"] = torch.zeros(4, 2, dtype=torch.bool)
    td["c", "e", "f"] = torch.ones(4, dtype=torch.complex64)
    meta = td.consolidate(metadata=True)._consolidated["metadata"]
    meta["_total_bytes"] = 1234
    return meta


shared = [1, 2]
OBJECTS = [
    reference_metadata(),
    {"a": (1, None), "b": [True, False, None], "c": 0.1, "d": -1.5e300, "e": float("inf")},
    {"ints": [0, 255, 256, 65535, 65536, -1, -(2**31), 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]},
    {"unicode": "h\u00e9llo \u4e16\u754c \U0001f600", "long": "x" * 70000, "empty": ""},
    {"shared_a": shared, "shared_b": shared, "tuples": ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4))},
    [[[[[]]]]],
    {str(i): i for i in range(2500)},  # several SETITEMS batches
]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("index", range(len(OBJECTS)))
def test_python_pickles_round_trip(protocol, index):
    obj = OBJECTS[index]
    result = roundtrip(pickle.dumps(obj, protocol=protocol))
    assert result.returncode == 0, result.stderr.decode()
    assert pickle.loads(result.stdout) == obj


def test_torch_object_list_framing_payload():
    # Exactly what torch's send_object_list pickles for init_remote.
    from torch.distributed.distributed_c10d import _object_to_tensor

    tensor, size = _object_to_tensor(reference_metadata(), torch.device("cpu"), None)
    data = tensor.numpy().tobytes()
    assert size.item() == len(data)
    result = roundtrip(data)
    assert result.returncode == 0, result.stderr.decode()
    assert pickle.loads(result.stdout) == reference_metadata()


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "payload, message",
    [
        (pickle.dumps(Evil()), "refused opcode STACK_GLOBAL"),
        (pickle.dumps(Evil(), protocol=0), "refused opcode GLOBAL"),
        (pickle.dumps({"cls": TensorDict}), "refused opcode STACK_GLOBAL"),
        (pickle.dumps(b"bytes"), "outside the supported subset"),
        (pickle.dumps({1: "int key"}), "only str keys"),
        (pickle.dumps(2**64), "exceeds int64"),
        (pickle.dumps({"a": 1})[:-3], "truncated"),
        (pickle.dumps({"a": 1}) + b"junk", "bytes after STOP"),
        (pickle.dumps(eval("[" * 80 + "]" * 80)), "nesting deeper than 64"),
    ],
)
def test_refused_inputs(payload, message):
    result = roundtrip(payload)
    assert result.returncode == 2
    assert message in result.stderr.decode()
    assert b"pwned" not in result.stdout


def test_memo_expansion_is_bounded():
    # Each level refers twice to the previous one: 2**40 values once expanded.
    level = ["x"]
    for _ in range(40):
        level = [level, level]
    result = roundtrip(pickle.dumps(level))
    assert result.returncode == 2
    assert "more than" in result.stderr.decode()


def metadata_roundtrip(meta) -> subprocess.CompletedProcess:
    return subprocess.run([str(built("pickle_roundtrip")), "--metadata"], input=pickle.dumps(meta),
                          capture_output=True, timeout=30)


def reference_metadata_cases():
    plain = TensorDict(x=torch.ones(3), batch_size=[3], device="cpu")
    deep = TensorDict(batch_size=[2])
    deep["a", "b", "c"] = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    deep["z"] = torch.zeros(2, 5, dtype=torch.bfloat16)
    deep["_"] = torch.zeros(2, dtype=torch.bool)
    locked = TensorDict(y=torch.zeros(()), batch_size=[]).lock_()
    return [reference_metadata(), plain, deep, locked]


@pytest.mark.parametrize("index", range(4))
def test_reference_metadata_round_trips_with_tuples(index):
    case = reference_metadata_cases()[index]
    meta = case if isinstance(case, dict) else case.consolidate(metadata=True)._consolidated["metadata"]
    result = metadata_roundtrip(meta)
    assert result.returncode == 0, result.stderr.decode()
    back = pickle.loads(result.stdout)
    assert back == meta
    assert list(back) == list(meta)  # same key order
    assert all(isinstance(entry, tuple) for entry in back["leaves"].values())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m["leaves"].__setitem__("a", ("torch.float32", [4], 0, 4096, 0)), "holds 4096"),
        (lambda m: m["leaves"].__setitem__("a", ("torch.evil", [4], 0, 16, 0)), "unknown dtype 'torch.evil'"),
        (lambda m: m.__setitem__("cls", "LazyStackedTensorDict"), "only TensorDict nodes"),
        (lambda m: m["cls_metadata"].__setitem__("batch_size", "4"), "batch_size"),
    ],
)
def test_bad_reference_metadata_is_refused(mutate, message):
    meta = reference_metadata()
    mutate(meta)
    result = metadata_roundtrip(meta)
    assert result.returncode == 2
    assert message in result.stderr.decode()
