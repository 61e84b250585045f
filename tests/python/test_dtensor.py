"""DTensor leaves (a module sharded with torch.distributed.tensor): from_module keeps them, as
the reference; every transfer refuses them with NotImplementedError naming the key (the
reference's own failure type), before anything is sent, and their local shards travel; memmap
writes their full tensors, as the reference."""
import pytest
import tensordict
import torch
import torch.distributed as dist

import tensordict_cpp


def sharded_linear(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
    return module


def dtensors(rank, world_size):
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    module = sharded_linear(world_size)
    for lib in (tensordict, tensordict_cpp):
        td = lib.TensorDict.from_module(module)
        assert isinstance(td["weight"], DTensor) and td["weight"] is module.weight
        with pytest.raises(NotImplementedError, match="DTensor is not supported yet"):
            td.consolidate()
    td = tensordict_cpp.TensorDict.from_module(module)
    peer = 1 - rank
    for call in (lambda: td.send(dst=peer) if rank == 0 else td.recv(src=peer),
                 lambda: td.isend(dst=peer) if rank == 0 else td.irecv(src=peer),
                 lambda: td.all_reduce(), lambda: td.reduce(dst=0),
                 lambda: td.init_remote(dst=peer) if rank == 0 else None,
                 lambda: td.broadcast(src=0) if rank == 0 else None):
        try:
            call()
        except NotImplementedError as e:
            assert "leaf 'weight'" in str(e) and "DTensor" in str(e), e
        else:
            assert rank == 1, "rank 0 always has a refused call"
    # memmap writes the full tensor (a collective), as the reference's.
    for lib in (tensordict, tensordict_cpp):
        mapped = lib.TensorDict.from_module(module).memmap()
        assert torch.equal(mapped["weight"], module.weight.full_tensor()), lib.__name__
    # What travels instead: the local shards, as plain tensors.
    local = td.apply(lambda t: t.to_local() if isinstance(t, DTensor) else t)
    ref = tensordict.TensorDict.from_module(module).apply(
        lambda t: torch.zeros_like((t.to_local() if isinstance(t, DTensor) else t).detach()))
    if rank == 0:
        local.send(dst=1)
    else:
        ref.recv(src=0)
        assert torch.equal(ref["weight"], sharded_linear_shard(0, world_size))
    dist.barrier()


def sharded_linear_shard(rank, world):
    torch.manual_seed(0)
    full = torch.nn.Linear(4, 4).weight.detach()
    return full.chunk(world)[rank]


def test_dtensor_leaves_are_refused_by_name():
    from tensordict_cpp.distributed import run

    run(dtensors, world_size=2, timeout=120, group_timeout=20)
