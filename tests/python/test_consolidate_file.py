"""consolidate(filename=...) and from_consolidated against the reference: the same file bytes,
each reading the other's files, the private mapping, and truncated or forged files."""
import json
import os
import struct

import pytest
import tensordict
import torch

import tensordict_cpp


def cases(lib):
    out = {
        "flat": lib.TensorDict(a=torch.arange(12.0).reshape(4, 3), batch_size=[4]),
        "nested": lib.TensorDict(a=torch.arange(12.0).reshape(4, 3),
                                 b={"c": torch.arange(4), "s": "txt",
                                    "h": torch.ones(4, 2, dtype=torch.bfloat16),
                                    "m": torch.tensor([True, False, True, False])},
                                 batch_size=[4]),
        "empty_leaf": lib.TensorDict(e=torch.zeros(3, 0), batch_size=[3]),
    }
    rows = [lib.TensorDict(a=torch.full((2,), float(i)), t=f"t{i}") for i in range(3)]
    out["stack"] = torch.stack(rows) if lib is tensordict else lib.stack(rows)
    members = [lib.TensorDict(a=torch.full((2,), float(i))) for i in range(2)]
    out["lazy"] = (lib.lazy_stack(members) if lib is tensordict_cpp
                   else tensordict.LazyStackedTensorDict.lazy_stack(members))
    return out


def same(a, b):
    assert type(a).__name__ == type(b).__name__ and a.batch_size == b.batch_size
    keys = sorted(map(str, a.keys(True, True)))
    assert keys == sorted(map(str, b.keys(True, True)))
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), key
        else:
            assert list(x.tolist()) == list(y.tolist()), key


@pytest.mark.parametrize("case", ["flat", "nested", "empty_leaf", "stack", "lazy"])
def test_files_are_the_references_and_read_both_ways(case, tmp_path):
    ref, ours = cases(tensordict)[case], cases(tensordict_cpp)[case]
    ours_c = ours.consolidate(filename=tmp_path / "ours.bin")
    ref.consolidate(filename=tmp_path / "ref.bin")
    assert ours_c.is_consolidated() and ours_c.is_locked
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    for name in ("ours.bin", "ref.bin"):
        back = tensordict_cpp.TensorDict.from_consolidated(tmp_path / name)
        assert back.is_consolidated()
        same(back, ours)
        same(tensordict.TensorDict.from_consolidated(tmp_path / name), ref)
    assert tensordict_cpp.from_consolidated(str(tmp_path / "ref.bin")).batch_size == ref.batch_size


def test_writes_stay_private_as_the_references(tmp_path):
    path = tmp_path / "td.bin"
    td = tensordict_cpp.TensorDict(a=torch.zeros(4, 3), batch_size=[4]).consolidate(filename=path)
    td["a"].add_(1)  # the consolidated TensorDict writes through to its file...
    assert tensordict.TensorDict.from_consolidated(path)["a"].eq(1).all()
    loaded = tensordict_cpp.TensorDict.from_consolidated(path)
    loaded["a"].add_(5)  # ...what from_consolidated maps is copy-on-write
    assert tensordict.TensorDict.from_consolidated(path)["a"].eq(1).all()
    assert loaded["a"].eq(6).all()


def good_file(tmp_path):
    path = tmp_path / "good.bin"
    tensordict_cpp.TensorDict(a=torch.arange(12.0).reshape(4, 3), b={"c": torch.arange(4)},
                              batch_size=[4]).consolidate(filename=path)
    return path.read_bytes()


def parts(blob):
    (n,) = struct.unpack("<q", blob[-8:])
    return blob[: len(blob) - 8 - n], json.loads(blob[len(blob) - 8 - n: -8])


def assemble(storage, meta):
    text = json.dumps(meta).encode()
    return storage + text + struct.pack("<q", len(text))


def forged(blob):
    """Leaf entries are [dtype, shape, start, stop, pad] (docs/wire-format.md)."""
    storage, meta = parts(blob)

    def edit(change):
        copy = json.loads(json.dumps(meta))
        change(copy["leaves"]["a"])
        return assemble(storage, copy)

    return {
        "empty": b"",
        "seven_bytes": blob[:7],
        "trailer_too_long": storage + struct.pack("<q", len(blob) * 2),
        "trailer_zero": storage + struct.pack("<q", 0),
        "trailer_negative": storage + struct.pack("<q", -5),
        "garbage_json": storage + b"{not json" + struct.pack("<q", 9),
        "cut_in_storage": blob[len(storage) // 2:],
        "shape_past_storage": edit(lambda leaf: leaf.__setitem__(1, [4, 3000])),
        "range_past_storage": edit(lambda leaf: leaf.__setitem__(3, len(storage) + 64)),
        "range_backwards": edit(lambda leaf: leaf.__setitem__(2, 40)),
        "bad_dtype": edit(lambda leaf: leaf.__setitem__(0, "torch.evil")),
        "negative_shape": edit(lambda leaf: leaf.__setitem__(1, [-4, 3])),
        "json_not_object": storage + b"[1, 2]" + struct.pack("<q", 6),
    }


@pytest.mark.parametrize("kind", ["empty", "seven_bytes", "trailer_too_long", "trailer_zero",
                                  "trailer_negative", "garbage_json", "cut_in_storage",
                                  "shape_past_storage", "range_past_storage", "range_backwards",
                                  "bad_dtype", "negative_shape", "json_not_object"])
def test_a_forged_file_is_an_error_naming_it(kind, tmp_path):
    path = tmp_path / f"{kind}.bin"
    path.write_bytes(forged(good_file(tmp_path))[kind])
    with pytest.raises(RuntimeError, match=str(path)):
        tensordict_cpp.TensorDict.from_consolidated(path)


def test_missing_files_directories_and_fifos(tmp_path):
    with pytest.raises(FileNotFoundError):
        tensordict_cpp.TensorDict.from_consolidated(tmp_path / "nope.bin")
    with pytest.raises(RuntimeError, match="not a regular file"):
        tensordict_cpp.TensorDict.from_consolidated(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(RuntimeError, match="not a regular file"):
        tensordict_cpp.TensorDict.from_consolidated(tmp_path / "fifo")
    good_file(tmp_path)
    os.symlink(tmp_path / "good.bin", tmp_path / "link.bin")  # followed, as open() follows it
    assert tensordict_cpp.TensorDict.from_consolidated(tmp_path / "link.bin")["a"].sum() == 66


def test_consolidate_filename_refusals_as_the_reference(tmp_path):
    td = tensordict_cpp.TensorDict(a=torch.zeros(2), u=tensordict_cpp.UnbatchedTensor(torch.ones(3)),
                                   batch_size=[2])
    with pytest.raises(NotImplementedError, match="'u' is one"):
        td.consolidate(filename=tmp_path / "u.bin")
    assert not (tmp_path / "u.bin").exists()
