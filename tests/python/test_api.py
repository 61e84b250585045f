"""The Python surface of tensordict_cpp.TensorDict, checked against the reference where they
share behaviour."""
import pydoc
import re

import pytest
import tensordict
from tensordict_cpp import set_printoptions as tdc_set_printoptions
import torch

import tensordict_cpp
from tensordict_cpp import TensorDict


def make():
    td = TensorDict(a=torch.arange(4.0), b=torch.ones(4, 3), batch_size=[4])
    td["n", "x"] = torch.zeros(4, 2, dtype=torch.int64)
    return td


def test_kwargs_constructor_as_in_the_example():
    td = TensorDict(a=torch.ones(4), b=torch.ones(4, 3), batch_size=[4])
    assert td.batch_size == torch.Size([4]) and isinstance(td.batch_size, torch.Size)
    assert td.shape == torch.Size([4])
    assert td.keys() == ["a", "b"]
    assert td.device is None
    assert len(td) == 4


def test_constructor_forms():
    nested = TensorDict({"a": torch.ones(2, 3), "n": {"x": torch.ones(2)}}, batch_size=2, device="cpu")
    assert nested.device == torch.device("cpu")
    assert isinstance(nested["n"], TensorDict)
    assert nested["n"].batch_size == torch.Size([2]) and nested["n"].device == torch.device("cpu")
    assert TensorDict().batch_size == torch.Size([]) and len(TensorDict()) == 0
    assert TensorDict(x=3)["x"].item() == 3  # numbers become tensors
    copy = TensorDict(nested, batch_size=[2])
    assert copy["n", "x"] is not None and copy.keys() == ["a", "n"]
    with pytest.raises(ValueError, match="not both"):
        TensorDict({"a": torch.ones(1)}, a=torch.ones(1))


def _structure(td):
    """Keys (nested, in order), each leaf's shape and values, and each level's batch size."""
    out = []
    for key in td.keys(include_nested=True):
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            out.append((key, tuple(value.shape), value.tolist()))
        else:
            out.append((key, tuple(value.batch_size)))
    return out


@pytest.mark.parametrize("source", [
    lambda: {("a", "b"): torch.arange(2.0)},
    lambda: {"c": torch.ones(2), ("a", "b"): torch.arange(2.0), ("a", "d", "e"): torch.zeros(2, 3)},
    lambda: {"a": {"x": torch.ones(2)}, ("a", "b"): torch.arange(2.0)},  # into a given level
    lambda: {("a",): torch.ones(2), ("n", ("m", "k")): torch.ones(2, 1)},  # nested tuples flatten
    lambda: {("a", "b"): torch.ones(2), ("a", "b"): torch.zeros(2)},  # noqa: F601, last wins
])
def test_tuple_keys_in_the_constructor_make_nested_levels_as_the_reference(source):
    ours = TensorDict(source(), batch_size=[2])
    ref = tensordict.TensorDict(source(), batch_size=[2])
    assert _structure(ours) == _structure(ref)  # levels' batch sizes included


def test_bad_keys_name_the_key_as_keyerror_and_typeerror():
    for key in (1, ("a", 2), (), None):
        for kind in (KeyError, TypeError):  # the reference's KeyError; what the fault is
            with pytest.raises(kind, match=re.escape(f"key {key!r}")):
                TensorDict({key: torch.ones(2)}, batch_size=[2])
        with pytest.raises(tensordict_cpp.errors.InvalidKeyError, match=re.escape(repr(key))):
            TensorDict(a=torch.ones(2), batch_size=[2]).get(key)
    with pytest.raises(ValueError, match=r"\('a', 'b'\)"):  # the nested level's batch size
        TensorDict({("a", "b"): torch.ones(3)}, batch_size=[2])


def test_item_access_with_str_and_tuple_keys():
    td = make()
    assert torch.equal(td["a"], torch.arange(4.0))
    assert td["n", "x"].dtype == torch.int64
    assert td[("n", ("x",))].shape == (4, 2)  # nested tuples flatten, as in the reference
    assert td.get("missing", None) is None
    assert td.get(("n", "missing"), 7) == 7
    with pytest.raises(KeyError):
        td["missing"]


