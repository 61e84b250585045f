"""MemoryMappedTensor and TensorDict.memmap / memmap_ / memmap_like / load_memmap, against the
reference: a directory written by either library loads in the other with the same values,
dtypes, shapes, nested levels and non-tensor data; errors name the path; a received TensorDict
writes into its files."""
import functools
import json
import os
import pickle

import pytest
import tensordict as ref
import torch
import torch.distributed as dist

from reference_peer import REFERENCES, on_reference
from tensordict_cpp import MemoryMappedTensor, TensorDict
from tensordict_cpp.distributed import run


def sample(cls):
    """The same data as a reference or an ours TensorDict."""
    td = cls(
        a=torch.arange(12, dtype=torch.float32).reshape(3, 4),
        i=torch.tensor([1, -2, 3], dtype=torch.int16),
        flag=torch.tensor([True, False, True]),
        h=torch.randn(3, 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
        batch_size=[3])
    td["nested", "x"] = torch.arange(6, dtype=torch.int64).reshape(3, 2)
    td["nested", "deeper", "y"] = torch.full((3,), 2.5, dtype=torch.float64)
    return td


# ---- layout interop --------------------------------------------------------------------------
def test_ours_writes_the_reference_reads(tmp_path):
    td = sample(TensorDict)
    td.set_non_tensor("label", "hello")
    td.set_non_tensor(("nested", "cfg"), {"lr": 0.5, "steps": [1, 2, None], "name": "x"})
    out = td.memmap(tmp_path)
    assert out.is_locked and out.is_memmap() and not td.is_memmap()
    assert type(out["a"]) is MemoryMappedTensor
    assert out["a"].filename == str(tmp_path / "a.memmap")

    loaded = ref.TensorDict.load_memmap(tmp_path)
    for key in td.keys(include_nested=True, leaves_only=True):
        if td.is_non_tensor(key):
            continue
        assert torch.equal(loaded[key], td[key]) and loaded[key].dtype == td[key].dtype, key
        assert isinstance(loaded[key], ref.MemoryMappedTensor)
    assert loaded["label"] == "hello"
    assert loaded["nested", "cfg"] == {"lr": 0.5, "steps": [1, 2, None], "name": "x"}
    assert loaded.batch_size == torch.Size([3])
    assert loaded["nested", "deeper"].batch_size == torch.Size([3])

    # Byte for byte the reference's own meta.json for the same TensorDict.
    ref_td = sample(ref.TensorDict)
    ref_td["label"] = "hello"
    ref_td["nested", "cfg"] = ref.NonTensorData({"lr": 0.5, "steps": [1, 2, None], "name": "x"})
    ref_td.memmap(tmp_path / "theirs")
    for level in ("", "nested", "nested/deeper", "label", "nested/cfg"):
        ours_meta = json.loads((tmp_path / level / "meta.json").read_text())
        their_meta = json.loads((tmp_path / "theirs" / level / "meta.json").read_text())
        assert ours_meta == their_meta, level
        assert list(ours_meta) == list(their_meta), level  # and in the same order
    for name in ("a", "i", "flag", "h", "nested/x", "nested/deeper/y"):
        assert (tmp_path / f"{name}.memmap").read_bytes() == \
            (tmp_path / "theirs" / f"{name}.memmap").read_bytes(), name


def test_the_reference_writes_ours_reads(tmp_path):
    theirs = sample(ref.TensorDict)
    theirs["label"] = "a label"
    theirs["nested", "cfg"] = ref.NonTensorData({"k": [1, 2]})
    theirs.memmap(tmp_path)
    ours = TensorDict.load_memmap(tmp_path)
    assert not ours.is_locked
    assert type(ours["a"]) is MemoryMappedTensor
    assert ours["nested", "deeper", "y"].filename == str(tmp_path / "nested" / "deeper" / "y.memmap")
    assert ours.get_non_tensor("label") == "a label"
    assert ours.get_non_tensor(("nested", "cfg")) == {"k": [1, 2]}
    for key in theirs.keys(include_nested=True, leaves_only=True):
        if isinstance(theirs[key], torch.Tensor):
            assert torch.equal(ours[key], theirs[key]) and ours[key].dtype == theirs[key].dtype
    # The mapping is shared: a write through ours is seen by the reference's mapping.
    ours["a"][0, 0] = 100.0
    assert ref.TensorDict.load_memmap(tmp_path)["a"][0, 0] == 100.0


def test_empty_leaves_load_both_ways(tmp_path):
    ref.TensorDict(e=torch.zeros(0, 3), batch_size=[]).memmap(tmp_path / "theirs")
    assert not (tmp_path / "theirs" / "e.memmap").exists()  # the reference writes no file
    assert TensorDict.load_memmap(tmp_path / "theirs")["e"].shape == (0, 3)
    TensorDict(e=torch.zeros(0, 3)).memmap(tmp_path / "ours")
    assert ref.TensorDict.load_memmap(tmp_path / "ours")["e"].shape == (0, 3)


# ---- MemoryMappedTensor ----------------------------------------------------------------------
def test_memory_mapped_tensor_matches_the_reference(tmp_path):
    src = torch.arange(10, dtype=torch.float64).reshape(2, 5)
    ours = MemoryMappedTensor.from_tensor(src, filename=tmp_path / "ours.memmap")
    theirs = ref.MemoryMappedTensor.from_tensor(src, filename=tmp_path / "theirs.memmap")
    assert isinstance(ours, torch.Tensor) and type(ours) is MemoryMappedTensor
    assert (tmp_path / "ours.memmap").read_bytes() == (tmp_path / "theirs.memmap").read_bytes()
    assert ours.filename == str(tmp_path / "ours.memmap")
    # Each maps the other's file.
    assert torch.equal(MemoryMappedTensor.from_filename(tmp_path / "theirs.memmap",
                                                        torch.float64, (2, 5)), src)
    assert torch.equal(ref.MemoryMappedTensor.from_filename(tmp_path / "ours.memmap",
                                                            torch.float64, (2, 5)), src)
    # Writes reach the file, views stay memory-mapped, operations give plain tensors.
    ours[1, 4] = -1.0
    assert ref.MemoryMappedTensor.from_filename(tmp_path / "ours.memmap", torch.float64,
                                                (2, 5))[1, 4] == -1.0
    assert type(ours[0]) is MemoryMappedTensor and ours[0].filename == ours.filename
    assert type(ours + 1) is torch.Tensor
    assert MemoryMappedTensor.from_tensor(ours, filename=tmp_path / "ours.memmap") is ours
    with pytest.raises(RuntimeError, match="copy_existing"):
        MemoryMappedTensor.from_tensor(ours, filename=tmp_path / "other.memmap")


@pytest.mark.parametrize("make", [
    lambda M, f: M.zeros(2, 3, dtype=torch.int32, filename=f),
    lambda M, f: M.ones((2, 3), dtype=torch.int32, filename=f),
    lambda M, f: M.full(shape=(2, 3), fill_value=7, dtype=torch.int32, filename=f),
    lambda M, f: M.empty_like(torch.ones(2, 3, dtype=torch.int32), filename=f),
    lambda M, f: M.ones_like(torch.zeros(2, 3, dtype=torch.int32), filename=f),
    lambda M, f: M.full_like(torch.zeros(2, 3, dtype=torch.int32), 4, filename=f),
])
def test_factories_match_the_reference(tmp_path, make):
    ours = make(MemoryMappedTensor, tmp_path / "ours")
    theirs = make(ref.MemoryMappedTensor, tmp_path / "theirs")
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)  # a new file reads as zeros in both (empty_like)
    assert (tmp_path / "ours").stat().st_size == (tmp_path / "theirs").stat().st_size


