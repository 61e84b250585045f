"""TensorDict.from_module / to_module against the reference, on the same modules."""
import pytest
import tensordict
import torch
from torch import nn

from tensordict_cpp import TensorDict


def net():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return m


def layout(td):
    """Each entry's key, shape (or batch size) and data pointer, by key."""
    return sorted((k if isinstance(k, tuple) else (k,),
                   (tuple(v.shape), v.data_ptr()) if isinstance(v, torch.Tensor) else (tuple(v.batch_size),))
                  for k, v in td.items(include_nested=True))


@pytest.mark.parametrize("kwargs", [{}, {"filter_empty": False}, {"use_state_dict": True}, {"lock": True}])
def test_from_module_holds_the_modules_own_tensors_as_the_reference(kwargs):
    m = net()
    ours = TensorDict.from_module(m, **kwargs)
    ref = tensordict.TensorDict.from_module(m, **kwargs)
    assert layout(ours) == layout(ref)
    assert ours.batch_size == torch.Size([]) and ours.is_locked == ref.is_locked
    assert ours["0", "weight"] is m[0].weight or ours["0", "weight"].data_ptr() == m[0].weight.data_ptr()


def test_to_module_swaps_and_restores_as_the_reference():
    ours_m, ref_m = net(), net()
    zeros = TensorDict.from_module(ours_m).clone().zero_()
    ref_zeros = tensordict.TensorDict.from_module(ref_m).clone().zero_()
    old = zeros.to_module(ours_m)
    ref_old = ref_zeros.to_module(ref_m)
    assert (ours_m[0].weight == 0).all() and isinstance(ours_m[0].weight, nn.Parameter)
    assert ours_m[0].weight.requires_grad == ref_m[0].weight.requires_grad
    assert isinstance(ours_m[2].running_mean, torch.Tensor) and "running_mean" in ours_m[2]._buffers
    assert [k for k, _ in layout(old)] == [k for k, _ in layout(ref_old)]  # the old values' keys
    old.to_module(ours_m)
    assert torch.equal(ours_m[0].weight, net()[0].weight)
    y = ours_m.eval()(torch.ones(2, 3))
    assert y.shape == (2, 2)


def test_to_module_inplace_keeps_the_parameters():
    m = net()
    weight = m[0].weight
    before = weight.clone()
    ones = TensorDict.from_module(m).clone()
    ones["0", "weight"].fill_(1.0)
    old = ones.to_module(m, inplace=True)
    assert m[0].weight is weight and (weight == 1).all()
    assert torch.equal(old["0", "weight"], before)  # a copy of what was there
    assert ones.to_module(m, return_swap=False) is None


def test_to_module_errors_name_the_key():
    m = net()
    with pytest.raises(KeyError, match="'nope' is not a parameter or buffer of Linear"):
        TensorDict({"0": {"nope": torch.zeros(1)}}).to_module(m)
    with pytest.raises(KeyError, match="'9' is not a submodule of Sequential"):
        TensorDict({"9": {"weight": torch.zeros(1)}}).to_module(m)
    with pytest.raises(RuntimeError, match="memo cannot be passed"):
        TensorDict.from_module(m).to_module(m, memo={})
