"""Our C++ repr must equal the reference's, detailed and compact, for the same TensorDicts."""
import subprocess

import pytest
import torch
import tensordict
from tensordict import TensorDict

from conftest import built


def reference_cases():
    nested = TensorDict(b=torch.ones(4, 3, dtype=torch.int64), a=torch.ones(4), batch_size=[4])
    nested["c", "d"] = torch.zeros(4, 2, dtype=torch.bool)
    nested["c", "e", "f"] = torch.ones(4)
    tricky = TensorDict({"a": torch.ones(2, 0), "a b": torch.ones(2), "B": torch.ones(2, 1, 1)}, batch_size=[2])
    dtypes = TensorDict(batch_size=[1])
    # Same keys as the C++ side: "k" + the ScalarType enum value.
    enum = {torch.bool: 11, torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3,
            torch.int64: 4, torch.float16: 5, torch.bfloat16: 15, torch.float32: 6,
            torch.float64: 7, torch.complex64: 9, torch.complex128: 10, torch.uint16: 27,
            torch.uint32: 28, torch.uint64: 29}
    for dt, v in enum.items():
        dtypes[f"k{v}"] = torch.zeros(1, 2, dtype=dt)
    non_tensors = TensorDict(a=torch.ones(3), batch_size=[3])
    non_tensors["s"] = "hello"
    non_tensors.set_non_tensor("d", {"k": [1, 2.0, None, True], "q": "it's \"x\"\t\u00e9"})
    non_tensors.set_non_tensor("none", None)
    non_tensors.set_non_tensor("f", 1e-07)
    non_tensors.set_non_tensor("b", False)
    non_tensors.set_non_tensor("i", -3)
    non_tensors.set_non_tensor("long", "x" * 150 + "\u00e9" + "y" * 100)
    non_tensors.set_non_tensor(("n", "lst"), ["a", "b'"])
    on_cpu = TensorDict(batch_size=[3], device="cpu")
    on_cpu.set_non_tensor("z", 1.5)
    non_tensors["cpu"] = on_cpu
    return {
        "non_tensors": non_tensors,
        "nested": nested,
        "empty": TensorDict(),
        "device": TensorDict(x=torch.tensor(1.0), batch_size=[], device="cpu"),
        "tricky": tricky,
        "dtypes": dtypes,
    }


def ours():
    out = subprocess.run([str(built("repr_cases"))], check=True, capture_output=True, text=True).stdout
    cases = {}
    for block in out.split("=== ")[1:]:
        name, _, body = block.partition("\n")
        cases[name] = body.rstrip("\n")
    return cases


@pytest.mark.parametrize("name", ["nested", "empty", "device", "tricky", "dtypes", "non_tensors"])
def test_repr_equals_reference(name):
    case = reference_cases()[name]
    with tensordict.set_printoptions(compact=False):
        expected = repr(case)
    got = ours()
    assert got[name] == expected
    assert got[name + " compact"] == repr(case)
