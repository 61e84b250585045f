"""Our restricted pickle reader/writer against Python's pickle, and the inputs it must refuse."""
import io
import os
import pickle
import pickletools
import subprocess

import pytest
import torch
from tensordict import TensorDict
from tensordict import tensorclass as ref_tensorclass

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
        # GLOBAL / STACK_GLOBAL only name os.system (an inert class reference); the REDUCE that
        # would call it is refused.
        (pickle.dumps(Evil()), "refused opcode REDUCE: it would import or call code"),
        (pickle.dumps(Evil(), protocol=2), "refused opcode REDUCE: it would import or call code"),
        (pickle.dumps(Evil(), protocol=0), "outside the supported subset"),  # its str argument
        (b"\x80\x04\x8c\x02os\x8c\x06system\x93)\x81.", "refused opcode NEWOBJ"),
        (b"\x80\x04\x8c\x02os\x8c\x06system\x93}b.", "refused opcode BUILD"),
        (b"\x80\x04X\x88\x13\x00\x00" + b"a" * 5000 + b"\x8c\x01C\x93.",
         "module of 5000 bytes is longer than 4096 bytes"),
        (b"\x80\x02c" + b"a" * 5000 + b"\nC\n.", "GLOBAL module is longer than 4096 bytes"),
        (b"\x80\x04\x8c\x06os sys\x8c\x01C\x93.", "is not a dotted name"),
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
        (lambda m: m.__setitem__("cls", "NonTensorData"),
         "only TensorDict, LazyStackedTensorDict and NonTensorStack"),
        (lambda m: m.__setitem__("cls", "LazyStackedTensorDict"), "unexpected field"),
        (lambda m: m["cls_metadata"].__setitem__("batch_size", "4"), "batch_size"),
    ],
)
def test_bad_reference_metadata_is_refused(mutate, message):
    meta = reference_metadata()
    mutate(meta)
    result = metadata_roundtrip(meta)
    assert result.returncode == 2
    assert message in result.stderr.decode()


class Local:
    pass


def test_class_references_are_read_as_names_and_written_back():
    # Read without importing anything: a module that does not exist is fine.
    data = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x03cls\x94\x8c\x0bno_such.mod\x94" \
           b"\x8c\x0bOuter.Inner\x94\x93\x94s."
    data = data[:3] + len(data[11:]).to_bytes(8, "little") + data[11:]
    result = roundtrip(data)
    assert result.returncode == 0, result.stderr.decode()
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(result.stdout)]
    assert ("SHORT_BINUNICODE", "no_such.mod") in ops and ("STACK_GLOBAL", None) in ops
    # Python's own loads resolves what we write back to the same class.
    for protocol in (2, 4):
        result = roundtrip(pickle.dumps({"cls": Local, "x": [Local, TensorDict]}, protocol=protocol))
        assert result.returncode == 0, result.stderr.decode()
        assert pickle.loads(result.stdout) == {"cls": Local, "x": [Local, TensorDict]}


@ref_tensorclass
class RefInner:
    q: torch.Tensor


def tensorclass_metadata():
    td = TensorDict(inner=RefInner(q=torch.zeros(3, 2), batch_size=[3]), x=torch.ones(3),
                    batch_size=[3])
    meta = td.consolidate(metadata=True)._consolidated["metadata"]
    assert meta["inner"]["cls"] is RefInner  # pickled as STACK_GLOBAL
    return meta


def test_reference_tensorclass_node_is_read_as_a_tensordict_node():
    meta = tensorclass_metadata()
    result = metadata_roundtrip(meta)
    assert result.returncode == 0, result.stderr.decode()
    back = pickle.loads(result.stdout)
    assert back["inner"]["cls"] == "TensorDict"  # we never write class references
    assert back["inner"]["leaves"] == meta["inner"]["leaves"]


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda m: m["inner"]["leaves"].__setitem__("q", (Local,) + m["inner"]["leaves"]["q"][1:]),
         '["inner"]["leaves"]["q"][0]'),
        (lambda m: m["non_tensors"].__setitem__("t", (Local, [3], None)), '["non_tensors"]["t"][0]'),
        (lambda m: m.__setitem__("_tensorclass_type", Local), '["_tensorclass_type"]'),
        (lambda m: m["cls_metadata"].__setitem__("device", Local), '["cls_metadata"]["device"]'),
    ],
)
def test_class_reference_outside_a_nodes_cls_is_refused(mutate, where):
    meta = tensorclass_metadata()
    mutate(meta)
    result = metadata_roundtrip(meta)
    assert result.returncode == 2
    err = result.stderr.decode()
    assert f"the class reference {__name__}.Local at {where} is refused" in err, err
