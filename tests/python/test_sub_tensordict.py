"""The sub-tensordict view (the reference's _SubTensorDict, reached as td._get_sub_tensordict):
reads and writes against the reference's, and receives that land in a parent's rows, with the
reference sending from the other rank."""
import pytest
import tensordict
import torch
import torch.distributed as dist

import tensordict_cpp


def parent(lib):
    return lib.TensorDict(a=torch.zeros(4, 3), b={"c": torch.zeros(4), "d": {"e": torch.zeros(4, 2)}},
                          batch_size=[4])


INDICES = [slice(1, 3), 2, torch.tensor([3, 0]), torch.tensor([True, False, True, False]), (Ellipsis,)]


@pytest.mark.parametrize("index", INDICES, ids=["slice", "int", "tensor", "mask", "ellipsis"])
def test_writes_land_in_the_parent_as_the_reference(index):
    results = []
    for lib in (tensordict, tensordict_cpp):
        td = parent(lib)
        sub = td._get_sub_tensordict(index)
        n = sub.batch_size
        sub.set_("a", torch.full((*n, 3), 1.0))
        sub.set_("b", lib.TensorDict(c=torch.full(n, 2.0), batch_size=n))
        sub.update_({("b", "d", "e"): torch.full((*n, 2), 3.0)})
        sub["new"] = torch.full(n, 4.0)  # a new key: zeros elsewhere in the parent
        results.append((td, sub))
    (ref, ref_sub), (ours, sub) = results
    assert sub.batch_size == ref_sub.batch_size
    for key in ("a", ("b", "c"), ("b", "d", "e"), "new"):
        assert torch.equal(ours[key], ref[key]), key
        assert torch.equal(sub[key], ref_sub[key]), key
    assert repr(sub) == repr(ref_sub)
    assert sub.to_tensordict()["a"].data_ptr() != ours["a"].data_ptr()
    assert not sub.is_consolidated()


def test_errors_as_the_reference():
    td = parent(tensordict_cpp)
    with pytest.raises(IndexError):
        td._get_sub_tensordict(7)
    with pytest.raises(RuntimeError, match="Lock the parent"):
        td._get_sub_tensordict(0).lock_()
    td.lock_()
    with pytest.raises(RuntimeError):
        td._get_sub_tensordict(0)["brand_new"] = torch.zeros(())
    td._get_sub_tensordict(0).set_("a", torch.ones(3))  # in place works on a locked parent
    assert td["a"][0].eq(1).all()


def rows(lib, value):
    return lib.TensorDict(a=torch.full((2, 3), value), b={"c": torch.full((2,), value),
                                                          "d": {"e": torch.full((2, 2), value)}},
                          batch_size=[2])


RECV_CASES = [(slice(1, 3), "recv"), (slice(2, 4), "irecv"), (slice(0, 2), "premature"),
              (torch.tensor([3, 0]), "recv"), (torch.tensor([False, True, False, True]), "irecv"),
              (slice(1, 3), "consolidated"), (torch.tensor([2, 1]), "consolidated")]


def receive_rows(rank, world_size):
    torch.set_num_threads(1)
    # The reference sends from rank 0; ours receives into the rows of a larger TensorDict.
    for i, (index, how) in enumerate(RECV_CASES):
        if rank == 0:
            td = rows(tensordict, float(i + 1))
            if how == "consolidated":
                td.consolidate().send(dst=1, consolidated=True)
            elif how == "recv":
                td.send(dst=1)
            else:
                td.isend(dst=1)
        else:
            buf = parent(tensordict_cpp)
            before = buf["a"].data_ptr()
            sub = buf._get_sub_tensordict(index)
            if how == "consolidated":
                sub.recv(src=0, consolidated=True)
            elif how == "recv":
                sub.recv(src=0)
            elif how == "irecv":
                sub.irecv(src=0)
            else:
                for work in sub.irecv(src=0, return_premature=True):
                    work.wait()
            chosen = torch.zeros(4, dtype=torch.bool)
            chosen[index] = True
            for key in ("a", ("b", "c"), ("b", "d", "e")):
                assert buf[key][chosen].eq(i + 1).all(), (how, key)
                assert buf[key][~chosen].eq(0).all(), (how, key)
            assert buf["a"].data_ptr() == before  # the parent's storage, not a new one
    # Ours sends from rows; the reference receives into its own rows.
    if rank == 1:
        src = parent(tensordict_cpp)
        src["a"][1:3] = 7.0
        src._get_sub_tensordict(slice(1, 3)).send(dst=0)
    else:
        buf = parent(tensordict)
        buf._get_sub_tensordict(slice(0, 2)).recv(src=1)
        assert buf["a"][:2].eq(7).all() and buf["a"][2:].eq(0).all()
    dist.barrier()


def test_receives_land_in_the_parents_rows():
    from tensordict_cpp.distributed import run

    run(receive_rows, world_size=2, timeout=120, group_timeout=20)


def test_premature_irecv_refused_for_advanced_indices():
    td = parent(tensordict_cpp)
    with pytest.raises(ValueError, match="index tensor or mask"):
        td._get_sub_tensordict(torch.tensor([0, 1])).irecv(src=0, return_premature=True)
