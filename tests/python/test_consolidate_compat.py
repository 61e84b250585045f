"""consolidate() byte compatibility with the installed reference ``tensordict``.

For every case, the same TensorDict is built on both sides (the C++ side through the
``td_layout`` tool, from a spec and the leaves' bytes). Then:

* our storage bytes and metadata text (``json.dumps`` with and without ``sort_keys``) equal
  the reference's;
* the reference rebuilds our (metadata, storage) into a TensorDict equal to the original;
* we rebuild the reference's (metadata, storage) into the structure and bytes the
  reference's own rebuild gives.

The tool is found in ``$TENSORDICT_BUILD_DIR`` (default: the repository's ``build/``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorData, TensorDict, is_non_tensor
from tensordict._reductions import _rebuild_tensordict_files_consolidated

BUILD_DIR = Path(os.environ.get("TENSORDICT_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
TOOL = BUILD_DIR / "td_layout"


@pytest.fixture(scope="module", autouse=True)
def _tool():
    if not TOOL.exists():
        pytest.fail(f"{TOOL} is missing: build the td_layout target (set TENSORDICT_BUILD_DIR)")


# ---- case description, built identically on both sides -------------------------------------


@dataclass
class L:
    """A leaf: random bytes viewed as dtype and shape, then ops (as td_layout applies them)."""

    dtype: torch.dtype
    shape: list[int]
    ops: list = field(default_factory=list)


@dataclass
class NT:
    """A non-tensor entry: JSON-like data, with the level's batch size unless one is given."""

    data: object
    batch_size: list[int] | None = None


@dataclass
class N:
    """A nested level."""

    entries: list  # [(key, L | N)]
    batch_size: list[int] = field(default_factory=list)
    device: str | None = None
    locked: bool = False


def _apply(t: torch.Tensor, ops) -> torch.Tensor:
    for op in ops:
        if op[0] == "t":
            t = t.transpose(op[1], op[2])
        elif op[0] == "slice":
            index = [slice(None)] * op[1] + [slice(op[2], op[3], op[4])]
            t = t[tuple(index)]
        elif op[0] == "select":
            t = t.select(op[1], op[2])
        elif op[0] == "expand":
            t = t.expand(op[1])
        else:
            raise ValueError(op)
    return t


def materialise(node: N, gen: torch.Generator, data: bytearray):
    """Returns (TensorDict, spec) and appends the leaves' bytes to data."""
    entries, spec_entries = {}, []
    for key, item in node.entries:
        if isinstance(item, N):
            td, spec = materialise(item, gen, data)
            entries[key] = td
            spec_entries.append([key, spec])
            continue
        if isinstance(item, NT):
            bs = node.batch_size if item.batch_size is None else item.batch_size
            entries[key] = NonTensorData(item.data, batch_size=bs)
            spec_entries.append([key, {"non_tensor": item.data, **({} if item.batch_size is None
                                                                    else {"batch_size": bs})}])
            continue
        numel = 1
        for d in item.shape:
            numel *= d
        nbytes = numel * item.dtype.itemsize
        high = 2 if item.dtype is torch.bool else 256
        raw = torch.randint(0, high, (nbytes,), dtype=torch.uint8, generator=gen)
        spec_entries.append(
            [key, {"dtype": str(item.dtype), "shape": item.shape, "offset": len(data), "ops": item.ops}]
        )
        data += raw.numpy().tobytes()
        entries[key] = _apply(raw.view(item.dtype).view(item.shape), item.ops)
    td = TensorDict(entries, batch_size=node.batch_size, device=node.device)
    spec = {"batch_size": node.batch_size, "device": node.device, "locked": node.locked,
            "entries": spec_entries}
    if node.locked:
        td.lock_()
    return td, spec


f32, i64 = torch.float32, torch.int64
ALL_DTYPES = [torch.bfloat16, torch.bool, torch.complex128, torch.complex32, torch.complex64,
              torch.float16, torch.float32, torch.float64, torch.int16, torch.int32, torch.int64,
              torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64]
# At most 8 bytes wide: any 8-aligned offset can hold them.
NARROW_DTYPES = [d for d in ALL_DTYPES if d.itemsize <= 8]

