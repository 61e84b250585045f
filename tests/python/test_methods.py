"""The everyday TensorDict methods (docs/api-coverage.md): each call runs on the reference and
on ours with the same data, and the results are compared (values, dtype, batch size, key
order); errors are the reference's exception types, and ours name the key."""
import numpy as np
import pytest
import tensordict as ref
import torch

import tensordict_cpp as ours


def data(lib):
    """Float, int and bool leaves, a nested level, batch size [2, 3]."""
    g = torch.Generator().manual_seed(0)
    return lib.TensorDict({
        "a": torch.randn(2, 3, generator=g),
        "b": torch.arange(24, dtype=torch.float64).view(2, 3, 4) - 10,
        "i": torch.arange(6, dtype=torch.int64).view(2, 3).clone(),  # not a view: detach_
        "n": {"x": torch.randn(2, 3, 5, generator=g), "m": torch.ones(2, 3, dtype=torch.bool)},
    }, batch_size=[2, 3])


def same(got, want):
    """Same type family, batch size, keys in order, values and dtypes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, (got, want)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
        return
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            same(g, w)
        return
    assert got.batch_size == want.batch_size
    assert list(got.keys(True, True)) == list(want.keys(True, True)), (
        list(got.keys(True, True)), list(want.keys(True, True)))
    for key in want.keys(True, True):
        same(got[key], want[key])


# (name, call): the same call on either library's data
CALLS = {
    "select": lambda td: td.select("a", ("n", "x")),
    "select_not_strict": lambda td: td.select("a", "zz", strict=False),
    "exclude": lambda td: td.exclude("b", ("n", "m"), "zz"),
    "flatten_keys": lambda td: td.flatten_keys(),
    "flatten_keys_sep": lambda td: td.flatten_keys("/"),
    "unflatten_keys": lambda td: td.flatten_keys().unflatten_keys(),
    "filter_non_tensor_data": lambda td: td.filter_non_tensor_data(),
    "empty_recurse": lambda td: td.empty(recurse=True),
    "copy": lambda td: td.copy(),
    "clone_no_recurse": lambda td: td.clone(recurse=False),
    "chunk": lambda td: td.chunk(2, dim=1),
    "flatten": lambda td: td.flatten(0, 1),
    "unflatten": lambda td: td.flatten(0, 1).unflatten(0, (3, 2)),
    "permute": lambda td: td.permute(1, 0),
    "transpose": lambda td: td.transpose(0, 1),
    "split": lambda td: td.split([1, 2], dim=1),
    "reshape": lambda td: td.reshape(6),
    "view": lambda td: td.view(-1),
    "masked_fill": lambda td: td.masked_fill(torch.tensor([[True, False, True], [False] * 3]), 0),
    "where": lambda td: td.float().where(torch.tensor([[True, False, True], [False] * 3]),
                                         td.float() * 0),
    "where_scalar": lambda td: td.float().where(torch.tensor([True, False]).view(2, 1).expand(2, 3),
                                                -1.0),
    "detach": lambda td: td.detach(),
    "abs": lambda td: td.exclude(("n", "m")).abs(),
    "isfinite": lambda td: td.isfinite(),
    "sum": lambda td: td.exclude(("n", "m")).sum(),
    "sum_dim": lambda td: td.exclude(("n", "m")).sum(dim=0),
    "sum_dims_keepdim": lambda td: td.exclude(("n", "m")).sum(dim=(0, 1), keepdim=True),
    "sum_feature": lambda td: td.exclude(("n", "m")).sum(dim="feature"),
    "sum_reduce": lambda td: td.exclude(("n", "m"), "i").sum(reduce=True),
    "mean": lambda td: td.exclude(("n", "m"), "i").mean(dim=1),
    "mean_reduce": lambda td: td.exclude(("n", "m"), "i").mean(reduce=True),
    "std": lambda td: td.exclude(("n", "m"), "i").std(dim=0),
    "std_correction": lambda td: td.exclude(("n", "m"), "i").std(dim=1, correction=0),
    "max": lambda td: td.exclude(("n", "m")).max(),
    "max_dim": lambda td: tuple(td.exclude(("n", "m")).max(dim=1)),
    "min_dim": lambda td: tuple(td.exclude(("n", "m")).min(dim=0, keepdim=True)),
    "max_reduce": lambda td: td.exclude(("n", "m")).max(reduce=True),
    "add": lambda td: td.float() + td.float(),
    "sub_scalar": lambda td: td.float() - 1.5,
    "mul_tensor": lambda td: td.float() * torch.tensor(2.0),
    "div": lambda td: td.float() / 4,
    "radd": lambda td: 1 + td.float(),
    "rsub": lambda td: 1 - td.float(),
    "float": lambda td: td.float(),
    "double": lambda td: td.double(),
    "half": lambda td: td.half(),
    "bfloat16": lambda td: td.bfloat16(),
    "int": lambda td: td.int(),
    "bool": lambda td: td.bool(),
    "cpu": lambda td: td.cpu(),
    "to_dtype": lambda td: td.to(torch.float16),
    "get_at": lambda td: td.get_at(("n", "x"), (1, slice(0, 2))),
    "apply_batch_size": lambda td: td.apply(lambda t: t[0], batch_size=[3]),
}


def test_keys_with_is_leaf_match_the_reference():
    def is_leaf(cls):  # nested TensorDicts are leaves
        return cls.__name__ in ("Tensor", "TensorDict")
    for args in ((True, True), (True, False), (False, False)):
        assert data(ours).keys(*args, is_leaf=is_leaf) == list(data(ref).keys(*args, is_leaf=is_leaf))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_same_result_as_the_reference(name):
    same(CALLS[name](data(ours)), CALLS[name](data(ref)))


# In-place methods: the same call on both, then the TensorDicts compared.
IN_PLACE = {
    "rename_key_": lambda td: td.rename_key_("a", ("n", "renamed")),
    "setdefault_absent": lambda td: td.setdefault("new", torch.zeros(2, 3)),
    "setdefault_present": lambda td: td.setdefault("a", torch.zeros(2, 3)),
    "del_": lambda td: td.del_(("n", "m")),
    "update_": lambda td: td.update_({"a": torch.zeros(2, 3)}),
    "update_inplace": lambda td: td.update({"a": torch.ones(2, 3)}, inplace=True),
    "set_at_": lambda td: td.set_at_("a", torch.tensor(9.0), (0, 1)),
    "copy_": lambda td: td.copy_(td.clone().zero_()),
    "select_inplace": lambda td: td.select("a", "n", inplace=True),
    "exclude_inplace": lambda td: td.exclude("a", inplace=True),
    "apply_": lambda td: td.exclude(("n", "m")).apply_(lambda t: t * 2),
    "masked_fill_": lambda td: td.masked_fill_(torch.tensor([[True, False, True], [False] * 3]),
                                               -5),
    "detach_": lambda td: td.detach_(),
    "add_": lambda td: td.exclude(("n", "m"), "i").add_(td.exclude(("n", "m"), "i"), alpha=2),
    "add_scalar": lambda td: td.exclude(("n", "m"), "i").add_(1.5),
    "mul_": lambda td: td.exclude(("n", "m"), "i").mul_(3),
    "lerp_": lambda td: td.exclude(("n", "m"), "i").lerp_(td.exclude(("n", "m"), "i") * 0, 0.25),
    "flatten_keys_inplace": lambda td: td.flatten_keys(inplace=True),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_in_place_methods_match_the_reference(name):
    mine, theirs = data(ours), data(ref)
    r_mine, r_theirs = IN_PLACE[name](mine), IN_PLACE[name](theirs)
    same(mine, theirs)
    if isinstance(r_theirs, torch.Tensor):
        same(r_mine, r_theirs)
    elif r_theirs is theirs:
        assert r_mine is mine


def test_long_is_the_references_to_int64():  # the reference has no long()
    same(data(ours).long(), data(ref).to(torch.int64))


def test_named_apply_and_conversions_match_the_reference():
    for nested in (False, True):
        fn = lambda k, t: t + len(k)  # noqa: E731  str length or tuple length
        same(data(ours).named_apply(fn, nested_keys=nested),
             data(ref).named_apply(fn, nested_keys=nested))
    mine, theirs = data(ours).to_dict(), data(ref).to_dict()
    assert list(mine) == list(theirs) and list(mine["n"]) == list(theirs["n"])
    assert torch.equal(mine["n"]["x"], theirs["n"]["x"])
    d = {"a": torch.zeros(4, 3), "n": {"b": torch.ones(4, 3, 2)}}
    same(ours.TensorDict.from_dict(d, auto_batch_size=True),
         ref.TensorDict.from_dict(d, auto_batch_size=True))
    same(ours.TensorDict.from_dict(d, batch_size=[4]), ref.TensorDict.from_dict(d, batch_size=[4]))
    small = lambda lib: lib.TensorDict({"a": torch.arange(2)}, [2])  # noqa: E731
    assert small(ours).tolist() == [{"a": torch.tensor(0)}, {"a": torch.tensor(1)}] or \
        str(small(ours).tolist()) == str(small(ref).tolist())
    np.testing.assert_array_equal(data(ours).numpy()["n"]["x"], data(ref).numpy()["n"]["x"])
    assert ours.is_tensor_collection(data(ours)) and ours.is_tensor_collection(ours.TensorDict)
    assert ours.is_tensor_collection(data(ref)) and not ours.is_tensor_collection(torch.zeros(1))


def test_shared_memory_matches_the_reference():
    mine, theirs = data(ours), data(ref)
    assert mine.is_shared() == theirs.is_shared() is False
    mine.share_memory_(), theirs.share_memory_()
    assert mine.is_shared() and theirs.is_shared()
    assert mine.is_locked and theirs.is_locked
    same(mine, theirs)


def test_torch_stack_and_cat_take_ours():
    same(torch.stack([data(ours), data(ours)], 1), torch.stack([data(ref), data(ref)], 1))
    same(torch.cat([data(ours), data(ours)], 0), torch.cat([data(ref), data(ref)], 0))


# ---- errors: the reference's exception type; ours name the key --------------------------------
@pytest.mark.parametrize("call, kind, words", [
    (lambda td: td.select("zz"), KeyError, "zz"),
    (lambda td: td.rename_key_("zz", "y"), KeyError, "zz"),
    (lambda td: td.rename_key_("a", "b", safe=True), KeyError, "'b'"),
    (lambda td: td.update_({"zz": torch.zeros(2, 3)}), KeyError, "zz"),
    (lambda td: td.set_at_("zz", 1.0, 0), KeyError, "zz"),
    (lambda td: td.permute(0, 0), ValueError, "repeated dim"),
    (lambda td: td.permute(0, 1, 2), ValueError, "expected 2 dims"),
    (lambda td: td.transpose(0, 5), ValueError, "range of the batch dims"),
    (lambda td: td.chunk(0), ValueError, "chunks"),
    (lambda td: td.masked_fill(torch.ones(5, dtype=torch.bool), 0), RuntimeError,
     "must match the existing size"),
    (lambda td: td.unflatten(0, (5,)), RuntimeError, "don't multiply up"),
])
def test_errors(call, kind, words):
    with pytest.raises(kind):
        call(data(ref))
    with pytest.raises(kind, match=words):
        call(data(ours))


def test_get_at_of_a_missing_key_names_it():  # the reference returns None there
    assert data(ref).get_at("zz", 0) is None
    with pytest.raises(KeyError, match="zz"):
        data(ours).get_at("zz", 0)


def test_reduce_of_an_unknown_reduction_is_a_value_error():  # the binding's name -> Reduction
    td = data(ours)
    for reduce in (True, False):
        with pytest.raises(ValueError, match="unknown reduction 'median'"):
            td._cpp.reduction("median", None, False, None, 1, reduce)
