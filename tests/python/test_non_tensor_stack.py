"""NonTensorStack and MetaData against the reference tensordict: how they arise, read, index and
print, their metadata nodes (JSON and pickle, byte for byte), the uncollated pipe header, and
every transfer with the reference on the other rank."""
import json
import pickle
import subprocess

import pytest
import tensordict
import torch
import torch.distributed as dist

from conftest import built
from reference_peer import REFERENCES, on_reference
from tensordict_cpp import MetaData, NonTensorData, NonTensorStack, TensorDict
from tensordict_cpp import stack as our_stack

Ref = tensordict.TensorDict


def rows(lib, texts, **extra):
    """TensorDicts of batch size [] with a text each, stacked as the reference stacks them."""
    tds = [lib.TensorDict(a=torch.full((2,), float(i)), text=t, batch_size=[], **extra)
           for i, t in enumerate(texts)]
    return torch.stack(tds) if lib is tensordict else our_stack(tds)


def both(make):
    return make(tensordict), make(__import__("tensordict_cpp"))


def unwrap(value):
    """The reference's LinkedList as a plain (nested) list."""
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    return value


# ---- how a stack arises and reads --------------------------------------------------------------

@pytest.mark.parametrize("texts", [["hello", "big", "world"], ["same", "same"], ["x"]])
def test_stacking_rows_gives_a_stack_as_the_reference(texts):
    ref, ours = both(lambda lib: rows(lib, texts))
    assert type(ours.get("text")).__name__ == type(ref.get("text")).__name__ == "NonTensorStack"
    assert unwrap(ref["text"]) == ours["text"] == ours.get("text").tolist() == texts
    for i, t in enumerate(texts):
        assert ours[i]["text"] == ref[i]["text"] == t
        assert type(ours[i].get("text")).__name__ == "NonTensorData"
    assert ours[0:2]["text"] == unwrap(ref[0:2]["text"])
    index = torch.tensor([len(texts) - 1, 0])
    assert ours[index]["text"] == unwrap(ref[index]["text"])
    assert repr(ours) == repr(ref)
    assert repr(ours.get("text")) == repr(ref.get("text"))
    if len(set(texts)) == 1:
        assert ours.get("text").data == ref.get("text").data == texts[0]
    else:
        with pytest.raises(AttributeError, match="non-unique data"):
            ours.get("text").data


def test_two_dims_and_stack_dims_as_the_reference():
    grid_ref = torch.stack([torch.stack([tensordict.NonTensorData(data=f"{i}{j}") for i in range(2)])
                            for j in range(3)])
    grid = NonTensorStack(*[NonTensorStack(*[f"{i}{j}" for i in range(2)]) for j in range(3)])
    assert grid.batch_size == grid_ref.batch_size == torch.Size([3, 2])
    assert grid.tolist() == grid_ref.tolist()
    assert grid[2, 1].data == grid_ref[2, 1].data
    assert grid[1].tolist() == grid_ref[1].tolist()
    # Stacked along dim 1: members of batch size [2], row-major values.
    ref = tensordict.NonTensorStack(tensordict.NonTensorData("x", batch_size=[2]),
                                    tensordict.NonTensorData("y", batch_size=[2]), stack_dim=1)
    ours = NonTensorStack(NonTensorData("x", [2]), NonTensorData("y", [2]), stack_dim=1)
    assert ours.batch_size == ref.batch_size == torch.Size([2, 2])
    assert ours.tolist() == ref.tolist() == [["x", "y"], ["x", "y"]]
    assert [m.data for m in ours.unbind(1)] == ["x", "y"]
    assert [m.tolist() for m in ours.unbind(0)] == [m.tolist() for m in ref.unbind(0)]
    td_ref = Ref(batch_size=[2, 2])
    td_ref["s"] = ref
    td = TensorDict(batch_size=[2, 2])
    td["s"] = ours
    assert td[1, 0]["s"] == td_ref[1, 0]["s"] == "x"
    assert td.reshape(4)["s"] == unwrap(td_ref.reshape(4)["s"]) == ["x", "y", "x", "y"]
    assert td.unsqueeze(0)["s"] == unwrap(td_ref.unsqueeze(0)["s"])


