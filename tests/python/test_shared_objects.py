"""Data that reuses one object many times: a pickle's memo, one Python str in many
entries. Ours holds what the reference holds once (JsonValue's shared nodes, the conversion
scopes of python/csrc/tensor_dict.cpp) and refuses, by name, what would expand it beyond
kMaxJsonExpansion when written out in full (docs/reliability.md).

Each hostile case runs in a fresh interpreter; memory is the growth of its peak RSS (VmHWM,
reset through /proc/self/clear_refs) over its RSS just before the case."""
import io
import json
import pickle

import pytest
import torch
import torch.distributed as dist

import tensordict as ref
from tensordict_cpp import NonTensorData, TensorDict
from tensordict_cpp._non_tensor import _rebuild_stack
from tensordict_cpp._td import _rebuild_tensordict
from tensordict_cpp.distributed import run

from test_hostile_inputs import RUN, in_fresh_process, peak_mb, rss_mb

MiB = 1 << 20


class _Rebuild:
    """torch.save writes `fn(*args)` as the call a weights_only load makes."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _laughs(levels=5):
    # One 1 KiB str referenced 32 times, that list 32 times, five levels: 32 GiB written out.
    value = "x" * 1024
    for _ in range(levels):
        value = [value] * 32
    return value


def _saved(obj, path):
    torch.save(obj, path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared")
    big = "y" * (8 * MiB)
    return {
        "laughs": _saved(_Rebuild(_rebuild_tensordict, [("a", NonTensorData(_laughs()))], [],
                                  None, False), d / "laughs.pt"),
        # The same list as a plain value, which a TensorDict makes a NonTensorStack of.
        **{f"plain{n}": _saved(_Rebuild(_rebuild_tensordict, [("a", _laughs(n))], [], None,
                                        False), d / f"plain{n}.pt") for n in (5, 6)},
        "entries": _saved(_Rebuild(_rebuild_tensordict,
                                   [(f"k{i}", NonTensorData(big)) for i in range(256)], [], None,
                                   False), d / "entries.pt"),
        "stack": _saved(_Rebuild(_rebuild_tensordict,
                                 [("s", _Rebuild(_rebuild_stack,
                                                 [NonTensorData(big) for _ in range(256)], 0,
                                                 None))], [256], None, False), d / "stack.pt"),
    }


def _measure(code):
    """Runs `code` (which sets `result`) in a fresh interpreter after `before = rss_mb()`, its
    address space capped at 6 GiB (a case that expands fails there, not in the machine);
    returns (peak growth in MB, printed result)."""
    out = in_fresh_process(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import pickle
        import torch
        import tensordict_cpp
        from test_hostile_inputs import peak_mb, rss_mb
        before = rss_mb()
        {code}
        print(peak_mb() - before)
        print(result)
    """)
    growth, result = out.split("\n", 1)
    return float(growth), result.strip()


def test_billion_laughs_through_torch_load(files):
    growth, result = _measure(f"""
        td = torch.load({str(files["laughs"])!r}, weights_only=True)
        value = td["a"]  # one Python list reused, as the reference's unpickled data
        assert value[0] is value[1] and len(value[31][31][31][31][31]) == 1024
        blob = pickle.dumps(td)  # Python's pickler keeps the sharing: a small pickle
        assert len(blob) < 10_000 and pickle.loads(blob)["a"][5][5][5][5][5] == "x" * 1024
        try:
            td.consolidate(filename={str(files["laughs"]) + ".td"!r})  # JSON text: expands
            result = "consolidated"
        except ValueError as e:
            result = str(e)
    """)
    print(f"billion laughs: {result} -- peak RSS growth {growth:.1f} MB")
    assert "writing it out in full would take about" in result and "key 'a'" in result
    assert growth < 100


# A list value becomes a NonTensorStack with a member per element, as the reference's (its
# TensorDict(a=x) builds all 33,554,432 members of x: MemoryError after +5.3 GB and 75 s under
# this cap). Each use of a shared list is a member of its own, so the members are counted
# first, in O(distinct lists), and refused past kMaxJsonExpansion beyond the list's distinct
# items, by key and budget.
SHARED_LIST_REFUSED = ("the non-tensor value of key 'a': as a NonTensorStack it would have {} "
                       "members")


