"""LazyStackedTensorDict: the same calls on the reference's lazy stacks and on ours, with the
same data (keys, stacked reads, indexing, unbind, clone, to, contiguous, nesting, writes into
the members, errors); consolidate() byte for byte; zero-copy conversion both ways; and every
transfer between processes with the reference on one rank (per-leaf send/recv/isend/irecv,
consolidated send, init_remote, broadcast, all_gather, scatter, all_reduce, reduce), plus the
pipe between two of ours."""
import json
import os

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import pytest  # noqa: E402
import tensordict as ref  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tensordict_cpp as ours  # noqa: E402
from tensordict_cpp.distributed import run  # noqa: E402
from reference_peer import REFERENCES, on_reference  # noqa: E402

RUN = dict(timeout=150, group_timeout=20)


def members(lib, fill=0.0):
    """Two members with a shared leaf x, a nested level n whose leaf y differs in shape (a
    heterogeneous stack), and a key e only member 0 has."""
    a = lib.TensorDict({"x": torch.arange(3.0) + fill, "e": torch.ones(3, dtype=torch.int64),
                        "n": {"y": torch.full((3, 2), fill + 1)}}, batch_size=[3])
    b = lib.TensorDict({"x": torch.arange(3.0) + fill + 10,
                        "n": {"y": torch.full((3, 4), fill + 2)}}, batch_size=[3])
    return a, b


def sample(lib, fill=0.0, dim=0):
    """A TensorDict holding a heterogeneous lazy stack next to a plain leaf and a level."""
    stack = lib.lazy_stack(list(members(lib, fill)), dim)
    bs = list(stack.batch_size)
    return lib.TensorDict({"z": torch.full(bs, fill + 5), "s": stack,
                           "m": {"w": torch.full(bs + [2], fill + 6, dtype=torch.float64)}},
                          batch_size=bs)


def leaves_of(td):
    """Every leaf, member by member through lazy stacks, keyed by its path (members as "0", "1"
    ...), without stacking: compares heterogeneous stacks."""
    out = {}

    def walk(t, path):
        if isinstance(t, (ours.LazyStackedTensorDict, ref.LazyStackedTensorDict)):
            for i, m in enumerate(t.tensordicts):
                walk(m, path + (str(i),))
            return
        for k, v in t.items():
            if isinstance(v, torch.Tensor):
                out[path + (k,)] = v
            elif hasattr(v, "batch_size") and not isinstance(v, (ours.NonTensorData,)) \
                    and not ref.is_non_tensor(v):
                walk(v, path + (k,))
    walk(td, ())
    return out


def assert_same(a, b):
    la, lb = leaves_of(a), leaves_of(b)
    assert sorted(la) == sorted(lb)
    for k in la:
        assert la[k].dtype == lb[k].dtype and torch.equal(la[k], lb[k]), k
    assert a.batch_size == b.batch_size


# ---- local behaviour, against the reference --------------------------------------------------
def test_structure_matches_the_reference():
    r, o = ref.lazy_stack(list(members(ref))), ours.lazy_stack(list(members(ours)))
    assert isinstance(o, ours.LazyStackedTensorDict) and isinstance(o, ours.TensorDict)
    assert o.batch_size == r.batch_size == torch.Size([2, 3])
    assert o.stack_dim == r.stack_dim == 0
    assert list(o.keys()) == list(r.keys())
    assert sorted(o.keys(True, True), key=str) == sorted(r.keys(True, True), key=str)
    assert torch.equal(o["x"], r["x"])
    assert len(o.tensordicts) == 2
    assert o.exclusive_keys() == [["e"], []]
    for lib, s in ((ref, r), (ours, o)):
        with pytest.raises(RuntimeError, match="Failed to stack tensors within a tensordict "
                                               "under the key 'y'"):
            s["n", "y"]
        with pytest.raises(KeyError, match="zz"):
            s["zz"]
    assert "exclusive_fields" in repr(o) and "stack_dim=0" in repr(o)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_indexing_unbind_and_copies_match_the_reference(dim):
    def homogeneous(lib):
        a = lib.TensorDict({"x": torch.arange(12.0).view(3, 4), "n": {"y": torch.ones(3, 2)}},
                           batch_size=[3])
        return lib.lazy_stack([a, a.clone().apply(lambda t: t + 100)], dim)
    r, o = homogeneous(ref), homogeneous(ours)
    assert o.stack_dim == r.stack_dim
    for index in [0, 1, (slice(None), 1), (slice(0, 2),), (slice(None), slice(1, 3)), (1, 1),
                  (Ellipsis, 0), torch.tensor([1, 0])]:
        got, want = o[index], r[index]
        assert got.batch_size == want.batch_size, index
        assert type(got).__name__ == type(want).__name__, (index, type(got), type(want))
        assert torch.equal(got["x"], want["x"]), index
        if isinstance(want, ref.LazyStackedTensorDict):
            assert got.stack_dim == want.stack_dim, index
    for d in range(o.batch_dims):
        for g, w in zip(o.unbind(d), r.unbind(d)):
            assert type(g).__name__ == type(w).__name__ and torch.equal(g["x"], w["x"])
    c = o.clone()
    assert isinstance(c, ours.LazyStackedTensorDict) and c.stack_dim == o.stack_dim
    c.zero_()
    assert o["x"].abs().sum() > 0  # the clone is independent
    dense = o.contiguous()
    assert type(dense) is ours.TensorDict
    assert torch.equal(dense["x"], r.contiguous()["x"])
    assert torch.equal(dense["n", "y"], r.contiguous()["n", "y"])
    assert isinstance(o.to(torch.float64), ours.LazyStackedTensorDict)
    assert o.to(torch.float64)["x"].dtype == torch.float64
    assert o.to("cpu").stack_dim == o.stack_dim


