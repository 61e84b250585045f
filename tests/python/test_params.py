"""TensorDictParams against the reference's tensordict.nn.TensorDictParams: registration,
conversion, locking, from_module(as_module=True), and weight synchronisation with the
reference's TensorDictParams on the other rank, both ways, into live modules."""
import pickle

import pytest
import tensordict
import torch
import torch.distributed as dist
from torch import nn

from reference_peer import REFERENCES, on_reference
import tensordict_cpp
from tensordict_cpp import TensorDictParams

RefParams = tensordict.nn.TensorDictParams


def entries(lib):
    return lib.TensorDict(a=torch.zeros(3), b={"c": torch.zeros(2, dtype=torch.long),
                                               "d": torch.ones(1, dtype=torch.float64),
                                               "h": torch.zeros(2, dtype=torch.bfloat16)})


def names(module):
    return ([n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()])


@pytest.mark.parametrize("no_convert", [False, True])
def test_registration_as_the_reference(no_convert):
    ref = RefParams(entries(tensordict), no_convert=no_convert)
    ours = TensorDictParams(entries(tensordict_cpp), no_convert=no_convert)
    assert names(ours) == names(ref)
    assert repr(ours) == repr(ref)
    for key in ref.keys(True, True):
        assert type(ours[key]).__name__ == type(ref[key]).__name__, key
        assert ours[key].requires_grad == ref[key].requires_grad, key
    holder, ref_holder = nn.Module(), nn.Module()
    holder.params, ref_holder.params = ours, ref
    assert names(holder) == names(ref_holder)
    assert list(holder.state_dict()) == list(ref_holder.state_dict())
    assert isinstance(ours, tensordict_cpp.TensorDict) and isinstance(ours, nn.Module)


def test_leaves_are_the_registered_parameters():
    td = entries(tensordict_cpp)
    params = TensorDictParams(td)
    assert params["a"] is params._parameters["a"] and params["b", "d"] is params._parameters["b.d"]
    assert params["a"].data_ptr() == td["a"].data_ptr()  # shares the storage, no copy
    params["x"] = torch.ones(2)  # a write registers it, converted
    assert isinstance(params["x"], nn.Parameter) and "x" in dict(params.named_parameters())
    del params["x"]
    assert "x" not in dict(params.named_parameters())
    params.update({"y": torch.ones(1, dtype=torch.int32)})
    assert "y" in dict(params.named_buffers())
    clone = params.clone()
    assert type(clone) is TensorDictParams and clone["a"].data_ptr() != params["a"].data_ptr()
    assert names(clone) == names(params)
    assert TensorDictParams(params)._parameters["a"] is params["a"]  # shared registrations
    assert type(params.data) is tensordict_cpp.TensorDict and not params.data["a"].requires_grad


def test_lock_as_the_reference():
    for lib, cls in ((tensordict, RefParams), (tensordict_cpp, TensorDictParams)):
        params = cls(entries(lib), lock=True)
        assert not params.is_locked and params._param_td.is_locked
        params["x"] = torch.ones(2)  # writes through the module work on a locked content
        params.lock_()
        with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
            params["y"] = torch.ones(2)
        with pytest.raises(ValueError):
            params.unlock_().set("self", params)


def test_from_module_as_module_keeps_the_modules_parameters():
    for lib in (tensordict, tensordict_cpp):
        module = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        params = lib.TensorDict.from_module(module, as_module=True)
        assert type(params).__name__ == "TensorDictParams" and params.no_convert
        assert params["0", "weight"] is module[0].weight
        assert params["1", "running_mean"].data_ptr() == module[1].running_mean.data_ptr()
    ref = tensordict.TensorDict.from_module(module, as_module=True)
    ours = tensordict_cpp.TensorDict.from_module(module, as_module=True)
    assert names(ours) == names(ref)
    converted = TensorDictParams(tensordict_cpp.TensorDict.from_module(module))
    assert names(converted) == names(RefParams(tensordict.TensorDict.from_module(module)))
    assert tensordict_cpp.TensorDict(ref)["0", "weight"] is module[0].weight  # zero-copy


# ---- weight synchronisation across processes ----------------------------------------------------

def policy(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.BatchNorm1d(2))


def expected_output(x):
    sender = policy(0)
    sender.eval()
    return sender(x)


def receive_into(lib, how, src):
    """A live policy with other weights, its optimizer, and a receive of the sender's."""
    module = policy(1)
    module.eval()
    params = lib.TensorDict.from_module(module, as_module=True)
    optim = torch.optim.SGD(module.parameters(), lr=0.5)
    before = [id(p) for p in module.parameters()]
    getattr(params, how)(src=src)
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    torch.testing.assert_close(module(x), expected_output(x), rtol=0, atol=0)
    assert [id(p) for p in module.parameters()] == before  # the same Parameter objects
    assert optim.param_groups[0]["params"][0] is module[0].weight
    module(x).sum().backward()
    optim.step()  # the optimizer holds the received values
    assert not torch.equal(module[0].weight, policy(0)[0].weight)