def test_batch_indexing():
    td = make()
    row = td[1]
    assert row.batch_size == torch.Size([]) and row["a"].item() == 1.0
    assert td[1:3].batch_size == torch.Size([2])
    assert td[None].batch_size == torch.Size([1, 4])
    assert td[...].batch_size == torch.Size([4])
    mask = torch.tensor([True, False, True, False])
    assert torch.equal(td[mask]["a"], torch.tensor([0.0, 2.0]))
    assert torch.equal(td[[3, 0]]["a"], torch.tensor([3.0, 0.0]))
    assert torch.equal(td[torch.tensor([2])]["n", "x"], torch.zeros(1, 2, dtype=torch.int64))
    # int and slice indices give views, as in torch
    td[1:3]["a"].fill_(-1.0)
    assert td["a"].tolist() == [0.0, -1.0, -1.0, 3.0]
    with pytest.raises(IndexError):
        td[9]


def test_item_assignment_and_deletion():
    td = make()
    td["c"] = torch.full((4,), 2.0)
    td["m", "deep", "y"] = torch.ones(4, 5)
    assert ("m", "deep", "y") in td and "c" in td
    td["a"] = torch.zeros(4)  # replaces in place in the order
    assert td.keys() == ["a", "b", "n", "c", "m"]
    td[0] = 5.0  # batch assignment writes every leaf
    assert td["b"][0].tolist() == [5.0, 5.0, 5.0] and td["n", "x"][0].tolist() == [5, 5]
    other = td[1].clone().zero_()
    td[1] = other
    assert td["c"][1].item() == 0.0
    del td["c"]
    del td["m", "deep"]
    assert "c" not in td and ("m", "deep") not in td and "m" in td
    with pytest.raises(KeyError):
        del td["c"]
    with pytest.raises(ValueError):
        td["bad"] = torch.ones(3)


def test_keys_values_items_options():
    td = make()
    assert td.keys() == ["a", "b", "n"]
    assert td.keys(include_nested=True) == ["a", "b", ("n", "x"), "n"]  # as the reference
    assert td.keys(include_nested=True, leaves_only=True) == ["a", "b", ("n", "x")]
    assert td.keys(leaves_only=True) == ["a", "b"]
    values = td.values(include_nested=True, leaves_only=True)
    assert [tuple(v.shape) for v in values] == [(4,), (4, 3), (4, 2)]
    items = dict(td.items())
    assert isinstance(items["n"], TensorDict)
    assert td.sorted_keys == ["a", "b", "n"]
    ref = tensordict.TensorDict(a=torch.arange(4.0), b=torch.ones(4, 3), batch_size=[4])
    ref["n", "x"] = torch.zeros(4, 2, dtype=torch.int64)
    for kw in ({}, {"include_nested": True}, {"include_nested": True, "leaves_only": True},
               {"leaves_only": True}):
        assert td.keys(**kw) == list(ref.keys(**kw)), kw


def test_comparison_all_any():
    td, other = make(), make()
    eq = td == other
    assert isinstance(eq, TensorDict) and eq.all() and eq["b"].dtype == torch.bool
    other["a"][0] = 100.0
    ne = td != other
    assert ne.any() and not ne.all() and ne["a"].tolist() == [True, False, False, False]
    assert (td == 1.0)["b"].all() and not (td == 1.0).all()
    assert (td != td.clone()).any() is False
    assert (td == torch.tensor(1.0))["b"].all()
    assert (td == {"a": torch.arange(4.0), "b": torch.ones(4, 3),
                   "n": {"x": torch.zeros(4, 2, dtype=torch.int64)}}).all()
    assert TensorDict().all() is True and TensorDict().any() is False
    with pytest.raises(RuntimeError, match="boolean value"):
        bool(td)


def test_clone_to_apply_update():
    td = make()
    c = td.clone()
    c["a"].add_(1)
    assert td["a"][0].item() == 0.0
    d = td.to(torch.float64)
    assert d["a"].dtype == torch.float64 and d["n", "x"].dtype == torch.float64
    moved = td.to("cpu")
    assert moved.device == torch.device("cpu")
    assert td.to(device="cpu").device == torch.device("cpu")
    doubled = td.apply(lambda x: x * 2)
    assert doubled["b"].sum().item() == 24.0 and doubled["n", "x"].dtype == torch.int64
    summed = td.apply(lambda x, y: x + y, td)
    assert torch.equal(summed["a"], td["a"] * 2)
    dropped = td.apply(lambda x: None if x.dtype == torch.int64 else x)
    assert ("n", "x") not in dropped
    td.update({"z": torch.ones(4)})
    td.update(TensorDict({"n": {"y": torch.ones(4)}}, batch_size=[4]))
    assert td.keys(include_nested=True, leaves_only=True) == ["a", "b", ("n", "x"), ("n", "y"), "z"]
    leaf = td["z"]
    td.update({"z": torch.full((4,), 3.0)}, inplace=True)
    assert leaf.tolist() == [3.0] * 4