def test_anonymous_memory_and_existsok(tmp_path):
    z = MemoryMappedTensor.zeros(4)
    assert z.dtype == torch.get_default_dtype() and torch.equal(z, torch.zeros(4))
    with pytest.raises(RuntimeError, match="no file associated"):
        z.filename
    MemoryMappedTensor.zeros(3, filename=tmp_path / "f")
    with pytest.raises(RuntimeError, match="already exists"):
        MemoryMappedTensor.zeros(3, filename=tmp_path / "f")
    assert torch.equal(MemoryMappedTensor.ones(3, filename=tmp_path / "f", existsok=True),
                       torch.ones(3))
    with pytest.raises(RuntimeError, match="Only CPU"):
        MemoryMappedTensor.zeros(3, device="meta")
    with pytest.raises(TypeError):
        MemoryMappedTensor.from_tensor(torch.ones(2).numpy())
    with pytest.raises(NotImplementedError, match="pickled"):
        pickle.dumps(z)


# ---- TensorDict methods ----------------------------------------------------------------------
def test_memmap_in_place_like_and_prefix_none(tmp_path):
    td = sample(TensorDict)
    nested = td["nested"]
    assert td.memmap_(tmp_path / "inplace") is td
    assert td.is_locked and td.is_memmap()
    assert type(nested["x"]) is MemoryMappedTensor  # the nested handle converted too
    td["a"][0, 0] = 42.0
    assert ref.TensorDict.load_memmap(tmp_path / "inplace")["a"][0, 0] == 42.0
    td.unlock_()
    assert not td.is_memmap()

    like = sample(TensorDict).memmap_like(tmp_path / "like")
    assert like.is_memmap() and like["a"].shape == (3, 4)
    assert all((leaf == 0).all() for leaf in like.values(include_nested=True, leaves_only=True))
    assert ref.TensorDict.load_memmap(tmp_path / "like")["nested", "x"].dtype == torch.int64

    anon = sample(TensorDict).memmap()
    assert anon.is_memmap() and type(anon["a"]) is MemoryMappedTensor
    with pytest.raises(RuntimeError, match="no file associated"):
        anon["a"].filename
    with pytest.raises(NotImplementedError):
        sample(TensorDict).memmap(tmp_path / "x", return_early=True)


