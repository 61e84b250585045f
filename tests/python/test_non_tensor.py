"""Non-tensor entries (JSON-like data beside the tensors) against the reference tensordict:
the Python API (conversions, keys, repr, batch operations, errors), the metadata pickle, the
pipe's bytes in both directions, and the distributed transfers with the reference on the other
side (per-leaf transfers skip them without a tag; init_remote, broadcast, all_gather and
scatter deliver them)."""
import os

# Before anything creates a UCX context (as tests/python/test_pipe.py does).
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import asyncio  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pickle  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import tensordict  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from conftest import built, describe, from_reference, to_reference  # noqa: E402
from tensordict_cpp import NonTensorData, TensorDict  # noqa: E402
from tensordict_cpp import set_printoptions as tdc_set_printoptions  # noqa: E402
from reference_peer import REFERENCES, on_reference  # noqa: E402

Ref = tensordict.TensorDict


def sample(cls, fill=1.0, who="sender"):
    """Leaves _, a/a2, a/b, c (sorted wire order) with non-tensor entries sorting before,
    between and after them, at three levels, with every kind of JSON-like data."""
    td = cls({"c": torch.full((3, 2), fill), "_": torch.full((3,), fill)}, batch_size=[3])
    td["a", "b"] = torch.full((3,), fill, dtype=torch.float64)
    td["a", "a2"] = torch.full((3, 4), int(fill), dtype=torch.int32)
    td["0"] = who
    td.set_non_tensor(("a", "a0"), {"who": who, "lr": 1e-07, "layers": [64, None, True]})
    td.set_non_tensor(("a", "a5"), 5)
    td.set_non_tensor("bb", None)
    td.set_non_tensor(("d", "deep", "x"), [who, 2.5, {"k": "\u00e9\U0001f600"}])
    return td


def check_leaves(td, fill):
    want = {("_",): torch.full((3,), fill), ("c",): torch.full((3, 2), fill),
            ("a", "b"): torch.full((3,), fill, dtype=torch.float64),
            ("a", "a2"): torch.full((3, 4), int(fill), dtype=torch.int32)}
    got = {k if isinstance(k, tuple) else (k,): v
           for k, v in td.items(include_nested=True, leaves_only=True)}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def check_non_tensors(td, who="sender"):
    assert td.get_non_tensor("0") == who
    assert td.get_non_tensor(("a", "a0")) == {"who": who, "lr": 1e-07, "layers": [64, None, True]}
    assert td.get_non_tensor(("a", "a5")) == 5
    assert td.get("bb").data is None  # (the reference's get_non_tensor of None gives a list)
    assert td.get_non_tensor(("d", "deep", "x")) == [who, 2.5, {"k": "\u00e9\U0001f600"}]
    assert td.get(("a", "a0")).batch_size == torch.Size([3])


def nested_list(depth):
    out = []
    for _ in range(depth - 1):
        out = [out]
    return out


# ---- the Python API, against the reference ----------------------------------------------------

VALUES = ["s", "\u00e9", None, [1, 2], [1.5, 2], [[1, 2], [3, 4]], ["a", "b"], [1, "a"],
          [True, False], ["x", None]]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_setitem_converts_as_the_reference(value):
    ours, ref = TensorDict(batch_size=[2]), Ref(batch_size=[2])
    ours["x"] = value
    ref["x"] = value
    got, want = ours.get("x"), ref.get("x")
    assert isinstance(got, torch.Tensor) == isinstance(want, torch.Tensor)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    else:
        # A str or None: a NonTensorData; a list that is not numeric: a NonTensorStack of its
        # items, as the reference makes, which reads back as the same list.
        assert type(got).__name__ == type(want).__name__
        assert ours["x"] == (list(ref["x"]) if isinstance(value, list) else ref["x"]) == value
        assert got.batch_size == want.batch_size == torch.Size([2])


def test_scalars_and_dicts_are_not_non_tensors():
    ours, ref = TensorDict(), Ref()
    for td in (ours, ref):
        td["i"], td["f"], td["b"], td["d"] = 3, 2.5, True, {"k": 1}
    for key in ("i", "f", "b"):
        assert torch.equal(ours[key], ref[key]) and ours[key].dtype == ref[key].dtype
    assert isinstance(ours["d"], TensorDict) and torch.equal(ours["d", "k"], ref["d", "k"])


