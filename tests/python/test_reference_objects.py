"""The user's own reference tensordict objects, zero-copy both ways: converted to ours and back
sharing the leaves, and passed straight to our transfers, which write into their tensors."""
import pytest
import tensordict
import torch

from reference_peer import REFERENCES, on_reference
import tensordict_cpp
from tensordict_cpp import NonTensorData, TensorDict
from tensordict_cpp.distributed import run


def reference_td():
    td = tensordict.TensorDict({"a": torch.arange(6.0).view(3, 2), "b": torch.zeros(3)}, [3])
    td["n", "x"] = torch.ones(3, 4, dtype=torch.int32)
    td["label"] = "hello"  # a non-tensor entry
    return td


def test_a_reference_tensordict_converts_sharing_its_leaves():
    ref = reference_td()
    for ours in (TensorDict(ref), TensorDict.from_tensordict(ref)):
        assert ours.batch_size == torch.Size([3]) and ours["n"].batch_size == torch.Size([3])
        assert ours.keys() == ["a", "b", "n", "label"]
        assert ours["a"] is ref["a"] or ours["a"].data_ptr() == ref["a"].data_ptr()
        assert ours["n", "x"].data_ptr() == ref["n", "x"].data_ptr()
        assert ours["label"] == "hello" and isinstance(ours.get("label"), NonTensorData)
    ours = TensorDict(ref)
    ours["a"].fill_(7.0)  # in place: the reference sees it
    assert (ref["a"] == 7.0).all()
    locked = TensorDict(reference_td().lock_())
    assert locked.is_locked and locked["n"].is_locked
    assert TensorDict.from_tensordict(ours) is ours


def test_ours_converts_to_the_reference_sharing_its_leaves():
    ours = TensorDict({"a": torch.ones(2, 3), ("n", "x"): torch.zeros(2)}, batch_size=[2])
    ours.set_non_tensor("s", "text")
    ref = ours.to_reference()
    assert isinstance(ref, tensordict.TensorDict)
    assert ref.batch_size == torch.Size([2]) and ref["n"].batch_size == torch.Size([2])
    assert ref["a"].data_ptr() == ours["a"].data_ptr()
    assert ref["s"] == "text"
    assert list(ref.keys()) == ["a", "n", "s"]
    back = TensorDict(ref)
    assert back["n", "x"].data_ptr() == ours["n", "x"].data_ptr()


def test_a_reference_tensorclass_converts_through_its_tensordict():
    @tensordict.tensorclass
    class Data:
        x: torch.Tensor
        y: torch.Tensor

    data = Data(x=torch.ones(4), y=torch.zeros(4, 2), batch_size=[4])
    ours = TensorDict.from_tensordict(data)
    assert ours.keys() == ["x", "y"] and ours["y"].data_ptr() == data.y.data_ptr()


def test_unsupported_reference_objects_name_their_class():
    stack = tensordict.NonTensorStack(tensordict.NonTensorData("a"),
                                      tensordict.NonTensorData("b"))
    with pytest.raises(TypeError, match="NonTensorStack"):
        TensorDict(stack)
    with pytest.raises(TypeError, match="builtins.dict"):
        TensorDict.from_tensordict({"a": torch.ones(1)})
    with pytest.raises(TypeError, match="send: expected a TensorDict.*builtins.list"):
        tensordict_cpp.send([1], 1)


def test_conversions_are_o_leaves_without_copies():
    ref = tensordict.TensorDict({f"k{i}": torch.zeros(4) for i in range(1000)}, [4])
    ours = TensorDict(ref)
    assert all(ours[k].data_ptr() == ref[k].data_ptr() for k in ("k0", "k999"))
    back = ours.to_reference()
    assert back["k500"].data_ptr() == ref["k500"].data_ptr()


def exchange(rank, world_size):
    torch.set_num_threads(1)
    peer = 1 - rank
    # Per leaf: a reference TensorDict on both sides, through our module functions.
    if rank == 0:
        td = reference_td()
        td["a"].fill_(3.0)
        tensordict_cpp.send(td, peer)
        for w in tensordict_cpp.isend(td, peer, init_tag=40, return_early=True):
            w.wait()
        tensordict_cpp.send(td, peer, consolidated=True)
        tensordict_cpp.init_remote(td, peer)
    else:
        td = reference_td()
        a = td["a"]
        tensordict_cpp.recv(td, peer)
        assert td["a"] is a and (a == 3.0).all()  # received into the user's own tensor
        a.zero_()
        tensordict_cpp.irecv(td, peer, init_tag=40)
        assert (a == 3.0).all()
        # A consolidated receiver: ours (the reference's consolidation does not carry over).
        into = tensordict_cpp.consolidate(reference_td())
        tensordict_cpp.recv(into, peer, consolidated=True)
        assert (into["a"] == 3.0).all() and into["label"] == "hello"
        got = TensorDict.from_remote_init(peer)
        assert (got["a"] == 3.0).all() and got["label"] == "hello"
        assert got["n", "x"].dtype == torch.int32
    torch.distributed.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_reference_objects_go_straight_to_our_transfers(reference):
    run(on_reference(reference, exchange), world_size=2, timeout=120, group_timeout=20)


def gather(rank, world_size):
    torch.set_num_threads(1)
    # Rank 1 runs the reference, ranks 0 and 2 ours; each of 0 and 1 is the destination once.
    cls = tensordict.TensorDict if rank == 1 else TensorDict

    def sample(fill):
        td = cls({"a": torch.full((3,), float(fill)), "n": {"x": torch.full((3, 2), fill)}}, [3])
        return td

    for dst in (0, 1):
        if rank == dst:
            rows = cls({"a": torch.zeros(2, 3), "n": {"x": torch.zeros(2, 3, 2, dtype=torch.int64)}},
                       [2, 3])
            out = rows.gather_and_stack(dst)
            assert out is rows
            others = [r for r in range(3) if r != dst]
            for row, r in enumerate(others):
                assert (rows["a"][row] == 10 + r).all() and (rows["n", "x"][row] == 10 + r).all()
        else:
            assert sample(10 + rank).gather_and_stack(dst) is None
    # Ours through the module function, on a reference TensorDict (rank 1's).
    if rank == 0:
        rows = TensorDict({"a": torch.zeros(2, 3), "n": {"x": torch.zeros(2, 3, 2, dtype=torch.int64)}},
                          [2, 3])
        tensordict_cpp.gather_and_stack(rows, 0)
        assert (rows["a"][0] == 11).all() and (rows["a"][1] == 12).all()
    elif rank == 1:
        assert tensordict_cpp.gather_and_stack(sample(11), 0) is None
    else:
        sample(12).gather_and_stack(0)
    torch.distributed.barrier()


def test_gather_and_stack_with_the_reference_on_three_ranks():
    run(gather, world_size=3, timeout=120, group_timeout=20)
