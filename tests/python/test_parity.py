"""Behaviours that follow the reference tensordict 0.15.3: every test runs the same calls on the
reference and on ours (``lib`` is either package) and asserts the same outcome.

- ``td["text"]`` of a NonTensorStack is a ``LinkedList``: a list whose item assignments write
  back into the TensorDict, with ``tolist()`` (docs/non_tensor.md).
- ``to_tensordict()`` is a copy that shares nothing (docs/with-tensordict.md).
- A value whose leading dims do not match the batch size raises RuntimeError (docs/errors.md).
"""
import pickle

import pytest
import torch

import tensordict
import tensordict_cpp

LIBS = [tensordict, tensordict_cpp]
IDS = ["reference", "ours"]
lib_param = pytest.mark.parametrize("lib", LIBS, ids=IDS)


def texts(lib, values=("a", "b", "c")):
    td = lib.TensorDict(x=torch.zeros(len(values)), batch_size=[len(values)])
    td["text"] = list(values)
    return td


# ---- td["text"] is a LinkedList ------------------------------------------------------------------
@lib_param
def test_a_stack_reads_as_a_linked_list_that_writes_back(lib):
    td = texts(lib)
    values = td["text"]
    assert type(values).__name__ == "LinkedList" and isinstance(values, list)
    assert values == ["a", "b", "c"] and repr(values) == "LinkedList(['a', 'b', 'c'])"
    values[0] = "z"
    assert td["text"] == ["z", "b", "c"] and td.get("text").tolist() == ["z", "b", "c"]
    assert values.tolist() == ["z", "b", "c"] and type(values.tolist()) is list
    values[1:3] = ["x", "y"]  # a slice of the same length
    assert td["text"] == ["z", "x", "y"]
    assert type(td.get_non_tensor("text")).__name__ == "LinkedList"
    td.get_non_tensor("text")[2] = "w"
    assert td["text"].tolist() == ["z", "x", "w"]
    # The element's kind stays: a stack of MetaData keeps MetaData members.
    meta = lib.TensorDict(batch_size=[2])
    meta["m"] = lib.NonTensorStack(lib.MetaData("a"), lib.MetaData("b"))
    meta["m"][0] = "c"
    assert meta["m"] == ["c", "b"]
    assert [type(m).__name__ for m in meta.get("m").tensordicts] == ["MetaData", "MetaData"]


@lib_param
def test_nested_rows_are_linked_lists_too(lib):
    td = lib.TensorDict(batch_size=[2, 2])
    td["names"] = [["a", "b"], ["c", "d"]]
    rows = td["names"]
    assert type(rows[0]).__name__ == "LinkedList"
    rows[0][1] = "q"
    assert td["names"].tolist() == [["a", "q"], ["c", "d"]]
    rows[1] = ["e", "f"]
    assert td["names"].tolist() == [["a", "q"], ["e", "f"]]
    assert rows.tolist() == [["a", "q"], ["e", "f"]]
    assert all(type(r) is list for r in rows.tolist())
    nested = lib.TensorDict({"n": {"t": ["p", "q"]}}, batch_size=[2])
    nested["n", "t"][1] = "r"
    assert nested["n", "t"] == ["p", "r"]


@lib_param
def test_a_failed_write_leaves_both_unchanged(lib):
    td = texts(lib)
    values = td["text"]
    with pytest.raises(RuntimeError):
        values[0] = ["too", "many"]  # a stack of 2 where one element goes
    assert values == ["a", "b", "c"] and td["text"] == ["a", "b", "c"]


@lib_param
def test_length_changes_unlink_and_copies_are_unlinked(lib):
    td = texts(lib)
    values = td["text"]
    values.append("d")
    values[0] = "z"
    assert values == ["z", "b", "c", "d"] and td["text"] == ["a", "b", "c"]
    again = pickle.loads(pickle.dumps(td["text"]))
    assert type(again).__name__ == "LinkedList" and again == ["a", "b", "c"]
    again[0] = "y"
    assert td["text"] == ["a", "b", "c"]
    plain = type(values)(["k"])  # built from an iterable: not linked to anything
    plain[0] = "j"
    assert plain == ["j"]