def test_set_and_get_non_tensor_as_the_reference():
    ours, ref = TensorDict(a=torch.zeros(3), batch_size=[3]), Ref(a=torch.zeros(3), batch_size=[3])
    for td in (ours, ref):
        assert td.set_non_tensor(("n", "cfg"), {"lr": 0.1, "k": [1, None]}) is td
        td.set_non_tensor("i", 7)
    for key in (("n", "cfg"), "i", "a"):
        a, b = ours.get_non_tensor(key), ref.get_non_tensor(key)
        assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), key
    assert ours.get_non_tensor("missing", "default") == ref.get_non_tensor("missing", "default")
    with pytest.raises(KeyError):
        ours.get_non_tensor("missing")
    assert ours.is_non_tensor("i") and not ours.is_non_tensor("a")
    assert ours["i"] == 7 and ours["n", "cfg"]["k"] == [1, None]
    assert isinstance(ours.get("i"), NonTensorData)
    assert describe(ours) == describe(ref)


def test_keys_items_and_emptiness_as_the_reference():
    ours, ref = sample(TensorDict), sample(Ref)
    for args in ((), (True,), (True, True), (False, True)):
        assert list(ours.keys(*args)) == list(ref.keys(*args)), args
    # (The reference's items(True) lists a level before its entries, its keys(True) after.)
    assert sorted(map(str, (k for k, _ in ours.items(True)))) == \
        sorted(map(str, (k for k, _ in ref.items(True))))
    assert describe(ours) == describe(ref)
    for make in (lambda cls: cls(x="a"), lambda cls: cls({"n": cls(x="a")})):
        assert make(TensorDict).is_empty() == make(Ref).is_empty() is False


def test_repr_is_the_references():
    ours = sample(TensorDict)
    ours.set_non_tensor("long", "y" * 150 + "\u00e9" * 100)
    ours.set_non_tensor("q", ["it's", 'say "hi"', "tab\t"])
    with tensordict.set_printoptions(compact=False), tdc_set_printoptions(compact=False):
        assert repr(ours) == repr(to_reference(ours))
    assert repr(ours.get("0")) == repr(to_reference(ours).get("0"))


def test_conversion_helpers_round_trip():
    ours = sample(TensorDict)
    assert describe(from_reference(to_reference(ours))) == describe(ours)
    assert describe(to_reference(ours)) == describe(sample(Ref))


@pytest.mark.parametrize("value, error, match", [
    ({1: "a"}, TypeError, "key 'x' is a dict with a key of type int"),
    ([1, {"k": {2}}], TypeError, r"key 'x' at \[1\]\['k'\] is of type set"),
    ((1, "a"), TypeError, "key 'x' is of type tuple"),
    (object(), TypeError, "key 'x' is of type object"),
    (2 ** 63, ValueError, "key 'x' holds an integer outside the int64 range"),
    (nested_list(600), ValueError, "nested deeper than 512"),
])
def test_data_that_is_not_json_like_is_refused(value, error, match):
    td = TensorDict(batch_size=[2])
    with pytest.raises(error, match=match):
        td.set_non_tensor("x", value)
    assert "x" not in td


def test_setitem_of_other_objects_names_the_key():
    td = TensorDict(batch_size=[2])
    with pytest.raises(TypeError, match="key 'x': a TensorDict holds"):
        td["x"] = {1, 2}
    with pytest.raises(TypeError, match="key 'y' is of type set"):
        TensorDict(y=NonTensorData({1}))


def test_batch_size_and_locking():
    td = TensorDict(batch_size=[3])
    td.set("ok", NonTensorData("x", batch_size=[3, 4]))
    td.set("level", NonTensorData("x"))  # empty: the level's batch size
    assert td.get("ok").batch_size == torch.Size([3, 4])
    assert td.get("level").batch_size == torch.Size([3])
    with pytest.raises(ValueError, match=r"key \('n', 'bad'\) has shape \[2\]"):
        td.set(("n", "bad"), NonTensorData("x", batch_size=[2]))
    td.lock_()
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td.set_non_tensor("ok", "y")
    with pytest.raises(RuntimeError, match="Cannot modify locked TensorDict"):
        td["new"] = "y"
    td.unlock_()
    on_cpu = TensorDict(batch_size=[], device="cpu")
    on_cpu["s"] = "x"
    assert on_cpu.get("s").device == torch.device("cpu")