def test_member_is_the_same_tensordict_and_writes_reach_the_members():
    a, b = members(ours)
    s = ours.lazy_stack([a, b])
    s[0]["x"].fill_(7)  # the member itself
    assert torch.equal(a["x"], torch.full((3,), 7.0))
    s["x"] = torch.stack([torch.full((3,), 1.0), torch.full((3,), 2.0)])
    assert torch.equal(a["x"], torch.ones(3)) and torch.equal(b["x"], torch.full((3,), 2.0))
    s.set("new", torch.zeros(2, 3, 5))
    assert a["new"].shape == (3, 5) and b["new"].shape == (3, 5)
    s[:, 0] = 9.0  # a batch index writes into every member
    assert a["x"][0] == 9 and b["x"][0] == 9 and a["n", "y"][0].eq(9).all()
    s.fill_("x", 4)
    assert a["x"].eq(4).all() and b["x"].eq(4).all()
    with pytest.raises(ValueError, match="'bad'"):  # the shape must start with the batch size
        s["bad"] = torch.zeros(3, 2)
    assert "bad" not in a.keys() and "bad" not in b.keys()
    b.lock_()
    with pytest.raises(RuntimeError, match="locked"):
        s["late"] = torch.zeros(2, 3)
    assert "late" not in a.keys()  # nothing written when one member refuses
    with pytest.raises(ValueError, match="batch_size"):
        ours.lazy_stack([a, ours.TensorDict({}, [4])])
    with pytest.raises(RuntimeError, match="Stack dim 3 is too big"):
        ours.lazy_stack([a, a], 3)


def test_nesting_both_ways():
    td = sample(ours)
    assert isinstance(td["s"], ours.LazyStackedTensorDict)
    assert torch.equal(td["s", "x"], sample(ref)["s", "x"])
    assert sorted(td.keys(True, True), key=str) == sorted(sample(ref).keys(True, True), key=str)
    # a lazy stack of TensorDicts that hold lazy stacks
    outer = ours.lazy_stack([td, td.clone()], 0)
    assert outer.batch_size == torch.Size([2, 2, 3])
    assert outer["s", "x"].shape == (2, 2, 3)
    assert outer[1]["s"].stack_dim == 0
    assert isinstance(td[0]["s"], ours.TensorDict)  # indexing the stack dim picks a member


# ---- zero-copy conversion ------------------------------------------------------------------
def test_reference_lazy_stacks_convert_without_copies():
    r = sample(ref)
    o = ours.TensorDict.from_tensordict(r)
    assert isinstance(o["s"], ours.LazyStackedTensorDict)
    o["s"].tensordicts[1]["n", "y"].fill_(-1)  # lands in the reference's tensor
    assert r["s"].tensordicts[1]["n", "y"].eq(-1).all()
    back = o.to_reference()
    assert type(back["s"]) is ref.LazyStackedTensorDict
    assert back["s"].tensordicts[0]["x"].data_ptr() == r["s"].tensordicts[0]["x"].data_ptr()
    root = ours.TensorDict(ref.lazy_stack(list(members(ref)), 1))
    assert isinstance(root, ours.LazyStackedTensorDict) and root.stack_dim == 1
    assert type(ours.LazyStackedTensorDict.from_tensordict(sample(ref))) is ours.TensorDict