@lib_param
def test_a_lazy_stack_entry_is_not_linked(lib):
    stack = lib.LazyStackedTensorDict(lib.TensorDict(t="a"), lib.TensorDict(t="b"), stack_dim=0)
    values = stack["t"]
    assert type(values).__name__ == "LinkedList" and values == ["a", "b"]
    values[0] = "q"
    assert stack["t"] == ["a", "b"]


# ---- to_tensordict() is a copy ------------------------------------------------------------------
@lib_param
def test_to_tensordict_is_a_copy_that_shares_nothing(lib):
    batch = lib.TensorDict(obs=torch.zeros(4, 2), nested={"r": torch.zeros(4)},
                           batch_size=[4])
    batch["text"] = ["a", "b", "c", "d"]
    batch.lock_()
    snap = batch.to_tensordict()
    assert type(snap) is lib.TensorDict and not snap.is_locked
    assert snap.batch_size == batch.batch_size and snap.device == batch.device
    assert snap["obs"].data_ptr() != batch["obs"].data_ptr()
    assert snap["nested", "r"].data_ptr() != batch["nested", "r"].data_ptr()
    batch["obs"].add_(1)
    batch["nested", "r"].fill_(5)
    assert snap["obs"].eq(0).all() and snap["nested", "r"].eq(0).all()
    snap["obs"].fill_(-1)
    assert batch["obs"].eq(1).all()
    assert snap["text"] == ["a", "b", "c", "d"]
    snap["extra"] = torch.ones(4)  # unlocked, and its own structure
    assert "extra" not in batch.keys() and "extra" in snap.keys()


@lib_param
def test_to_tensordict_keeps_autograd_and_stacks_lazy_stacks(lib):
    leaf = torch.zeros(3, requires_grad=True)
    copy = lib.TensorDict(a=leaf, batch_size=[3]).to_tensordict()
    assert copy["a"].requires_grad and type(copy["a"].grad_fn).__name__ == "CloneBackward0"
    members = [lib.TensorDict(a=torch.full((2,), float(i))) for i in range(3)]
    lazy = lib.LazyStackedTensorDict(*members, stack_dim=0)
    dense = lib.TensorDict(s=lazy, batch_size=[3]).to_tensordict()
    assert type(dense["s"]) is lib.TensorDict and dense["s", "a"].shape == (3, 2)
    assert type(lazy.to_tensordict()) is lib.TensorDict
    ragged = lib.LazyStackedTensorDict(lib.TensorDict(a=torch.zeros(2)),
                                       lib.TensorDict(a=torch.zeros(3)), stack_dim=0)
    with pytest.raises(RuntimeError, match="Failed to stack tensors within a tensordict"):
        ragged.to_tensordict()


@lib_param
def test_a_tensorclass_to_tensordict_is_a_copy(lib):
    @lib.tensorclass
    class Sample:
        obs: torch.Tensor

    s = Sample(obs=torch.zeros(3), batch_size=[3])
    td = s.to_tensordict()
    assert type(td) is lib.TensorDict and td["obs"].data_ptr() != s.obs.data_ptr()


# ---- the batch-dims error -------------------------------------------------------------------
BAD_BATCH = {
    "constructor": lambda lib: lib.TensorDict(a=torch.zeros(3), batch_size=[4]),
    "setitem": lambda lib: lib.TensorDict(a=torch.zeros(3), batch_size=[3]).__setitem__(
        "b", torch.zeros(2)),
    "set": lambda lib: lib.TensorDict(a=torch.zeros(3), batch_size=[3]).set(
        "b", torch.zeros(2, 5)),
    "nested": lambda lib: lib.TensorDict(a=torch.zeros(3), batch_size=[3]).__setitem__(
        "n", lib.TensorDict(x=torch.zeros(2), batch_size=[2])),
    "batch_size setter": lambda lib: setattr(lib.TensorDict(a=torch.zeros(3), batch_size=[3]),
                                             "batch_size", [4]),
}


@lib_param
@pytest.mark.parametrize("call", BAD_BATCH.values(), ids=BAD_BATCH.keys())
def test_leading_dims_that_miss_the_batch_size_raise_runtime_error(lib, call):
    with pytest.raises(RuntimeError):
        call(lib)


def test_ours_is_also_the_value_error_it_was():
    with pytest.raises(ValueError) as info:
        BAD_BATCH["setitem"](tensordict_cpp)
    assert type(info.value) is tensordict_cpp.errors.BatchSizeError
    assert "key 'b'" in str(info.value)