def test_batch_operations_keep_the_data():
    ours, ref = sample(TensorDict), sample(Ref)
    # Where the reference keeps a NonTensorData, the batch sizes agree.
    for op in (lambda t: t[1], lambda t: t[1:], lambda t: t[None], lambda t: t.unbind(0)[2],
               lambda t: t.reshape(3, 1), lambda t: t.unsqueeze(1).squeeze(1),
               lambda t: t.split(2)[1], lambda t: torch.cat([t, t], 0), lambda t: t.clone(),
               lambda t: t.to(torch.float16), lambda t: t.apply(lambda x: x + 1)):
        assert describe(op(ours)) == describe(op(ref))
    # stack makes NonTensorStacks, as the reference, equal data or not; expand keeps the
    # NonTensorData (the reference makes a stack).
    stacked, stacked_ref = torch.stack([ours, ours], 1), torch.stack([ref, ref], 1)
    assert type(stacked.get("0")).__name__ == type(stacked_ref.get("0")).__name__
    assert stacked["0"] == [list(row) for row in stacked_ref["0"]]
    assert stacked.get("0").batch_size == stacked_ref.get("0").batch_size == torch.Size([3, 2])
    assert ours.expand(2, 3).get(("a", "a0")).batch_size == torch.Size([2, 3])
    other, other_ref = sample(TensorDict, who="other"), sample(Ref, who="other")
    mixed = torch.stack([ours, other])
    assert mixed[1]["a", "a0"] == torch.stack([ref, other_ref])[1]["a", "a0"]
    assert torch.cat([ours, other])[4]["0"] == "other"


def test_tensor_like_operations():
    td = sample(TensorDict)
    td.zero_()
    check_non_tensors(td)
    assert td.to("cpu").get("0").device == torch.device("cpu")
    eq = td == td.clone()
    assert eq.all() and eq["0"].shape == torch.Size([3]) and eq["0"].dtype == torch.bool
    assert not (td == sample(TensorDict, who="x")).all()
    assert "0" not in (td == 0).keys()  # a comparison with a scalar leaves them out
    assert td.allclose(sample(TensorDict, 0.0))
    assert not td.allclose(sample(TensorDict, 0.0, who="x"))
    with pytest.raises(TypeError, match="key '0' holds a non-tensor entry"):
        td.fill_("0", 1)
    target = TensorDict(batch_size=[3])
    target.update(td)
    check_non_tensors(target)
    assert (NonTensorData("a", [2]) == NonTensorData("a", [2])).all()  # the reference's __eq__
    assert (NonTensorData("a", [2]) == "b").tolist() == [False, False]


# ---- the metadata pickle and JSON, against the reference's ------------------------------------

def reference_metadata(td):
    return td.consolidate(metadata=True)._consolidated["metadata"]


def test_metadata_pickle_round_trips_the_references():
    meta = reference_metadata(sample(Ref))
    meta["_total_bytes"] = 1234
    result = subprocess.run([str(built("pickle_roundtrip")), "--metadata"], input=pickle.dumps(meta),
                            capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr.decode()
    back = pickle.loads(result.stdout)
    assert back == meta and list(back) == list(meta)
    entry = back["a"]["non_tensors"]["a0"]
    assert type(entry) is tuple and type(entry[0]) is dict and type(entry[0]["layers"]) is list
    assert back["non_tensors"] == {"0": ("sender", [3], None), "bb": (None, [3], None)}


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m["non_tensors"].__setitem__("0", ("x", [4], None)), "does not start with"),
    (lambda m: m["non_tensors"].__setitem__("0", ("x", "3", None)), "must be a list of integers"),
    (lambda m: m["non_tensors"].__setitem__("0", ("x", [3])), r"must be \[data, batch_size"),
    (lambda m: m["non_tensors"].__setitem__("0", ("x", [3], 5)), "must be a string or null"),
    (lambda m: m["non_tensors"].__setitem__("0", ({1: 2}, [3], None)), "only str keys"),
    (lambda m: m["non_tensors"].__setitem__("0", (2 ** 70, [3], None)), "exceeds int64"),
    (lambda m: m["non_tensors"].__setitem__("0", ({3}, [3], None)), "outside the supported"),
    (lambda m: m["non_tensors"].__setitem__("0", (nested_list(300), [3], None)),
     "nesting deeper"),
])
def test_malformed_reference_non_tensors_are_refused(mutate, match):
    meta = reference_metadata(sample(Ref))
    mutate(meta)
    result = subprocess.run([str(built("pickle_roundtrip")), "--metadata"], input=pickle.dumps(meta),
                            capture_output=True, timeout=30)
    assert result.returncode == 2
    assert re.search(match, result.stderr.decode()), result.stderr.decode()