CASES = {
    "worked_example": N([("a", L(f32, [4])), ("b", L(f32, [4, 3])), ("c", N([("d", L(i64, [4]))], [4]))], [4]),
    "padding_example": N([("x", L(f32, [3])), ("y", L(torch.bool, [5])), ("z", L(torch.float64, []))]),
    # Sorted by size so that no wide element lands on an 8 mod 16 offset.
    "every_dtype": N([(str(d), L(d, [3])) for d in sorted(ALL_DTYPES, key=lambda d: -d.itemsize)]),
    "every_dtype_zero_dim": N([(str(d), L(d, [])) for d in sorted(ALL_DTYPES, key=lambda d: -d.itemsize)]),
    "numel_zero": N([("e", L(f32, [0])), ("f", L(torch.complex128, [2, 0, 3])), ("g", L(torch.uint8, [5])),
                     ("h", L(torch.int16, [0, 7]))]),
    "nested_3_deep": N([
        ("x", L(f32, [2, 5])),
        ("l1", N([("y", L(i64, [2, 3])),
                  ("l2", N([("z", L(torch.float16, [2, 3, 4, 3])),
                            ("l3", N([("w", L(torch.uint8, [2, 3, 4, 1]))], [2, 3, 4]))], [2, 3, 4])),
                  ("y2", L(torch.bool, [2, 3, 7]))], [2, 3])),
        ("tail", L(torch.float64, [2]))], [2]),
    "wide_tree": N([(f"n{i}", N([(f"m{j}", N([("v", L(torch.int32, [j + i]))])) for j in range(3)]))
                    for i in range(3)]),
    "transposed": N([("t", L(f32, [3, 5], [["t", 0, 1]])), ("u", L(torch.int8, [4, 3, 2], [["t", 0, 2]]))]),
    "strided_slice": N([("s", L(torch.float64, [4, 6], [["slice", 1, 0, 6, 2]])),
                        ("r", L(torch.int16, [9], [["slice", 0, 1, 9, 3]]))]),
    "expanded": N([("e", L(i64, [1, 3], [["expand", [4, 3]]])), ("b", L(torch.bool, [5, 1], [["expand", [5, 3]]]))]),
    "offset_views": N([("row", L(f32, [4, 6], [["select", 0, 2]])),
                       ("tail", L(torch.uint8, [11], [["slice", 0, 3, 11, 1]]))]),
    "unsorted_unicode_keys": N([("b", L(f32, [1])), ("a", L(f32, [2])), ("_x", L(f32, [3])),
                                ("A", L(torch.uint8, [1])), ("\u00e9", L(torch.int16, [1])),
                                ("\u65e5\u672c", L(f32, [1])), ("\U0001F600", L(torch.int8, [3]))]),
    "escaped_keys": N([('q"uote', L(f32, [1])), ("back\\slash", L(f32, [1])), ("new\nline", L(f32, [1])),
                       ("ctl\x01\x7f", L(f32, [1])), ("tab\t", L(f32, [1]))]),
    "nested_before_leaf": N([("n", N([("z", L(f32, [2])), ("a", L(torch.uint8, [1]))])),
                             ("b", L(torch.int16, [3])), ("a", L(f32, [1]))]),
    "empty": N([]),
    "empty_nested": N([("x", L(f32, [1])), ("sub", N([])), ("deep", N([("deeper", N([]))]))]),
    "locked": N([("a", L(f32, [2, 2])), ("n", N([("b", L(i64, [2]))], [2]))], [2], locked=True),
    "device_cpu": N([("a", L(f32, [3])), ("n", N([("b", L(torch.int32, [3, 1]))], [3], device="cpu"))],
                    [3], device="cpu"),
    "zero_batch": N([("a", L(f32, [0, 4])), ("n", N([("b", L(i64, [0]))], [0]))], [0]),
    "pad_before_wide": N([("byte", L(torch.uint8, [1])), ("d", L(torch.float64, [3])),
                          ("c", L(torch.complex128, [2]))]),
    "two_byte_odd": N([("bf", L(torch.bfloat16, [3])), ("h", L(torch.float16, [5])),
                       ("c32", L(torch.complex32, [3])), ("u16", L(torch.uint16, [7]))]),
    "unsigned_wide": N([("u32", L(torch.uint32, [3])), ("u64", L(torch.uint64, [2, 2])),
                        ("u8", L(torch.uint8, [13]))]),
    "many_small": N([(f"k{i}", N([(f"j{j}", L(NARROW_DTYPES[(i + j) % len(NARROW_DTYPES)], [1 + (i * j) % 5])) for j in range(8)]))
                     for i in range(12)]),
    # Non-tensor entries at several levels, between leaves, with every kind of JSON-like data.
    "non_tensors": N([
        ("a", L(f32, [3])),
        ("s", NT("hello \u00e9 \U0001F600 \"q\"")),
        ("n", N([("i", NT(-7)), ("x", L(i64, [3, 2])),
                 ("f", NT([1.0, 1e-07, 0.1, 1e16, -0.0, 2.5])),
                 ("deep", N([("cfg", NT({"lr": 0.001, "layers": [64, {"k": None}], "\u65e5": True})),
                             ("only", NT(None, [3, 2, 4]))], [3, 2]))], [3])),
        ("b", NT(False)),
        ("l", NT(["a", 1, None, [], {}])),
        ("t", L(torch.uint8, [3, 5]))], [3]),
    "non_tensors_only": N([("x", NT("a")), ("sub", N([("y", NT({"z": [1, 2]}))]))]),
    "non_tensors_device": N([("x", NT(3)), ("v", L(f32, [2])), ("n", N([("y", NT("d"))], [2], device="cpu"))],
                            [2], device="cpu"),
    "large_leaf": N([("big", L(f32, [1024, 1025])), ("small", L(torch.uint8, [3])),
                     ("big2", L(torch.float64, [300, 301], [["t", 0, 1]]))]),
}