# ---- consolidate, byte for byte ------------------------------------------------------------
@pytest.mark.parametrize("dim", [0, 1])
def test_consolidate_matches_the_reference_bytes_and_metadata(dim):
    r = sample(ref, dim=dim).consolidate(metadata=True)
    o = sample(ours, dim=dim).consolidate()
    assert torch.equal(o._cpp.consolidated_storage(), r._consolidated["storage"])
    assert o._cpp.consolidated_metadata_json() == json.dumps(r._consolidated["metadata"])
    assert o._cpp.consolidated_metadata_json(sort_keys=True) == json.dumps(
        r._consolidated["metadata"], sort_keys=True)
    root_r = ref.lazy_stack(list(members(ref)), dim).consolidate(metadata=True)
    root_o = ours.lazy_stack(list(members(ours)), dim).consolidate()
    assert isinstance(root_o, ours.LazyStackedTensorDict) and root_o.is_consolidated()
    assert torch.equal(root_o._cpp.consolidated_storage(), root_r._consolidated["storage"])
    assert root_o._cpp.consolidated_metadata_json() == json.dumps(root_r._consolidated["metadata"])
    # consolidated leaves are views of the storage
    storage = root_o._cpp.consolidated_storage()
    x0 = root_o.tensordicts[0]["x"]
    assert x0.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()


# ---- every transfer, with the reference on rank 0 ------------------------------------------
def fill_all(td, value):
    for leaf in leaves_of(td).values():
        leaf.fill_(value)


def interop(rank, world_size):
    torch.set_num_threads(1)
    lib = ref if rank == 0 else ours

    # per-leaf send/recv, both directions, then isend/irecv; the receiver's leaves are written
    # in place (the same tensors before and after).
    for src, dst in ((0, 1), (1, 0)):
        if rank == src:
            sample(lib, 3.0).send(dst=dst)
            sample(lib, 4.0).isend(dst=dst)
        elif rank == dst:
            td = sample(lib)
            before = {k: v.data_ptr() for k, v in leaves_of(td).items()}
            td.recv(src=src)
            assert_same(td, sample(lib, 3.0))
            td.irecv(src=src)
            assert_same(td, sample(lib, 4.0))
            assert {k: v.data_ptr() for k, v in leaves_of(td).items()} == before
        dist.barrier()
    # a lazy stack at the root, per leaf with pseudo_rand tags, and its init_remote, both ways
    root = lambda fill: lib.lazy_stack(list(members(lib, fill)), 1)  # noqa: E731
    for src, dst in ((0, 2), (2, 0)):
        if rank == src:
            root(30.0).send(dst=dst, pseudo_rand=True)
            root(31.0).isend(dst=dst, pseudo_rand=True, init_tag=5)
            root(32.0).init_remote(dst=dst)
        elif rank == dst:
            td = root(0.0)
            td.recv(src=src, pseudo_rand=True)
            assert_same(td, root(30.0))
            td.irecv(src=src, pseudo_rand=True, init_tag=5)
            assert_same(td, root(31.0))
            got = lib.TensorDict.from_remote_init(src=src)
            assert isinstance(got, lib.LazyStackedTensorDict) and got.stack_dim == 1
            assert_same(got, root(32.0))
        dist.barrier()
    # consolidated send into a consolidated receiver, ours -> reference and back
    for src, dst in ((2, 0), (0, 2)):
        if rank == src:
            sample(lib, 5.0).consolidate().send(dst=dst, consolidated=True)
        elif rank == dst:
            td = sample(lib).consolidate()
            td.recv(src=src, consolidated=True)
            assert_same(td, sample(lib, 5.0))
        dist.barrier()
    # init_remote / from_remote_init, both directions: the receiver does not know the layout
    for src, dst in ((0, 1), (1, 0)):
        if rank == src:
            sample(lib, 6.0).init_remote(dst=dst)
        elif rank == dst:
            td = lib.TensorDict.from_remote_init(src=src)
            assert isinstance(td["s"], lib.LazyStackedTensorDict)
            assert_same(td, sample(lib, 6.0))
        dist.barrier()
    # broadcast from the reference and from ours
    for root in (0, 2):
        mine = sample(lib, 7.0 + root) if rank == root else lib.TensorDict({}, [])
        out = mine.broadcast(src=root)
        assert isinstance(out["s"], lib.LazyStackedTensorDict)
        assert_same(out, sample(lib, 7.0 + root))
    # all_gather: every rank a lazy stack at the root
    outs = lib.lazy_stack(list(members(lib, 10.0 + rank)), 1).all_gather()
    for r, out in enumerate(outs):
        assert isinstance(out, lib.LazyStackedTensorDict) and out.stack_dim == 1
        assert_same(out, lib.lazy_stack(list(members(lib, 10.0 + r)), 1))
    # scatter from the reference and from ours
    for root in (0, 1):
        tds = [sample(lib, 20.0 + r) for r in range(3)] if rank == root else None
        out = lib.TensorDict({}, []).scatter(src=root, tensordicts=tds)
        assert_same(out, sample(lib, 20.0 + rank))
    # all_reduce (members one by one) and reduce to rank 2 (the reference's stacked leaves)
    td = sample(lib, 1.0)
    fill_all(td, rank + 1.0)
    td.all_reduce()
    want = sample(lib)
    fill_all(want, 6.0)
    assert_same(td, want)
    homogeneous = lib.lazy_stack([lib.TensorDict({"x": torch.full((3,), rank + 1.0)}, [3])
                                  for _ in range(2)])
    homogeneous.reduce(2)
    if rank == 2:
        assert homogeneous.tensordicts[0]["x"].eq(6).all()
        assert homogeneous.tensordicts[1]["x"].eq(6).all()
    dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_every_transfer_interoperates_with_the_reference(reference):
    run(on_reference(reference, interop), world_size=3, **RUN)