def test_unbind_stack_cat_and_torch_functions():
    td = make()
    parts = td.unbind(0)
    assert isinstance(parts, tuple) and len(parts) == 4 and parts[2]["a"].item() == 2.0
    stacked = tensordict_cpp.stack(parts, 0)
    assert stacked.batch_size == torch.Size([4]) and (stacked == td).all()
    assert (torch.stack(list(parts), 0) == td).all()
    catted = torch.cat([td, td], 0)
    assert catted.batch_size == torch.Size([8])
    assert (tensordict_cpp.cat([td[:2], td[2:]]) == td).all()
    assert len(torch.unbind(td, 0)) == 4
    assert [t["a"].item() for t in td] == [0.0, 1.0, 2.0, 3.0]  # iteration unbinds dim 0
    assert td.reshape(2, 2).batch_size == torch.Size([2, 2])
    assert td.view(-1).batch_size == torch.Size([4])
    assert td.unsqueeze(0).squeeze(0).batch_size == torch.Size([4])
    assert [p.batch_size[0] for p in td.split(3)] == [3, 1]
    assert [p.batch_size[0] for p in td.split([1, 3])] == [1, 3]
    assert td[None].expand(2, 4).batch_size == torch.Size([2, 4])


def test_consolidate_matches_the_reference_layout():
    td = make()
    assert not td.is_consolidated()
    c = td.consolidate()
    assert c.is_consolidated() and c.is_locked and (c == td).all()
    assert c.consolidate() is not None
    ref = tensordict.TensorDict(a=torch.arange(4.0), b=torch.ones(4, 3), batch_size=[4])
    ref["n", "x"] = torch.zeros(4, 2, dtype=torch.int64)
    ref_storage = ref.consolidate(metadata=True)._consolidated["storage"]
    assert torch.equal(c._cpp.consolidated_storage(), ref_storage)


def test_repr_equals_the_reference_detailed_repr():
    td = make()
    ref = tensordict.TensorDict(a=torch.arange(4.0), b=torch.ones(4, 3), batch_size=[4])
    ref["n", "x"] = torch.zeros(4, 2, dtype=torch.int64)
    with tensordict.set_printoptions(compact=False), tdc_set_printoptions(compact=False):
        assert repr(td) == repr(ref)


def test_locking():
    td = make().lock_()
    assert td.is_locked
    with pytest.raises(RuntimeError):
        td["new"] = torch.ones(4)
    td.set_("a", torch.ones(4))  # in-place writes still work
    assert td.unlock_().is_locked is False


PUBLIC = [name for name in dir(TensorDict) if not name.startswith("_")] + [
    "__getitem__", "__setitem__", "__delitem__", "__contains__", "__len__",
    "__eq__", "__ne__", "__iter__", "__repr__"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_method_has_a_docstring(name):
    doc = getattr(TensorDict, name).__doc__
    assert doc and len(doc.strip()) > 20, name


def test_the_class_docstring_explains_the_constructor():
    for arg in ("source (", "batch_size (", "device (", "**kwargs"):
        assert arg in TensorDict.__doc__


def test_help_of_send_explains_every_argument():
    text = pydoc.render_doc(TensorDict.send, renderer=pydoc.plaintext)
    for arg in ("dst", "group", "group_dst", "init_tag", "pseudo_rand", "consolidated"):
        assert f"{arg} (" in text, arg
    for method, args in ((TensorDict.recv, ("src", "group_src", "consolidated")),
                         (TensorDict.isend, ("return_early",)),
                         (TensorDict.irecv, ("return_premature",))):
        for arg in args:
            assert f"{arg} (" in method.__doc__, (method, arg)


def test_p2p_signatures_match_the_reference():
    import inspect

    for name in ("send", "recv", "isend", "irecv"):
        ours = inspect.signature(getattr(TensorDict, name))
        ref = inspect.signature(getattr(tensordict.TensorDict, name))
        # The reference's parameters, then our extensions `checked`, `timeout` and, for the
        # receives, `late`.
        late = [("late", inspect.Parameter.KEYWORD_ONLY, "deliver")] if "recv" in name else []
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in ref.parameters.values()] + [
            ("checked", inspect.Parameter.KEYWORD_ONLY, False),
            ("timeout", inspect.Parameter.KEYWORD_ONLY, None)] + late, name