def test_a_list_becomes_a_stack_as_the_reference():
    ref, ours = Ref(batch_size=[3]), TensorDict(batch_size=[3])
    ref["names"] = ["a", "b", "c"]
    ours["names"] = ["a", "b", "c"]
    assert type(ours.get("names")) is NonTensorStack
    assert ours["names"] == unwrap(ref["names"])
    assert ours[1]["names"] == ref[1]["names"] == "b"
    ref["n"], ours["n"] = [1, 2, 3], [1, 2, 3]  # numeric: a tensor
    assert torch.equal(ours["n"], ref["n"])
    with pytest.raises(ValueError, match="names2"):
        ours["names2"] = ["a", "b"]  # one value per row


def test_equality_elementwise_as_the_reference():
    a_ref, a = both(lambda lib: rows(lib, ["p", "q", "r"]))
    b_ref, b = both(lambda lib: rows(lib, ["p", "x", "r"]))
    assert torch.equal(a.get("text") == b.get("text"), a_ref.get("text") == b_ref.get("text"))
    assert torch.equal(a.get("text") != b.get("text"), a_ref.get("text") != b_ref.get("text"))
    assert (a.get("text") == "p") is False


def test_a_lazy_stack_reads_its_members_text_as_a_stack():
    ref = tensordict.lazy_stack([Ref(t="a"), Ref(t="b")])
    ours = TensorDict(ref)
    assert type(ours.get("t")) is NonTensorStack and ours["t"] == ["a", "b"]
    ours["t"] = NonTensorStack("c", "d")
    assert [m["t"] for m in ours.tensordicts] == ["c", "d"]


# ---- MetaData ------------------------------------------------------------------------------------

def test_metadata_stacks_into_one_when_equal():
    a = TensorDict(x=torch.zeros(3), batch_size=[3])
    a["cfg"] = MetaData({"lr": 0.1}, batch_size=[3])
    assert type(a.get("cfg")) is MetaData and a["cfg"] == {"lr": 0.1}
    s = our_stack([a, a.clone()])
    assert type(s.get("cfg")) is MetaData and s.get("cfg").batch_size == torch.Size([2, 3])
    assert type(s[0, 1].get("cfg")) is MetaData
    b = a.clone()
    b["cfg"] = MetaData({"lr": 0.2}, batch_size=[3])
    mixed = our_stack([a, b])
    assert type(mixed.get("cfg")) is NonTensorStack and mixed[1, 0]["cfg"] == {"lr": 0.2}
    assert repr(a.get("cfg")) == repr(tensordict.MetaData({"lr": 0.1}, batch_size=[3]))
    assert repr(a) == "TensorDict(batch_size=[3], fields={cfg: MetaData, x: f32[]})"
    with pytest.raises(TypeError, match="Expected data of type str, got int"):
        MetaData[str](1)
    assert MetaData[str]("x").data == "x"