def sync(rank, world_size):
    torch.set_num_threads(1)
    lib = tensordict if rank == 0 else tensordict_cpp
    for sender, how in ((0, "recv"), (1, "recv"), (0, "irecv"), (1, "irecv")):
        if rank == sender:
            module = policy(0)
            params = (RefParams(tensordict.TensorDict.from_module(module)) if lib is tensordict
                      else TensorDictParams(tensordict_cpp.TensorDict.from_module(module)))
            params.send(dst=1 - rank) if how == "recv" else params.isend(dst=1 - rank)
        else:
            receive_into(lib, how, sender)
    dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_weight_sync_with_the_reference_both_ways(reference):
    from tensordict_cpp.distributed import run

    run(on_reference(reference, sync), world_size=2, timeout=120, group_timeout=20)


# ---- torch.load(weights_only=True) ---------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"no_convert": True}, {"lock": True}, {"locked": True}])
def test_torch_load_weights_only_round_trip(options):
    import io

    module = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    locked = options.pop("locked", False)
    params = TensorDictParams(tensordict_cpp.TensorDict.from_module(module), **options)
    if locked:
        params.lock_()
    buffer = io.BytesIO()
    torch.save(params, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=True)  # _rebuild_params is allowlisted
    assert type(back) is TensorDictParams and names(back) == names(params)
    for key in params.keys(True, True):
        assert type(back[key]) is type(params[key]), key  # Parameters come back as Parameters
        assert back[key].requires_grad == params[key].requires_grad, key
        assert torch.equal(back[key], params[key]), key
    assert back.no_convert == params.no_convert and back._lock_content == params._lock_content
    assert back.is_locked == locked and back._param_td.is_locked == params._param_td.is_locked
    # The reference's TensorDictParams is not allowlisted: its file needs weights_only=False.
    ref = RefParams(tensordict.TensorDict.from_module(module))
    buffer = io.BytesIO()
    torch.save(ref, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="TensorDictParams"):
        torch.load(buffer, weights_only=True)


class _Forged:
    """A pickle naming the allowlisted _rebuild_params with arguments it never writes."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        from tensordict_cpp.nn import _rebuild_params

        return _rebuild_params, self.args


@pytest.mark.parametrize("args, error, match", [
    (({"w": torch.zeros(2)}, False, False, False), TypeError, "expected a TensorDict .* got dict"),
    ((torch.zeros(2), False, False, False), TypeError, "expected a TensorDict .* got Tensor"),
    (("td", "yes", False, False), ValueError, "no_convert must be a bool or 'skip', got 'yes'"),
    (("td", torch.ones(1), False, False), ValueError, "no_convert .* got Tensor"),
    (("td", False, 1, False), TypeError, "lock must be a bool, got int"),
    (("td", False, False, "no"), TypeError, "locked must be a bool, got str"),
])
def test_a_forged_params_pickle_is_refused(args, error, match):
    import io

    td = tensordict_cpp.TensorDict(w=torch.zeros(2))
    buffer = io.BytesIO()
    torch.save(_Forged(*(td if a == "td" else a for a in args)), buffer)
    buffer.seek(0)
    with pytest.raises(error, match=match):
        torch.load(buffer, weights_only=True)


# ---- a receive into Parameters bumps their versions --------------------------------------------

def stale_graph(rank, world_size):
    """Rank 1 builds a graph with its policy's parameters, then receives into them: autograd
    must refuse the backward (ours), where the reference computes it from the new values."""
    torch.set_num_threads(1)
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    cases = ("recv", "irecv", "checked", "all_reduce", "bucketed", "reference")
    for case in cases:
        module = policy(rank)
        lib = tensordict if case == "reference" and rank == 1 else tensordict_cpp
        params = lib.TensorDict.from_module(module, as_module=True)
        p2p = case in ("recv", "irecv", "checked", "reference")
        if p2p and rank == 0:
            params.send(dst=1, checked=case == "checked")
            continue
        out = module(x).sum()  # saves the second Linear's weight (its input requires grad)
        if case == "all_reduce":
            params.all_reduce()
        elif case == "bucketed":  # the values reach the leaves by memcpy from the bucket
            for w in params.all_reduce(async_op=True, bucket_bytes=1 << 20):
                w.wait()
        elif case == "irecv":
            params.irecv(src=0)
        elif case == "checked":
            params.recv(src=0, checked=True)
        else:
            params.recv(src=0)
        if case == "reference":
            out.backward()  # silently uses the received weights
            continue
        with pytest.raises(RuntimeError, match="one of the variables needed for gradient "
                                               "computation has been modified by an inplace "
                                               "operation"):
            out.backward()
    dist.barrier()


def test_a_receive_into_parameters_bumps_their_versions():
    from tensordict_cpp.distributed import run

    run(stale_graph, world_size=2, timeout=120, group_timeout=20)