# ---- the pipe: our bytes against the reference's, and the reference's bytes into ours ----------

class Recorder:
    """Stands in for a ucxx endpoint: records the messages the reference's pipe sends."""

    def __init__(self):
        self.messages = []

    async def send(self, buf):
        if isinstance(buf, torch.Tensor):
            buf = buf.cpu().numpy()
        self.messages.append(bytes(memoryview(buf).cast("B")))


def reference_pipe_messages(td, consolidated):
    """The messages (one ucxx tag message each) of the reference's pipe for one send."""
    from tensordict._ucxx import TensorDictPipe as RefPipe

    ep = Recorder()
    asyncio.run(RefPipe(ep, consolidated=consolidated).asend(td))
    return ep.messages


def pipe_pair(**opts):
    from tensordict_cpp import TensorDictPipe

    opts = {"timeout": 5.0, **opts}
    server = TensorDictPipe.listen_sync(0, "127.0.0.1", **opts)
    client = TensorDictPipe.connect_sync("127.0.0.1", server.port, **opts)
    return server, client


@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "uncollated"])
def test_pipe_messages_equal_the_references(consolidated):
    want = reference_pipe_messages(sample(Ref), consolidated)
    server, client = pipe_pair(consolidated=consolidated)
    with server, client:
        client.send(sample(TensorDict))
        raw = server._cpp
        if consolidated:
            assert len(want) == 4  # flag, length, metadata, storage
            assert raw._recv_raw(1) == want[0] == b"\x00"
            (n,) = struct.unpack("<Q", raw._recv_raw(8))
            text = raw._recv_raw(n)
            # Insertion order, the transport keys last, as 0.15.3 writes it (docs/wire-format.md
            # §6.1): the same bytes, non-tensor data included.
            assert len(text) == n == struct.unpack("<Q", want[1])[0]
            assert text == want[2]
            assert json.loads(text)["a"]["non_tensors"]["a0"][0]["lr"] == 1e-07
            assert raw._recv_raw(len(want[3])) == want[3]
        else:
            (n,) = struct.unpack("<Q", raw._recv_raw(8))
            assert struct.pack("<Q", n) == want[0]
            assert raw._recv_raw(n) == want[1]  # the header with its non_tensors
            for leaf in want[2:]:  # one message per leaf
                assert raw._recv_raw(len(leaf)) == leaf


@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "uncollated"])
def test_pipe_receives_the_references_bytes(consolidated):
    ref = sample(Ref)
    ref.set_non_tensor("nan", float("nan"))  # json.dumps writes NaN; we read it
    messages = reference_pipe_messages(ref, consolidated)
    server, client = pipe_pair(consolidated=consolidated)
    with server, client:
        for message in messages:
            client._cpp._send_raw(message)
        got = server.recv()
    check_leaves(got, 1.0)
    check_non_tensors(got)
    assert math.isnan(got["nan"])
    if consolidated:  # the reference's rebuild order: non-tensors, leaves, nested levels
        assert list(got.keys()) == ["0", "bb", "nan", "c", "_", "a", "d"]