@dataclass
class Case:
    td: TensorDict
    spec: dict
    data: bytes


def make_case(name: str) -> Case:
    gen = torch.Generator().manual_seed(sum(name.encode()))
    data = bytearray()
    td, spec = materialise(CASES[name], gen, data)
    return Case(td, spec, bytes(data))


def run_tool(*args, check=True):
    proc = subprocess.run([str(TOOL), *map(str, args)], capture_output=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"td_layout {args[0]} failed: {proc.stderr.decode()}")
    return proc


def reference_consolidate(td: TensorDict):
    c = td.consolidate(metadata=True)
    return c._consolidated["metadata"], c._consolidated["storage"].numpy().tobytes()


def cpp_consolidate(case: Case, tmp_path: Path, threads: int = 1):
    (tmp_path / "spec.json").write_text(json.dumps(case.spec))
    (tmp_path / "data.bin").write_bytes(case.data)
    out = tmp_path / f"cpp{threads}"
    run_tool("consolidate", tmp_path / "spec.json", tmp_path / "data.bin", out, "--threads", threads)
    return (Path(f"{out}.json").read_text(), Path(f"{out}.sorted.json").read_text(),
            Path(f"{out}.bin").read_bytes())


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def describe(td: TensorDict, blob: bytearray):
    """The structure td_layout's rebuild writes, from a Python TensorDict."""
    entries = []
    for key in td.keys():
        value = td.get(key)
        if is_non_tensor(value):
            entries.append([key, {"non_tensor": value.data, "batch_size": list(value.batch_size),
                                  "device": str(value.device) if value.device is not None else None}])
            continue
        if isinstance(value, TensorDict):
            entries.append([key, describe(value, blob)])
            continue
        b = raw(value)
        entries.append([key, {"dtype": str(value.dtype), "shape": list(value.shape),
                              "offset": len(blob), "nbytes": len(b)}])
        blob += b
    return {"batch_size": list(td.batch_size),
            "device": str(td.device) if td.device is not None else None,
            "locked": td.is_locked, "consolidated": td.is_consolidated(), "entries": entries}


def leaves_by_key(td: TensorDict):
    return {k: v for k, v in td.items(include_nested=True, leaves_only=True)}


def assert_same_td(got: TensorDict, want: TensorDict):
    assert got.batch_size == want.batch_size
    got_leaves, want_leaves = leaves_by_key(got), leaves_by_key(want)
    assert set(got_leaves) == set(want_leaves)  # the rebuild lists leaves before levels
    for key, w in want_leaves.items():
        g = got_leaves[key]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), key
        assert raw(g) == raw(w), key
    for key, w in want.items(include_nested=True):
        if is_non_tensor(w):
            g = got.get(key)
            assert is_non_tensor(g), key
            assert (g.data, g.batch_size) == (w.data, w.batch_size), key
        elif isinstance(w, TensorDict):
            assert got.get(key).batch_size == w.batch_size, key


# ---- the comparison -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_storage_and_metadata_equal_the_reference(name, tmp_path):
    case = make_case(name)
    py_meta, py_storage = reference_consolidate(case.td)
    threads = 3 if name == "large_leaf" else 1
    cpp_json, cpp_sorted, cpp_storage = cpp_consolidate(case, tmp_path, threads)
    assert cpp_storage == py_storage
    assert cpp_json == json.dumps(py_meta)
    assert cpp_sorted == json.dumps(py_meta, sort_keys=True)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_rebuilds_our_output(name, tmp_path):
    case = make_case(name)
    cpp_json, _, cpp_storage = cpp_consolidate(case, tmp_path)
    storage = torch.frombuffer(bytearray(cpp_storage), dtype=torch.uint8) if cpp_storage else \
        torch.empty(0, dtype=torch.uint8)
    rebuilt = _rebuild_tensordict_files_consolidated(json.loads(cpp_json), storage)
    assert_same_td(rebuilt, case.td)
    assert rebuilt.is_locked == case.td.is_locked