@pytest.mark.parametrize("levels", [5, 6])
def test_billion_laughs_as_a_plain_list_through_torch_load(files, levels):
    growth, result = _measure(f"""
        try:
            torch.load({str(files[f"plain{levels}"])!r}, weights_only=True)
            result = "loaded"
        except ValueError as e:
            result = str(e)
    """)
    print(f"billion laughs, a plain list of {levels} levels, torch.load: {result} -- peak RSS "
          f"growth {growth:.1f} MB")
    members = sum(32 ** k for k in range(1, levels + 1))
    assert result.startswith(SHARED_LIST_REFUSED.format(members))
    assert "the limit is 268435456 bytes" in result
    assert growth < 100


def test_billion_laughs_as_a_plain_list_in_a_tensordict():
    growth, result = _measure("""
        value = "x" * 1024
        for _ in range(5):
            value = [value] * 32
        try:
            tensordict_cpp.TensorDict(a=value)
            result = "built"
        except ValueError as e:
            result = str(e)
    """)
    print(f"billion laughs, TensorDict(a=x): {result} -- peak RSS growth {growth:.1f} MB")
    assert result.startswith(SHARED_LIST_REFUSED.format(34_636_832))
    assert "the limit is 268435456 bytes" in result
    assert growth < 100


def test_a_list_that_reuses_rows_within_the_budget_is_the_references_stack():
    rows = [["x"] * 100] * 1000  # 100,000 elements from 1,100 items
    ours, theirs = TensorDict(a=rows).get("a"), ref.TensorDict(a=rows).get("a")
    assert type(ours).__name__ == type(theirs).__name__ == "NonTensorStack"
    assert ours.batch_size == theirs.batch_size == torch.Size([1000, 100])
    assert ours.tolist() == theirs.tolist() == rows


@pytest.mark.parametrize("case", ["entries", "stack"])
def test_one_8_mib_string_in_256_entries_through_torch_load(files, case):
    growth, result = _measure(f"""
        td = torch.load({str(files[case])!r}, weights_only=True)
        if {case!r} == "entries":  # each read makes a Python str: one at a time
            assert all(len(td[f"k{{i}}"]) == 8 << 20 for i in range(256))
        else:  # one list of 256 references to one str, as the reference's
            values = td["s"]
            assert len(values) == 256 and values[0] is values[255] and len(values[0]) == 8 << 20
        import io
        again = io.BytesIO()
        torch.save(td, again)  # one Python str for the shared value: written once, as it came
        result = f"{{type(td).__name__}}, saved again in {{len(again.getvalue())}} bytes"
        assert len(again.getvalue()) < 9 << 20
    """)
    print(f"8 MiB str x 256 ({case}), torch.load: {result} -- peak RSS growth {growth:.1f} MB")
    assert growth < 8 + 100


# ---- from_remote_init: a peer's metadata pickle reusing one str through the memo -------------
def _sharing_peer(rank, world_size, stack):
    torch.set_num_threads(1)
    big = "z" * (8 * MiB)
    if rank == 0:  # the reference's init_remote: its pickler memoizes the one str
        if stack:
            nts = ref.NonTensorStack(*[ref.NonTensorData(big) for _ in range(256)])
            td = ref.TensorDict(s=nts, x=torch.ones(4), batch_size=[])
        else:
            entries = {f"k{i}": ref.NonTensorData(big) for i in range(256)}
            td = ref.TensorDict(dict(entries, x=torch.ones(4)), batch_size=[])
        td.init_remote(dst=1)
    else:
        before = rss_mb()
        got = TensorDict.from_remote_init(src=0)
        growth = peak_mb() - before
        n = len(got["s"]) if stack else sum(1 for k in got.keys() if k.startswith("k"))
        print(f"from_remote_init, 8 MiB str x 256 ({'stack' if stack else 'entries'}): "
              f"received {n} -- peak RSS growth {growth:.1f} MB", flush=True)
        assert n == 256 and growth < 8 + 100
    dist.barrier()


class _bind:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self, rank, world_size):
        return self.fn(rank, world_size, *self.args)


@pytest.mark.parametrize("stack", [False, True])
def test_one_8_mib_string_in_256_entries_from_a_peer(stack):
    run(_bind(_sharing_peer, stack), 2, **RUN)


# ---- consolidated files: the value budget of meta.json ----------------------------------------
def _write_consolidated(path, meta):
    text = json.dumps(meta).encode()
    with open(path, "wb") as f:
        f.write(text + len(text).to_bytes(8, "little"))