def test_pipe_refuses_malformed_non_tensors():
    meta = reference_metadata(sample(Ref))
    meta["non_tensors"]["0"] = ["x", [4], None]
    meta.update(_total_bytes=int(sample(Ref).consolidate()._consolidated["storage"].numel()),
                _device="cpu")
    text = json.dumps(meta, sort_keys=True).encode()
    server, client = pipe_pair()
    with server, client:
        for message in (b"\x00", struct.pack("<Q", len(text)), text):
            client._cpp._send_raw(message)
        with pytest.raises(ValueError, match="non-tensor entry '0' has batch_size"):
            server.recv()


# ---- distributed, with the reference on rank 0 -------------------------------------------------

REF = 0


def interop(rank, world_size):
    torch.set_num_threads(1)
    cls = Ref if rank == REF else TensorDict
    who = "reference" if rank == REF else "ours"

    # Per leaf, both directions and both tag modes: the receiver keeps its own non-tensor
    # entries, and recv returns the same last tag as the reference (4 tensors, no more).
    for sender, receiver in ((0, 1), (1, 0)):
        for kw in ({"init_tag": 3}, {"init_tag": 5, "pseudo_rand": True}):
            later = {**kw, "init_tag": kw["init_tag"] + 50}
            if rank == sender:
                sample(cls, 7.0, who).send(dst=receiver, **kw)
                sample(cls, 8.0, who).isend(dst=receiver, **later)
            elif rank == receiver:
                td = sample(cls, 0.0, who)
                last = td.recv(src=sender, **kw)
                check_leaves(td, 7.0)
                check_non_tensors(td, who)
                tag = kw["init_tag"] - 1
                for _ in range(4):
                    tag = tensordict.utils.int_generator(tag + 1) if kw.get("pseudo_rand") else tag + 1
                assert last == tag
                td.irecv(src=sender, **later)
                check_leaves(td, 8.0)
                check_non_tensors(td, who)

    # The reference's TestInitRemoteNonTensor (a non-tensor label through init_remote), both
    # directions, then richer data.
    for sender, receiver in ((0, 1), (2, 0)):
        if rank == sender:
            td = cls(a=torch.ones(3), batch_size=[3])
            td["label"] = "hello"
            td["c"] = torch.full((3, 2), 2.0)
            td.init_remote(dst=receiver)
            sample(cls, 3.0, who).consolidate(metadata=True).init_remote(dst=receiver)
        elif rank == receiver:
            td = cls.from_remote_init(src=sender)
            assert set(td.keys()) == {"a", "label", "c"}
            assert (td["a"] == 1).all() and (td["c"] == 2).all() and td["label"] == "hello"
            assert td.is_consolidated()
            td = cls.from_remote_init(src=sender)
            check_leaves(td, 3.0)
            check_non_tensors(td, "reference" if sender == REF else "ours")

    for root in (0, 2):  # init_remote(use_broadcast=True)
        if rank == root:
            sample(cls, 4.0, who).init_remote(use_broadcast=True)
        else:
            td = cls.from_remote_init(src=root, use_broadcast=True)
            check_non_tensors(td, "reference" if root == REF else "ours")

    for root in (0, 1):  # broadcast
        mine = sample(cls, 5.0, who) if rank == root else cls({}, [])
        out = mine.broadcast(src=root)
        check_leaves(out, 5.0)
        check_non_tensors(out, "reference" if root == REF else "ours")

    outs = sample(cls, 10.0 + rank, f"rank{rank}").all_gather()
    for r, out in enumerate(outs):
        check_leaves(out, 10.0 + r)
        check_non_tensors(out, f"rank{r}")

    for root in (0, 2):  # scatter
        tds = [sample(cls, 20.0 + r, f"for{r}") for r in range(3)] if rank == root else None
        out = cls({}, []).scatter(src=root, tensordicts=tds)
        check_leaves(out, 20.0 + rank)
        check_non_tensors(out, f"for{rank}")

    td = sample(cls, rank + 1.0, who)  # all_reduce and reduce skip them
    td.all_reduce()
    check_leaves(td, 6.0)
    check_non_tensors(td, who)
    td = sample(cls, rank + 1.0, who)
    td.reduce(2)
    check_non_tensors(td, who)
    dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_interop_with_the_reference_three_ranks(reference):
    from tensordict_cpp.distributed import run

    run(on_reference(reference, interop), world_size=3, timeout=150, group_timeout=20)