def test_consolidate_keeps_the_values_of_mapped_leaves(tmp_path):
    mm = sample(TensorDict).memmap(tmp_path)
    c = mm.consolidate()
    assert c.is_consolidated()
    for key in mm.keys(include_nested=True, leaves_only=True):
        assert torch.equal(c[key], mm[key]) and type(c[key]) is torch.Tensor


# ---- errors ----------------------------------------------------------------------------------
def test_errors_name_the_path_and_key(tmp_path):
    (tmp_path / "file").write_text("x")
    under_file = tmp_path / "file" / "sub"  # fails for root too
    with pytest.raises(RuntimeError, match=str(under_file)):
        TensorDict(a=torch.ones(2)).memmap(under_file)
    with pytest.raises(RuntimeError, match=str(under_file)):
        MemoryMappedTensor.from_tensor(torch.ones(2), filename=under_file)
    missing = tmp_path / "no" / "dir" / "x.memmap"
    with pytest.raises(RuntimeError, match=str(missing)):
        MemoryMappedTensor.from_tensor(torch.ones(2), filename=missing)
    with pytest.raises(RuntimeError, match=str(tmp_path / "nothing")):
        MemoryMappedTensor.from_filename(tmp_path / "nothing", torch.float32, (2,))
    MemoryMappedTensor.zeros(2, filename=tmp_path / "small")
    with pytest.raises(RuntimeError, match="too few"):
        MemoryMappedTensor.from_filename(tmp_path / "small", torch.float32, (3,))
    with pytest.raises(ValueError, match=r"key \('n', 'a/b'\) is not a safe file name"):
        TensorDict({("n", "a/b"): torch.ones(1)}).memmap(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # nothing written
    with pytest.raises(RuntimeError, match=str(tmp_path / "absent" / "meta.json")):
        TensorDict.load_memmap(tmp_path / "absent")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_a_read_only_directory_is_named(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(RuntimeError, match=str(ro / "a.memmap")):
            TensorDict(a=torch.ones(2)).memmap(ro)
    finally:
        ro.chmod(0o700)


def test_bad_metadata_from_the_reference_layout_is_refused(tmp_path):
    ref.TensorDict(a=torch.ones(2, 2), batch_size=[2]).memmap(tmp_path)
    meta = tmp_path / "meta.json"
    good = meta.read_text()
    meta.write_text(good.replace("torch.float32", "torch.nonsense"))
    with pytest.raises(ValueError, match=f"{meta}: key 'a' has the unknown dtype"):
        TensorDict.load_memmap(tmp_path)
    meta.write_text(good.replace("[2, 2]", "[2, 5]"))
    with pytest.raises(RuntimeError, match="too few"):
        TensorDict.load_memmap(tmp_path)
    meta.write_text(good.replace('"a":', '"../a":'))
    with pytest.raises(ValueError, match="not a safe file name"):
        TensorDict.load_memmap(tmp_path)


# ---- a received TensorDict writes into its files, with the reference on the other rank ------
def _values(cls, k):
    return cls(a=torch.arange(4, dtype=torch.float32) + k,
               n=cls(b=torch.full((4, 2), 7 + k, dtype=torch.int64), batch_size=[4]),
               batch_size=[4])


def _send_into_memmap(prefix, rank, world_size):
    torch.set_num_threads(1)
    cls = ref.TensorDict if rank == 0 else TensorDict
    # Each rank sends from memory-mapped leaves of its own and receives into others: the
    # reference (rank 0) first, then ours.
    for src in (0, 1):
        if rank == src:
            _values(cls, src).memmap(f"{prefix}/send{rank}").send(dst=1 - rank)
        else:
            td = _values(cls, -100).memmap(f"{prefix}/recv{rank}")
            before = td["a"].data_ptr()
            td.recv(src=src)
            assert td["a"].data_ptr() == before  # received in place, into the mapping
        dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_recv_writes_into_the_memory_mapped_files(tmp_path, reference):
    run(on_reference(reference, functools.partial(_send_into_memmap, str(tmp_path))),
        world_size=2, timeout=90, group_timeout=20)
    # The files hold the received bytes: ours (rank 1) got the reference's, read here by the
    # reference; the reference's got ours, read here by ours.
    for loaded, k in ((ref.TensorDict.load_memmap(tmp_path / "recv1"), 0),
                      (TensorDict.load_memmap(str(tmp_path / "recv0")), 1)):
        assert torch.equal(loaded["a"], torch.arange(4, dtype=torch.float32) + k)
        assert torch.equal(loaded["n", "b"], torch.full((4, 2), 7 + k, dtype=torch.int64))


def test_the_constructor_forms(tmp_path):
    src = torch.arange(6, dtype=torch.int32)
    by_copy = MemoryMappedTensor(src, filename=tmp_path / "c.memmap")
    assert type(by_copy) is MemoryMappedTensor and by_copy.filename == str(tmp_path / "c.memmap")
    by_path = MemoryMappedTensor(str(tmp_path / "c.memmap"), dtype=torch.int32, shape=(2, 3))
    assert torch.equal(by_path, src.reshape(2, 3))
    same = MemoryMappedTensor(torch.from_file(str(tmp_path / "c.memmap"), shared=True, size=6,
                                              dtype=torch.int32))
    same[0] = 9  # the same storage as the file's mapping
    assert by_path[0, 0] == 9
    with pytest.raises(TypeError, match="from_tensor"):
        MemoryMappedTensor(src)
    with pytest.raises(TypeError, match="dtype and shape"):
        MemoryMappedTensor(str(tmp_path / "c.memmap"))
