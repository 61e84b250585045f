"""A tensordict_cpp process and a reference-tensordict process exchange TensorDicts both ways,
per leaf (sequential and pseudo-random tags), asynchronously, and consolidated; the reference
is 0.15.3 and 0.14.3 in turn (reference_peer.py)."""

import pytest
import torch
import torch.distributed as dist

from reference_peer import REFERENCES, on_reference
from tensordict_cpp.distributed import run

REF, OURS = 0, 1  # rank 0 runs the reference tensordict, rank 1 ours


def build(cls, fill):
    # Keys out of code-point order at both levels, several dtypes: the wire order matters.
    td = cls({"b": torch.full((3, 2), fill), "a": torch.full((3,), fill),
              "_": torch.full((3,), bool(fill)), "B": torch.full((3, 4), fill, dtype=torch.float64)},
             batch_size=[3])
    td["c", "z"] = torch.full((3, 5), fill, dtype=torch.int32)
    td["c", "y"] = torch.full((3,), fill, dtype=torch.float16)
    return td


def check(td, fill):
    leaves = list(td.values(include_nested=True, leaves_only=True))
    assert len(leaves) == 6
    for leaf in leaves:
        assert (leaf == torch.tensor(fill).to(leaf.dtype)).all(), leaf


def exchange(rank, world_size):
    torch.set_num_threads(1)
    if rank == REF:
        from tensordict import TensorDict
    else:
        from tensordict_cpp import TensorDict
    peer = 1 - rank
    fill = 0
    for sender in (REF, OURS):
        for kw in ({}, {"init_tag": 11}, {"init_tag": 4, "pseudo_rand": True}):
            fill += 1
            if rank == sender:
                build(TensorDict, fill).send(dst=peer, **kw)
            else:
                td = build(TensorDict, 0)
                td.recv(src=peer, **kw)
                check(td, fill)
        # isend with early Work handles against a blocking irecv, and the other way round.
        fill += 1
        if rank == sender:
            for w in build(TensorDict, fill).isend(dst=peer, init_tag=20, return_early=True):
                w.wait()
        else:
            td = build(TensorDict, 0)
            td.irecv(src=peer, init_tag=20)
            check(td, fill)
        fill += 1
        if rank == sender:
            build(TensorDict, fill).isend(dst=peer, pseudo_rand=True)
        else:
            td = build(TensorDict, 0)
            for w in td.irecv(src=peer, pseudo_rand=True, return_premature=True):
                w.wait()
            check(td, fill)
        # Consolidated: one message with the reference's byte layout.
        fill += 1
        if rank == sender:
            build(TensorDict, fill).send(dst=peer, consolidated=True)
        else:
            td = build(TensorDict, 0).consolidate(metadata=True)
            td.recv(src=peer, consolidated=True)
            check(td, fill)
        # With a standalone-style peer: group ranks on the default group.
        fill += 1
        group = dist.distributed_c10d._get_default_group()
        if rank == sender:
            build(TensorDict, fill).send(group=group, group_dst=peer)
        else:
            td = build(TensorDict, 0)
            td.recv(group=group, group_src=peer)
            check(td, fill)
    dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_reference_and_ours_exchange_both_ways(reference):
    run(on_reference(reference, exchange), world_size=2, timeout=120, group_timeout=20)