@pytest.mark.parametrize("name", list(CASES))
def test_we_rebuild_the_reference_output(name, tmp_path):
    case = make_case(name)
    py_meta, py_storage = reference_consolidate(case.td)
    (tmp_path / "meta.json").write_text(json.dumps(py_meta))
    (tmp_path / "storage.bin").write_bytes(py_storage)
    run_tool("rebuild", tmp_path / "meta.json", tmp_path / "storage.bin", tmp_path / "ours")
    storage = torch.frombuffer(bytearray(py_storage), dtype=torch.uint8) if py_storage else \
        torch.empty(0, dtype=torch.uint8)
    theirs = _rebuild_tensordict_files_consolidated(json.loads(json.dumps(py_meta)), storage)
    blob = bytearray()
    assert json.loads((tmp_path / "ours.json").read_text()) == describe(theirs, blob)
    assert (tmp_path / "ours.bin").read_bytes() == bytes(blob)
    assert_same_td(theirs, case.td)


def test_worked_example_hash_and_pipe_line(tmp_path):
    """docs/wire-format.md §3.4: the 449-byte pipe line and the schema hash."""
    case = make_case("worked_example")
    py_meta, _ = reference_consolidate(case.td)
    _, cpp_sorted, _ = cpp_consolidate(case, tmp_path)
    digest = "e663caff9de6198fd53ec0c1e2aa0da56dddf471e515ef988288b645717eca3e"
    assert hashlib.sha256(json.dumps(py_meta, sort_keys=True).encode()).hexdigest() == digest
    assert hashlib.sha256(cpp_sorted.encode()).hexdigest() == digest
    line = json.dumps({**py_meta, "_total_bytes": 96, "_device": "cpu"}, sort_keys=True)
    assert len(line) == 449
    (tmp_path / "line.json").write_text(line)
    assert run_tool("dumps", tmp_path / "line.json", "--sort").stdout.decode() == line
    unsorted = json.dumps({**py_meta, "_total_bytes": 96, "_device": "cpu"})
    (tmp_path / "unsorted.json").write_text(unsorted)
    assert run_tool("dumps", tmp_path / "unsorted.json").stdout.decode() == unsorted


def test_transport_keys_are_ignored_where_the_reference_crashes(tmp_path):
    """docs/wire-format.md §6.5.7: "_storage_device" left in the metadata breaks the reference."""
    case = make_case("worked_example")
    py_meta, py_storage = reference_consolidate(case.td)
    polluted = {**py_meta, "_total_bytes": len(py_storage), "_storage_device": "cpu"}
    with pytest.raises(Exception):
        _rebuild_tensordict_files_consolidated(
            json.loads(json.dumps(polluted)), torch.frombuffer(bytearray(py_storage), dtype=torch.uint8))
    (tmp_path / "meta.json").write_text(json.dumps(polluted))
    (tmp_path / "storage.bin").write_bytes(py_storage)
    run_tool("rebuild", tmp_path / "meta.json", tmp_path / "storage.bin", tmp_path / "ours")


def _corrupt_stop(m):
    m["c"]["leaves"]["d"][2:4] = [4096, 4128]


def _corrupt_dtype(m):
    m["leaves"]["a"][0] = "torch.float8_e4m3fn"


def _corrupt_overlap(m):
    m["leaves"]["b"][2] = 8
    m["leaves"]["b"][3] = 56


def _corrupt_shape(m):
    m["c"]["leaves"]["d"][1] = [4, 2]


def _corrupt_nested_scalar(m):
    m["c"]["extra"] = 3


@pytest.mark.parametrize("corrupt, needle", [
    (_corrupt_stop, "past the end of the 96-byte storage"),
    (_corrupt_dtype, "cannot carry"),
    (_corrupt_overlap, "overlap"),
    (_corrupt_shape, "(64 bytes)"),
    (_corrupt_nested_scalar, "not a nested node"),
])
def test_corrupted_reference_metadata_is_refused(corrupt, needle, tmp_path):
    case = make_case("worked_example")
    py_meta, py_storage = reference_consolidate(case.td)
    meta = json.loads(json.dumps(py_meta))
    corrupt(meta)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "storage.bin").write_bytes(py_storage)
    proc = run_tool("rebuild", tmp_path / "meta.json", tmp_path / "storage.bin", tmp_path / "o", check=False)
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert err.startswith("ValueError: ") and needle in err, err


def test_there_are_at_least_20_cases():
    assert len(CASES) >= 20