def roundtrip(meta):
    """Our reader, then our writer, on a metadata pickle (tests/tools/pickle_roundtrip.cpp)."""
    result = subprocess.run([str(built("pickle_roundtrip")), "--metadata"], input=pickle.dumps(meta),
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr.decode()
    return pickle.loads(result.stdout)


def test_metadata_is_marked_by_a_list_in_the_pickle():
    meta = Ref(x=torch.zeros(2), label="plain", batch_size=[2]).consolidate()._consolidated["metadata"]
    back = roundtrip(meta)
    assert back == meta and type(back["non_tensors"]["label"]) is tuple
    meta["non_tensors"]["label"] = list(meta["non_tensors"]["label"])  # how ours sends a MetaData
    assert type(roundtrip(meta)["non_tensors"]["label"]) is list


# ---- the metadata node, byte for byte -------------------------------------------------------------

def stack_cases(lib):
    nt = lib.NonTensorData
    st = lib.NonTensorStack
    out = {}
    td = lib.TensorDict(a=torch.arange(3.0), batch_size=[3])
    td["names"] = st("a", "b", "c")
    td["n", "inner"] = st("x", "y", "z")
    out["flat"] = td
    grid = lib.TensorDict(batch_size=[2])
    grid["g"] = st(st("a", "b"), st("c", "d"))
    out["grid"] = grid
    dim1 = lib.TensorDict(batch_size=[2])
    dim1["s"] = st(nt("x", batch_size=[2]), nt("y", batch_size=[2]), stack_dim=1)
    out["stack_dim_1"] = dim1
    mixed = lib.TensorDict(batch_size=[2])
    mixed["m"] = st(nt("a", batch_size=[2]), st("b", "c"))
    out["mixed_members"] = mixed
    return out


@pytest.mark.parametrize("case", ["flat", "grid", "stack_dim_1", "mixed_members"])
def test_consolidated_metadata_is_the_references(case):
    ref = stack_cases(tensordict)[case]
    ours = stack_cases(__import__("tensordict_cpp"))[case]
    meta = ref.consolidate()._consolidated["metadata"]
    assert ours.consolidate()._cpp.consolidated_metadata_json() == json.dumps(meta)
    back = roundtrip(meta)  # the reference's pickle through our reader and writer
    assert back == meta and list(back) == list(meta)
    converted = TensorDict(ref)  # no copy: the reference's objects read as ours
    assert (converted == ours).all()
    assert converted.consolidate()._cpp.consolidated_metadata_json() == json.dumps(meta)


def test_the_reference_converts_both_ways_without_copies():
    ref = rows(tensordict, ["a", "b"])
    ours = TensorDict(ref)
    assert type(ours.get("text")) is NonTensorStack and ours["text"] == ["a", "b"]
    assert ours["a"].data_ptr() == ref["a"].data_ptr()
    back = ours.to_reference()
    assert type(back.get("text")).__name__ == "NonTensorStack"
    assert unwrap(back["text"]) == ["a", "b"]
    meta_ref = MetaData("c", batch_size=[2])
    ours["cfg"] = meta_ref
    assert type(ours.to_reference().get("cfg")).__name__ == "MetaData"
    assert type(TensorDict(ours.to_reference()).get("cfg")) is MetaData


def test_memmap_round_trips_with_the_reference(tmp_path):
    ours = stack_cases(__import__("tensordict_cpp"))["flat"]
    ours["cfg"] = MetaData("c", batch_size=[3])
    ours.memmap(tmp_path / "ours")
    ref = Ref.load_memmap(tmp_path / "ours")
    assert unwrap(ref["names"]) == ["a", "b", "c"] and type(ref.get("cfg")).__name__ == "MetaData"
    stack_cases(tensordict)["flat"].memmap(tmp_path / "ref")
    back = TensorDict.load_memmap(tmp_path / "ref")
    assert back["names"] == ["a", "b", "c"] and back["n", "inner"] == ["x", "y", "z"]


# ---- every c10d transfer, with the reference on rank 0 ------------------------------------------

def stacked(lib, tag):
    """A TensorDict of batch size [3] with a flat stack, a 2-D one and a MetaData."""
    td = lib.TensorDict(x=torch.full((3, 2), 1.0), batch_size=[3])
    td["text"] = lib.NonTensorStack(*[f"{tag}{i}" for i in range(3)])
    td["n", "grid"] = lib.NonTensorStack(*[lib.NonTensorStack(f"{tag}{i}a", f"{tag}{i}b")
                                          for i in range(3)])
    td["cfg"] = lib.MetaData(f"{tag}cfg", batch_size=[3])
    return td


def check_stacked(td, tag, ours_pair):
    assert list(td.get("text").tolist()) == [f"{tag}{i}" for i in range(3)]
    assert [list(r) for r in td.get(("n", "grid")).tolist()] == [[f"{tag}{i}a", f"{tag}{i}b"]
                                                              for i in range(3)]
    assert type(td.get("text")).__name__ == "NonTensorStack"
    # A MetaData stays one between copies of ours (the pickle's list); a reference end makes
    # (or sees) a NonTensorData, as the reference does with its own.
    assert type(td.get("cfg")).__name__ == ("MetaData" if ours_pair else "NonTensorData")
    assert td["cfg"] == f"{tag}cfg"


def interop(rank, world_size):
    torch.set_num_threads(1)
    lib = tensordict if rank == 0 else __import__("tensordict_cpp")
    ours = rank != 0

    def pair(a, b):
        return a != 0 and b != 0

    # Per leaf (plain and consolidated): the stacks stay the receiver's, no tag is taken.
    for sender, receiver in ((0, 1), (1, 0)):
        if rank == sender:
            stacked(lib, "s").send(dst=receiver)
            td = stacked(lib, "s").consolidate()
            td.send(dst=receiver, consolidated=True)
        elif rank == receiver:
            td = stacked(lib, "r")
            td["x"].zero_()
            assert td.recv(src=sender) == 0  # one tensor: tag 0
            assert (td["x"] == 1).all()
            assert list(td.get("text").tolist()) == ["r0", "r1", "r2"]
            target = stacked(lib, "r").consolidate()
            target.recv(src=sender, consolidated=True)
            assert list(target.get("text").tolist()) == ["r0", "r1", "r2"]

    for sender, receiver in ((0, 1), (1, 0), (1, 2)):  # init_remote
        if rank == sender:
            stacked(lib, f"from{sender}").init_remote(dst=receiver)
        elif rank == receiver:
            td = lib.TensorDict.from_remote_init(src=sender)
            check_stacked(td, f"from{sender}", pair(sender, receiver))

    for root in (0, 1):  # init_remote(use_broadcast=True), broadcast
        if rank == root:
            stacked(lib, f"b{root}").init_remote(use_broadcast=True)
        else:
            check_stacked(lib.TensorDict.from_remote_init(src=root, use_broadcast=True), f"b{root}",
                          pair(root, rank))
        out = (stacked(lib, f"c{root}") if rank == root else lib.TensorDict({}, [])).broadcast(src=root)
        check_stacked(out, f"c{root}", rank == root or pair(root, rank))  # the root: its own

    outs = stacked(lib, f"g{rank}").all_gather()
    for r, out in enumerate(outs):
        check_stacked(out, f"g{r}", (r == rank and ours) or pair(r, rank))

    for root in (0, 2):  # scatter
        tds = [stacked(lib, f"to{r}") for r in range(3)] if rank == root else None
        out = lib.TensorDict({}, []).scatter(src=root, tensordicts=tds)
        check_stacked(out, f"to{rank}", (root == rank and ours) or pair(root, rank))

    td = stacked(lib, f"r{rank}")  # all_reduce and reduce skip them
    td.all_reduce()
    assert (td["x"] == 3).all() and list(td.get("text").tolist()) == [f"r{rank}{i}" for i in range(3)]
    dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_every_transfer_with_the_reference_on_the_other_rank(reference):
    from tensordict_cpp.distributed import run

    run(on_reference(reference, interop), world_size=3, timeout=150, group_timeout=20)


def gather(rank, world_size):
    torch.set_num_threads(1)
    lib = tensordict if rank == 0 else __import__("tensordict_cpp")
    if rank == 1:  # ours gathers the reference's and ours' (gather_and_stack, Gloo's path)
        td = lib.TensorDict(x=torch.zeros(2, 3, 2), batch_size=[2, 3])
        td.gather_and_stack(dst=1)
        assert td[0]["text"] == ["g00", "g01", "g02"] and td[1]["text"] == ["g20", "g21", "g22"]
    else:
        td = lib.TensorDict(x=torch.ones(3, 2), batch_size=[3])
        td["text"] = lib.NonTensorStack(*[f"g{rank}{i}" for i in range(3)])
        td.gather_and_stack(dst=1)
    dist.barrier()


def test_gather_and_stack_with_the_reference():
    from tensordict_cpp.distributed import run

    run(gather, world_size=3, timeout=120, group_timeout=20)