def test_the_pipe_carries_lazy_stacks():
    from tensordict_cpp import TensorDictPipe
    server = TensorDictPipe.listen_sync(0, "127.0.0.1", timeout=5.0)
    client = TensorDictPipe.connect_sync("127.0.0.1", server.port, timeout=5.0)
    with server, client:
        client.send(sample(ours, 1.0))
        got = server.recv()
        assert isinstance(got["s"], ours.LazyStackedTensorDict)
        assert_same(got, sample(ours, 1.0))
        client.send(sample(ours, 2.0))  # same schema: received in place
        again = server.recv()
        assert_same(again, sample(ours, 2.0))


def test_memory_mapping_a_lazy_stack_is_refused_by_name(tmp_path):
    with pytest.raises(NotImplementedError, match="'s' is a LazyStackedTensorDict"):
        sample(ours).memmap(str(tmp_path / "td"))
    assert not (tmp_path / "td").exists()  # refused before anything is written


# ---- maybe_dense_stack, as the reference's --------------------------------------------------------

def _maybe_cases(lib):
    same = [lib.TensorDict(a=torch.full((2,), float(i)), b={"c": torch.zeros(3)}, batch_size=[])
            for i in range(3)]
    keys = [lib.TensorDict(a=torch.zeros(2)), lib.TensorDict(b=torch.zeros(2))]
    shapes = [lib.TensorDict(a=torch.zeros(2)), lib.TensorDict(a=torch.zeros(3))]
    nested = [lib.TensorDict(a=torch.zeros(2), n={"x": torch.zeros(i + 1)}) for i in range(2)]
    batched = [lib.TensorDict(a=torch.full((4, 2), float(i)), batch_size=[4]) for i in range(2)]
    return {"same": (same, 0), "keys": (keys, 0), "shapes": (shapes, 0), "nested": (nested, 0),
            "dim1": (batched, 1), "dim_neg": (batched, -1)}


@pytest.mark.parametrize("case", ["same", "keys", "shapes", "nested", "dim1", "dim_neg"])
def test_maybe_dense_stack_as_the_reference(case):
    items, dim = _maybe_cases(ref)[case]
    theirs = ref.LazyStackedTensorDict.maybe_dense_stack(items, dim)
    ours_items, _ = _maybe_cases(ours)[case]
    mine = ours.LazyStackedTensorDict.maybe_dense_stack(ours_items, dim)
    assert type(mine).__name__ == type(theirs).__name__
    assert mine.batch_size == theirs.batch_size
    assert type(ours.maybe_dense_stack(ours_items, dim)).__name__ == type(theirs).__name__
    for i in range(len(items)):
        assert sorted(map(str, mine[i].keys(True, True))) == sorted(map(str, theirs[i].keys(True, True)))
        for key in theirs[i].keys(True, True):
            assert torch.equal(mine[i][key], theirs[i][key]), key
    if case != "shapes":  # the reference's repr cannot stack [2] and [3]
        assert repr(mine) == repr(theirs)


def test_maybe_dense_stack_out_and_errors():
    items = [ours.TensorDict(a=torch.full((2,), float(i))) for i in range(2)]
    out = ours.TensorDict(a=torch.zeros(2, 2), batch_size=[2])
    assert ours.maybe_dense_stack(items, out=out) is out
    assert out["a"][1].eq(1).all()
    with pytest.raises(RuntimeError, match="cannot be empty"):
        ours.maybe_dense_stack([])
    extra = ours.TensorDict(a=torch.zeros(2, 2), z=torch.zeros(2), batch_size=[2])
    with pytest.raises(RuntimeError, match="missing"):
        ours.maybe_dense_stack(items, out=extra, strict=True)
