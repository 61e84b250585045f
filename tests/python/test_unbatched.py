"""UnbatchedTensor leaves against the reference: the batch-size rules of every shape operation,
what consolidation says, and the per-leaf transfers and reductions with the reference on the
other rank (the pipe's "unbatched" header entries: test_pipe_interop.py)."""
import pytest
import tensordict
import torch
import torch.distributed as dist

from reference_peer import REFERENCES, on_reference
import tensordict_cpp


def make(lib):
    return lib.TensorDict(a=torch.arange(24.0).reshape(4, 3, 2),
                          u=lib.UnbatchedTensor(torch.arange(10.0).reshape(5, 2)), batch_size=[4, 3])


def lazy(lib, td):
    return (tensordict_cpp.lazy_stack([td, td]) if lib is tensordict_cpp
            else tensordict.LazyStackedTensorDict.lazy_stack([td, td]))


OPS = {
    "int": lambda lib, td: td[0], "slice": lambda lib, td: td[1:3],
    "tensor": lambda lib, td: td[torch.tensor([0, 2])],
    "mask": lambda lib, td: td[torch.tensor([True, False, True, True])],
    "stack": lambda lib, td: torch.stack([td, td]), "cat": lambda lib, td: torch.cat([td, td]),
    "lazy_stack": lazy, "unsqueeze": lambda lib, td: td.unsqueeze(0),
    "squeeze": lambda lib, td: td.unsqueeze(0).squeeze(0), "reshape": lambda lib, td: td.reshape(12),
    "view": lambda lib, td: td.view(-1), "permute": lambda lib, td: td.permute(1, 0),
    "transpose": lambda lib, td: td.transpose(0, 1), "expand": lambda lib, td: td.expand(2, 4, 3),
    "flatten": lambda lib, td: td.flatten(0, 1), "unbind": lambda lib, td: td.unbind(0)[1],
    "split": lambda lib, td: td.split(2)[0], "clone": lambda lib, td: td.clone(),
    "apply": lambda lib, td: td.apply(lambda x: x * 2), "to_dict": lambda lib, td: td.to_dict(),
    "select": lambda lib, td: td.select("u"), "exclude": lambda lib, td: td.exclude("a"),
    "zero_": lambda lib, td: td.zero_(), "eq": lambda lib, td: td == td,
    "sum": lambda lib, td: td.sum(), "empty": lambda lib, td: td.empty(),
    "double": lambda lib, td: td.double(), "detach": lambda lib, td: td.detach(),
    "shrink_batch": lambda lib, td: (setattr(td, "batch_size", [4]), td)[1],
    "set_new": lambda lib, td: td.set("v", lib.UnbatchedTensor(torch.zeros(7))),
}


def describe(x):
    if isinstance(x, dict):
        return {k: describe(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return type(x).__name__, tuple(x.shape), float(x.double().sum())
    return (type(x).__name__.replace("LazyStackedTensorDict", "Lazy"), tuple(x.batch_size),
            {str(k): describe(x.get(k)) for k in sorted(x.keys())})


@pytest.mark.parametrize("op", OPS)
def test_batch_size_rules_as_the_reference(op):
    assert describe(OPS[op](tensordict_cpp, make(tensordict_cpp))) == \
        describe(OPS[op](tensordict, make(tensordict)))


def test_repr_and_conversion_as_the_reference():
    ref, ours = make(tensordict), make(tensordict_cpp)
    assert repr(ours) == repr(ref)
    assert type(tensordict_cpp.TensorDict(ref)["u"]) is tensordict_cpp.UnbatchedTensor
    back = ours.to_reference()  # the reference object, sharing the leaves
    assert type(back["u"]) is tensordict.UnbatchedTensor
    assert back["u"].data_ptr() == ours["u"].data_ptr()  # zero-copy both ways
    assert tensordict_cpp.TensorDict(ref)["u"].data_ptr() == ref["u"].data_ptr()


def test_consolidate_refuses_as_the_reference():
    with pytest.raises(NotImplementedError, match="'u' is one"):
        make(tensordict_cpp).consolidate()
    with pytest.raises(NotImplementedError, match="'u' is one"):
        make(tensordict).consolidate()


def transfers(rank, world_size):
    torch.set_num_threads(1)
    lib = tensordict if rank == 0 else tensordict_cpp
    for sender, how in ((0, "send"), (1, "send"), (0, "isend"), (1, "isend")):
        if rank == sender:
            td = make(lib)
            td["u"] += 100
            td.send(dst=1 - rank) if how == "send" else td.isend(dst=1 - rank)
        else:
            td = make(lib)
            td.recv(src=sender) if how == "send" else td.irecv(src=sender)
            assert type(td.get("u")).__name__ == "UnbatchedTensor"
            assert torch.equal(td["u"], torch.arange(10.0).reshape(5, 2) + 100), (sender, how)
    td = make(lib)
    td.all_reduce()
    assert torch.equal(td["u"], 2 * torch.arange(10.0).reshape(5, 2))
    assert torch.equal(td["a"], 2 * torch.arange(24.0).reshape(4, 3, 2))
    dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_per_leaf_transfers_with_the_reference_on_the_other_rank(reference):
    from tensordict_cpp.distributed import run

    run(on_reference(reference, transfers), world_size=2, timeout=120, group_timeout=20)