def _node(non_tensors=None, leaves=None):
    return {"cls": "TensorDict", "non_tensors": non_tensors or {}, "leaves": leaves or {},
            "cls_metadata": {"device": None, "names": [], "batch_size": [], "is_locked": False}}


def _load(path):
    """(peak growth, growth kept, result) of from_consolidated(path) in a fresh process."""
    out = in_fresh_process(f"""
        import tensordict_cpp
        from test_hostile_inputs import peak_mb, rss_mb, _status_mb
        before = rss_mb()
        try:
            td = tensordict_cpp.TensorDict.from_consolidated({str(path)!r})
            result = None
        except ValueError as e:
            result = f"ValueError: {{e}}"
        print(peak_mb() - before, _status_mb("VmRSS") - before)  # before the keys are listed
        print(result or f"loaded {{len(list(td.keys()))}} entries")
    """)
    figures, result = out.split("\n", 1)
    peak, kept = (float(x) for x in figures.split())
    return peak, kept, result.strip()


def test_a_consolidated_200_mib_string_is_held_once(tmp_path):
    big = tmp_path / "big.td"
    TensorDict(s=NonTensorData("w" * (200 * MiB)), x=torch.ones(4), batch_size=[]).consolidate(
        filename=str(big))
    peak, kept, result = _load(big)
    print(f"consolidated file, a 200 MiB str: {result} -- peak RSS growth {peak:.0f} MB, "
          f"{kept:.0f} MB kept")
    assert result.startswith("loaded")
    assert kept < 200 + 50  # held once
    assert peak < 2 * 200 + 100  # the text read and the value built, each once



def test_consolidated_1e6_empty_leaves_cost_the_tensordict(tmp_path):
    # What the metadata costs beyond the TensorDict of 1e6 views it builds.
    leaves = tmp_path / "leaves.td"
    _write_consolidated(leaves, _node(leaves={f"l{i}": ["torch.float32", [0], 0, 0, 0]
                                              for i in range(1_000_000)}))
    peak, kept, result = _load(leaves)
    print(f"consolidated file, 1e6 empty leaves: {result} -- peak RSS growth {peak:.0f} MB, "
          f"{kept:.0f} MB kept (the TensorDict)")
    assert result == "loaded 1000000 entries" and peak - kept < 100



def test_consolidated_values_beyond_the_budget_are_refused(tmp_path):
    # 15 MB of small integers: 13 bytes of values per byte of text, refused before they exist.
    ints = tmp_path / "ints.td"
    _write_consolidated(ints, _node(non_tensors={"v": [[1] * 5_000_000, [], None]}))
    peak, kept, result = _load(ints)
    print(f"consolidated file, 5e6 small ints: {result:.300} -- peak RSS growth {peak:.0f} MB")
    assert "non-tensor values would take more than" in result and str(ints) in result
    # The text (15 MB) and the JSON reader's arena (20 bytes a value: 100 MB), not the values
    # (40 bytes each, 200 MB).
    assert peak < 200


# ---- nesting: dicts as deep as lists ----------------------------------------------------------
def _nested(n):
    d = {}
    cur = d
    for _ in range(n):
        cur["k"] = {}
        cur = cur["k"]
    return d


def test_deep_and_self_referencing_dicts_are_value_errors():
    with pytest.raises(ValueError, match="nested deeper than 512 levels"):
        TensorDict({"a": _nested(5000)}, [])
    loop = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="nested deeper than 512 levels"):
        TensorDict({"a": loop}, [])
    ok = TensorDict({"a": _nested(500)}, [])
    assert len(list(ok.keys(True))) == 501
    # through a pickle, and as non-tensor data (a self-referencing list too)
    deep = _nested(5000)
    blob = io.BytesIO()
    import sys
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        torch.save(_Rebuild(_rebuild_tensordict, [("a", deep)], [], None, False), blob)
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(ValueError, match="nested deeper than 512 levels"):
        torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    lst = []
    lst.append(lst)
    td = TensorDict({}, [])
    with pytest.raises(ValueError, match="nested deeper than 512 levels"):
        td.set_non_tensor("l", loop)
    with pytest.raises(ValueError, match="nested deeper than 512 levels"):
        td.set_non_tensor("l", lst)
    pickle.loads(pickle.dumps(TensorDict({"a": _nested(100)}, [])))
