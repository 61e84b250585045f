#!/usr/bin/env python3
"""Regenerates the seed corpora of the fuzz targets (fuzz/corpus/<target>/) from real outputs of
the reference tensordict (0.15.3, in the repo's .venv): consolidated metadata and storages, the
pickles its init_remote / broadcast / scatter send, and the bytes its TensorDictPipe sends
(recorded from a stand-in endpoint). Also writes the libFuzzer dictionaries fuzz/<target>.dict.

    .venv/bin/python fuzz/make_corpus.py

Seeds are named seed-*; regression inputs (crash-*, from findings) are kept as they are.
"""
import asyncio
import hashlib
import json
import os
import pickle
import struct
import sys
import tempfile

import torch
from tensordict import (LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict,
                        tensorclass)
from tensordict._ucxx import TensorDictPipe

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


@tensorclass
class Inner:
    q: torch.Tensor


@tensorclass
class Outer:
    x: torch.Tensor
    inner: Inner


def tds():
    """Varied TensorDicts, as (name, td)."""
    g = torch.Generator().manual_seed(0)
    out = []
    # docs/wire-format.md §3.4, the worked example.
    out.append(("worked_example", TensorDict(
        a=torch.arange(4, dtype=torch.float32), b=torch.arange(12, dtype=torch.float32).reshape(4, 3),
        c=TensorDict(d=torch.arange(4), batch_size=[4]), batch_size=[4])))
    # §3.4, the padding example.
    out.append(("padding", TensorDict(
        x=torch.ones(3), y=torch.tensor([True, False, True, True, False]),
        z=torch.tensor(2.5, dtype=torch.float64), batch_size=[])))
    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
              torch.uint16, torch.uint32, torch.uint64]
    out.append(("dtypes", TensorDict(
        {str(d).replace("torch.", ""): torch.randint(0, 3, (2, 3), generator=g).to(d)
         for d in dtypes}, batch_size=[2])))
    deep = TensorDict(leaf=torch.zeros(2, 1), batch_size=[2])
    for i in range(6):
        deep = TensorDict({f"level{i}": deep, f"x{i}": torch.full((2, i + 1), float(i))},
                          batch_size=[2])
    out.append(("deep", deep))
    named = TensorDict(obs=torch.randn(3, 2, 5, generator=g), act=torch.randint(0, 9, (3, 2), generator=g),
                       batch_size=[3, 2], device="cpu", names=["time", "env"])
    named["next"] = TensorDict(obs=torch.randn(3, 2, 5, generator=g), batch_size=[3, 2])
    named.lock_()
    out.append(("named_locked_cpu", named))
    out.append(("empty", TensorDict({}, batch_size=[])))
    out.append(("zero_sized", TensorDict(e=torch.zeros(0, 3), f=torch.zeros(0), batch_size=[0])))
    out.append(("unicode_keys", TensorDict(
        {"é": torch.ones(1), "日本": torch.zeros(2, dtype=torch.int16),
         'quote"back\\slash': torch.ones(3, dtype=torch.bool),
         "nest": TensorDict({"\U0001f600": torch.ones(1, dtype=torch.float64)}, batch_size=[])},
        batch_size=[])))
    out.append(("odd_sizes", TensorDict(
        h=torch.ones(3, dtype=torch.float16), i=torch.ones(7, dtype=torch.int8),
        c=torch.ones(1, dtype=torch.complex128), s=torch.ones(5, dtype=torch.int16), batch_size=[])))
    # At the bounds: 64 nested levels (kMaxMetadataDepth) and a few hundred leaves.
    deepest = TensorDict(leaf=torch.ones(1), batch_size=[])
    for i in range(63):
        deepest = TensorDict({"n": deepest}, batch_size=[])
    out.append(("deep64", deepest))
    small = [d for d in dtypes if d is not torch.complex128]
    out.append(("many_leaves", TensorDict(
        # (no complex128: the reference cannot view one at 8 mod 16, docs/wire-format.md §7.10)
        {f"k{i}": torch.full((i % 5,), i % 2, dtype=small[i % len(small)]) for i in range(200)},
        batch_size=[])))
    nt = TensorDict(a=torch.ones(2), batch_size=[2])
    nt["text"] = NonTensorData("hello", batch_size=[2])
    out.append(("non_tensor", nt))
    # Non-tensor entries at three levels, with every kind of JSON-like data (NaN included).
    nts = TensorDict(x=torch.arange(3), batch_size=[3])
    nts.set_non_tensor("label", "h\u00e9llo \U0001f600")
    nts.set_non_tensor(("cfg", "opt"), {"lr": 1e-07, "betas": [0.9, 0.999], "nan": float("nan"),
                                        "inf": float("-inf"), "flag": True, "none": None})
    nts.set_non_tensor(("cfg", "deep", "ids"), [1, -2, 9223372036854775807, [], {}])
    nts["cfg", "w"] = torch.ones(3, 2)
    out.append(("non_tensors_nested", nts))
    # NonTensorStack nodes: a flat stack, a 2-D one, and one stacked along dim 1.
    stacks = TensorDict(x=torch.arange(3), batch_size=[3])
    stacks["text"] = NonTensorStack("a", "b\u00e9", "c")
    stacks["n", "grid"] = NonTensorStack(*[NonTensorStack(f"{i}a", f"{i}b") for i in range(3)])
    stacks["n", "dim1"] = NonTensorStack(NonTensorData("x", batch_size=[3]),
                                         NonTensorData("y", batch_size=[3]), stack_dim=1)
    out.append(("non_tensor_stack", stacks))
    try:
        out.append(("lazy_stack", LazyStackedTensorDict.lazy_stack(
            [TensorDict(a=torch.ones(2)), TensorDict(a=torch.zeros(2))], 0)))
    except Exception as e:  # a layout this version cannot consolidate
        print("skipping lazy_stack:", e, file=sys.stderr)
    # Tensorclass nodes: "cls" is the class itself (__main__.Inner / __main__.Outer), pickled as
    # STACK_GLOBAL, which our reader keeps as an inert class reference.
    inner = Inner(q=torch.arange(6.0).reshape(3, 2), batch_size=[3])
    out.append(("tensorclass_nodes", TensorDict(
        inner=inner, outer=Outer(x=torch.ones(3), inner=inner.clone(), batch_size=[3]),
        y=torch.zeros(3, dtype=torch.int64), batch_size=[3])))
    return out


def consolidated(td):
    tdc = td.consolidate(metadata=True)
    return tdc, tdc._consolidated["metadata"], tdc._consolidated["storage"]


class Recorder:
    """Stands in for a ucxx endpoint: records what the pipe sends."""

    def __init__(self):
        self.data = bytearray()

    async def send(self, buf):
        if isinstance(buf, torch.Tensor):
            buf = buf.cpu().numpy()
        self.data += bytes(memoryview(buf).cast("B"))


def pipe_bytes(td, consolidated_mode, times=2):
    ep = Recorder()
    pipe = TensorDictPipe(ep, consolidated=consolidated_mode)

    async def go():
        for _ in range(times):
            await pipe.asend(td)

    asyncio.run(go())
    return bytes(ep.data)


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"seed-{name}"), "wb") as f:
        f.write(data)


def write_dict(target, tokens):
    with open(os.path.join(HERE, f"{target}.dict"), "w") as f:
        f.write(f"# libFuzzer dictionary for fuzz_{target}; written by fuzz/make_corpus.py\n")
        for t in tokens:
            if isinstance(t, str):
                t = t.encode()
            esc = "".join(chr(b) if 0x20 <= b < 0x7f and b not in b'"\\' else f"\\x{b:02x}"
                          for b in t)
            f.write(f'"{esc}"\n')


def checked_seeds():
    """Inputs of fuzz/checked.cpp: a control byte, a checked-transfer header, a schema, in the
    format of docs/reliability.md (our extension: the reference has no such messages)."""
    import struct

    def fnv1a(b):
        h = 0xcbf29ce484222325
        for c in b:
            h = ((h ^ c) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
        return h

    def string(s):
        return struct.pack("<I", len(s)) + s

    def leaf(path, dtype, shape, layout=None):
        out = struct.pack("<I", len(path)) + b"".join(string(p) for p in path)
        out += string(dtype) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in shape)
        if layout is not None:
            offset, strides = layout
            out += struct.pack("<Q", offset) + b"".join(struct.pack("<Q", s) for s in strides)
        return out

    def message(mode, payload, leaves, chunk=4 << 20, control=0):
        schema = struct.pack("<Q", len(leaves)) + b"".join(leaves)
        header = b"TDCHECKD" + struct.pack("<IIQQQQQ", 1, mode, payload, len(schema),
                                           fnv1a(schema), chunk, len(leaves))
        header += struct.pack("<Q", fnv1a(header))
        return bytes([control]) + header + schema

    a = leaf([b"a"], b"torch.float32", [2, 3])
    c = leaf([b"b", b"c"], b"torch.int64", [4])
    a_c = leaf([b"a"], b"torch.float32", [2, 3], (0, [3, 1]))
    c_c = leaf([b"b", b"c"], b"torch.int64", [4], (24, [1]))
    yield "per_leaf-same", message(0, 56, [a, c])
    yield "per_leaf-other_shape", message(0, 40, [a, leaf([b"b", b"c"], b"torch.int64", [2])])
    yield "per_leaf-extra_key", message(0, 60, [a, c, leaf([b"z"], b"torch.bool", [4])])
    yield "consolidated-same", message(1, 56, [a_c, c_c], control=1)
    yield "consolidated-moved", message(1, 64, [a_c, leaf([b"b", b"c"], b"torch.int64",
                                                             [4], (32, [1]))], control=1)
    yield "mode-mismatch", message(1, 56, [a_c, c_c])
    yield "chunk_of_one_byte", message(0, 56, [a, c], chunk=1)
    yield "large_payload", message(0, 1 << 40, [leaf([b"a"], b"torch.float32", [1 << 38])],
                                        chunk=1 << 20)
    yield "short_schema", message(0, 56, [a, c])[:-5]
    yield "patched_hashes", bytes([2]) + message(0, 56, [a, c])[1:]


def relay_seeds():
    """Inputs of fuzz/relay.cpp (docs/wire-format.md §9.9): a control byte, then a route (after
    the storage size, 4 bytes), a piece header, or a resume request."""
    import struct

    def place(pid=4242, slots_fd=7, pins_fd=8, token=b"0123456789abcdef", epoch=5):
        return struct.pack("<QQ", pid | pins_fd << 32, slots_fd) + token + struct.pack("<Q", epoch)

    def route(data, piece, first=0, parent=-1, rate=0, siblings=1, children=(), sums=None,
              seq=1, epoch=5, version=3, source=False, slots=None):
        pieces = max(1, -(-data // piece))
        flags = (1 if sums is not None else 0) | (2 if source else 0) | (4 if slots else 0)
        body = b"TDPUBRTE" + struct.pack("<II", 1, flags)
        body += struct.pack("<QQqqqqqqQ", seq, epoch, version, piece, first, parent, rate,
                            siblings, len(children))
        body += slots if slots else bytes(40)
        body += b"".join(struct.pack("<q", c) for c in children)
        if sums is not None:
            body += b"".join(struct.pack("<Q", sums + i) for i in range(pieces))
        return bytes([0]) + struct.pack("<I", data) + body

    def piece(index, nbytes, hold=False, queued=0, epoch=5, version=3):
        return bytes([1]) + b"TDPUBPCE" + struct.pack("<IIQqqqq", 1, 1 if hold else 0, epoch,
                                                     version, index, nbytes, queued)

    def resume(reason=1, piece=7, around=2, seq=9, epoch=5, version=3):
        return bytes([2]) + b"TDPUBREQ" + struct.pack("<IIQQqqQq", 1, 0x800, seq, epoch,
                                                     version, piece, reason, around)

    yield "route-head", route(1 << 20, 256 << 10, children=[2])
    yield "route-relay_checksums", route(3 << 20, 1 << 20, parent=1, rate=50_000_000,
                                         siblings=2, children=[3, 4], sums=11)
    yield "route-resume", route(1 << 20, 64 << 10, first=5, sums=1)
    yield "route-small_piece", route(1 << 20, 4096)
    yield "route-largest_piece", route(40 << 20, 16 << 20, sums=2)
    yield "route-piece_over_the_largest", route(40 << 20, 17 << 20, sums=2)
    yield "route-first_past_end", route(1 << 20, 1 << 20, first=1)
    yield "route-child_is_parent", route(1 << 20, 1 << 20, parent=2, children=[2])
    yield "route-too_many_children", route(1 << 20, 1 << 20, children=range(65))
    yield "route-other_version", route(1 << 20, 1 << 20, version=4)
    yield "route-empty_storage", route(0, 64 << 10, sums=0)
    yield "route-host_source", route(1 << 20, 256 << 10, children=[2], sums=3, source=True)
    yield "route-host_parent", route(1 << 20, 256 << 10, parent=1, sums=3, slots=place())
    yield "route-host_parent_other_epoch", route(1 << 20, 256 << 10, parent=1, sums=3,
                                                 slots=place(epoch=6))
    yield "route-host_parent_publisher", route(1 << 20, 256 << 10, sums=3, slots=place())
    yield "piece-first", piece(0, 1 << 20)
    yield "piece-hold", piece(4, 0, hold=True)
    yield "piece-queued", piece(9, 4096, queued=12)
    yield "piece-bad_word", piece(0, 1)[:13] + b"\x07" + piece(0, 1)[14:]
    yield "resume-stalled", resume()
    yield "resume-forged_from_publisher", resume(reason=4, around=-1)
    yield "resume-bad_reason", resume(reason=9)
    yield "resume-no_epoch", resume(epoch=0)
    yield "hello", bytes([2]) + b"TDPUBREQ" + struct.pack("<IIQ", 1, 0x1000, 0xABCDEF) + bytes(40)
    yield "hello-host_zero", bytes([2]) + b"TDPUBREQ" + struct.pack("<IIQ", 1, 0x1000, 0) + bytes(40)
    yield "hello-slots", bytes([2]) + b"TDPUBREQ" + struct.pack("<IIQ", 1, 0x1000, 0xABCDEF) + place()
    yield "hello-slots_pid_zero", (bytes([2]) + b"TDPUBREQ" + struct.pack("<IIQ", 1, 0x1000, 0xABC)
                                   + place(pid=0))


def publication_seeds():
    """Inputs of fuzz/publication.cpp: a control byte, a 64-byte request or offer
    (docs/wire-format.md §9, our extension), then an offer's schema: the JSON of a reference
    TensorDict's consolidated metadata with the "_total_bytes" a publisher adds."""
    import struct

    def fnv1a(b):
        h = 0xcbf29ce484222325
        for c in b:
            h = ((h ^ c) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
        return h or 1

    def request(seq=1, epoch=0, version=0, min_version=0, wait_ms=-1, schema=0,
                magic=b"TDPUBREQ"):
        return magic + struct.pack("<IIQQqqqQ", 1, 0, seq, epoch, version, min_version, wait_ms,
                                   schema)

    def offer(status, seq=1, epoch=9, version=1, data=0, schema_bytes=0, schema=0):
        return b"TDPUBOFR" + struct.pack("<IIQQqqqQ", 1, status, seq, epoch, version, data,
                                         schema_bytes, schema)

    td = TensorDict(a=torch.ones(2, 3), b=TensorDict(c=torch.arange(4), batch_size=[]),
                    batch_size=[])
    _, meta, storage = consolidated(td)
    n = storage.numel()
    text = json.dumps(dict(meta, _total_bytes=n)).encode()
    yield "request-first", bytes([0]) + request()
    yield "request-held", bytes([0]) + request(seq=7, epoch=9, version=3, min_version=5,
                                               wait_ms=2000, schema=fnv1a(text))
    yield "request-bad_magic", bytes([0]) + request(magic=b"TDPUBXXX")
    yield "request-version_without_epoch", bytes([0]) + request(version=4)
    yield "offer-none", bytes([1]) + offer(2)
    yield "offer-closed", bytes([1]) + offer(3)
    yield "offer-new", bytes([1]) + offer(1, data=n, schema_bytes=len(text),
                                          schema=fnv1a(text)) + text
    yield "offer-new_patched", bytes([5]) + offer(1, data=n, schema_bytes=len(text)) + text
    yield "offer-reused_schema", bytes([3]) + offer(1, epoch=5, version=4, data=64, schema=77)
    yield "offer-goes_back", bytes([3]) + offer(1, epoch=5, version=2, data=64, schema=77)
    yield "offer-short_storage", bytes([1]) + offer(1, data=n - 8, schema_bytes=len(text),
                                                    schema=fnv1a(text)) + text
    yield "offer-huge", bytes([1]) + offer(1, data=1 << 62, schema_bytes=1 << 40)


def roundtrip_seeds():
    """Inputs of fuzz/pipe_frames_roundtrip.cpp: a control byte (bit 0 uncollated, bit 1
    joined frames), then per TensorDict a step byte (bit 0 a new structure, bit 1 into the
    previous result); for a new structure a batch size byte, an entry count byte, a kind byte
    per entry (low nibble the dtype, 11 and up a str; 0x10 nested; 0x20 a trailing dim, whose
    size byte follows); then a seed byte for the values and a length byte per str. The
    entry count byte is the count less one."""
    # float32 [3, 2], a nested int64 [3] and a str; the same structure again, then received
    # into the previous result; then a new structure (bool, nested int16 [4]).
    first = bytes([1, 3, 2, 0x20, 2, 0x12, 0x0b, 7, 4])
    again = bytes([0, 8, 2])
    into = bytes([2, 9, 3])
    new = bytes([1, 0, 1, 0x05, 0x38, 4, 10])
    for name, control in (("consolidated", 0), ("consolidated-joined", 2), ("uncollated", 1)):
        yield name, bytes([control]) + first + again + into + new + again
    # every dtype, batch size 2, each with a trailing dim of 3
    every = bytes([1, 2, 4]) + b"".join(bytes([0x20 | d, 3]) for d in range(5))
    more = bytes([1, 2, 4]) + b"".join(bytes([0x20 | d, 3]) for d in range(5, 10))
    yield "every_dtype", bytes([0]) + every + bytes([11]) + more + bytes([12])
    yield "every_dtype-uncollated", bytes([1]) + every + bytes([11]) + more + bytes([12])
    yield "complex_and_joined", bytes([2, 1, 1, 0, 0x2a, 2, 13, 0, 14, 2, 15])


def loader_seeds():
    """The seeds of lazy_stack and memmap_meta."""
    # lazy_stack: (members per stack, nesting | leaves << 2 | x64 << 7, stack dim[, patches])
    for name, data in {"3-flat": b"\x02\x00\x00", "16-nested": b"\x0f\x05\x01",
                       "256-deep": b"\xff\x0a\x00", "1024": b"\x0f\x80\x00",
                       "16384": b"\xff\x80\x01", "patched": b"\x07\x01\x00\x10\xff\x20\x00"
                       }.items():
        write("lazy_stack", name, data)

    # memmap_meta: the reference's meta.json files of a folder holding a.memmap (float32 [16]),
    # the level n (n/b.memmap, int64 [8]) and the non-tensor entry v, joined by 0 bytes.
    with tempfile.TemporaryDirectory() as d:
        for name, v in {"string": "hello", "list": [1, [2.5, None], {"k": True}],
                        "stack": None}.items():
            value = (NonTensorStack(*[NonTensorData(i) for i in "ab"]) if v is None
                     else NonTensorData(v))
            td = TensorDict(a=torch.zeros(16), n=TensorDict(b=torch.zeros(8, dtype=torch.int64)),
                            v=value)
            path = os.path.join(d, name)
            td.memmap(path)
            texts = [open(os.path.join(path, *p, "meta.json"), "rb").read()
                     for p in ((), ("n",), ("v",))]
            write("memmap_meta", name, b"\0".join(texts))


def main():
    for target in ("metadata_json", "pickle", "pipe_frames"):
        d = os.path.join(CORPUS, target)
        if os.path.isdir(d):
            for f in os.listdir(d):
                if f.startswith("seed-"):
                    os.remove(os.path.join(d, f))

    for name, td in tds():
        try:
            tdc, meta, storage = consolidated(td)
        except Exception as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        raw = storage.numpy().tobytes()
        # metadata_json: the JSON text, a 0 byte, the storage. The file variant's text
        # (unsorted) and the pipe's (sorted, with the transport keys).
        try:
            text = json.dumps(meta)
        except TypeError as e:
            print(f"{name}: no JSON form ({e})", file=sys.stderr)
            text = None
        if text is not None:
            write("metadata_json", f"{name}", text.encode() + b"\0" + raw)
            piped = dict(meta, _total_bytes=storage.numel(), _device=str(storage.device))
            write("metadata_json", f"{name}-pipe",
                  json.dumps(piped, sort_keys=True).encode() + b"\0" + raw)
        # pickle: what init_remote (send_object_list), broadcast and scatter pickle.
        m = dict(meta)
        m["_total_bytes"] = storage.numel()
        write("pickle", f"{name}-init_remote", pickle.dumps(m))
        write("pickle", f"{name}-broadcast", pickle.dumps(dict(m, _storage_device="cpu")))
        if name in ("worked_example", "padding"):
            write("pickle", f"{name}-scatter",
                  pickle.dumps(dict(m, _max_bytes=storage.numel() + 16, _storage_device="cpu")))
            for proto in (2, 3, 5):
                write("pickle", f"{name}-proto{proto}", pickle.dumps(m, protocol=proto))
        # pipe_frames: control byte, then what the reference's TensorDictPipe sends for two
        # send() calls (a new schema, then the same schema) and, uncollated, for two sends.
        try:
            stream = pipe_bytes(td, True)
            write("pipe_frames", f"{name}-consolidated", b"\x00" + stream)
            if name in ("worked_example", "deep"):
                write("pipe_frames", f"{name}-consolidated-td", b"\x02" + stream)
                write("pipe_frames", f"{name}-consolidated-copy", b"\x04" + stream)
        except Exception as e:
            print(f"{name}: no consolidated pipe form ({e})", file=sys.stderr)
        try:
            write("pipe_frames", f"{name}-uncollated", b"\x01" + pipe_bytes(td, False))
        except Exception as e:
            print(f"{name}: no uncollated pipe form ({e})", file=sys.stderr)

    # docs/wire-format.md §3.4 / §6.1: the 449-byte line, then a same-schema message and our close
    # marker.
    td = tds()[0][1]
    _, meta, storage = consolidated(td)
    line = json.dumps(dict(meta, _total_bytes=96, _device="cpu"), sort_keys=True).encode()
    assert len(line) == 449, len(line)
    raw = storage.numpy().tobytes()
    write("pipe_frames", "wire_format_449",
          b"\x00" + b"\x00" + struct.pack("<Q", 449) + line + raw + b"\x01" + raw + b"\xff")
    # The same after ucxx's peer-info exchange (control bit 3): a tag of ours and its checksum,
    # hash64bits of ucxx (docs/wire-format.md §6.6).
    tag = (0x7464637070 << 24) | 1
    checksum = int(hashlib.sha1(repr((tag,)).encode()).hexdigest()[:16], 16)
    write("pipe_frames", "wire_format_449-peer_info",
          b"\x08" + struct.pack("<QQ", tag, checksum) + b"\x00" + struct.pack("<Q", 449) + line +
          raw + b"\x01" + raw + b"\xff")
    # Joined frames between peers of ours (control bit 4, §6.8): a length byte before each
    # first message that may be joined, odd for the flag byte with the storage, even for the
    # flag byte alone. Here: the new schema (never joined), a joined same-schema message, the
    # two-message form, and the close marker.
    write("pipe_frames", "wire_format_449-joined",
          b"\x10" + b"\x00" + struct.pack("<Q", 449) + line + raw + b"\x01\x01" + raw +
          b"\x00\x01" + raw + b"\x00\xff")
    write("metadata_json", "wire_format_449", line + b"\0" + raw)

    # Plain pickles of the subset (and a few outside it, which must be refused).
    shared = [1, 2]
    values = {
        "scalars": [None, True, False, 0, 1, -1, 255, 65535, 2**31 - 1, -2**31, 2**63 - 1,
                    -2**63, 1.5, float("inf"), float("nan"), "", "x", "é日\U0001f600"],
        "nested": {"a": [1, (2, 3), {"b": None}], "c": (), "d": [], "e": {}},
        "memo": {"x": shared, "y": shared, "z": ("t", "t")},
        "tuples": [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
        "bigint": 2**64,
        "bytes": b"\x00\x01",
        "set": {1, 2},
        "class": torch.Size,
    }
    for name, v in values.items():
        write("pickle", f"value-{name}", pickle.dumps(v))
    write("pickle", "value-long-list", pickle.dumps(list(range(3000))))
    write("pickle", "value-proto0", pickle.dumps({"a": [1, "b"]}, protocol=0))

    for name, data in checked_seeds():
        write("checked", name, data)
    write_dict("checked", [b"TDCHECKD", b"\x01\x00\x00\x00", (1 << 20).to_bytes(8, "little"),
                           (4 << 20).to_bytes(8, "little"), b"\xff" * 8, b"\x0dtorch.float32",
                           b"\x0btorch.int64", b"\x0atorch.bool", b"\x0ftorch.complex64"])

    for name, data in publication_seeds():
        write("publication", name, data)
    write_dict("publication", [b"TDPUBREQ", b"TDPUBOFR", b"\x01\x00\x00\x00", b"\xff" * 8,
                               b'"_total_bytes": '])

    for name, data in roundtrip_seeds():
        write("pipe_frames_roundtrip", name, data)

    for name, data in relay_seeds():
        write("relay", name, data)
    write_dict("relay", [b"TDPUBRTE", b"TDPUBPCE", b"TDPUBREQ", b"\x00\x08\x00\x00",
                         b"\x00\x00\x04\x00\x00\x00\x00\x00", b"\xff" * 8])

    loader_seeds()

    json_tokens = ['"cls"', '"TensorDict"', '"LazyStackedTensorDict"', '"NonTensorStack"',
                   '"stack_dim"', '"stack_dim_name"', '"non_tensors"',
                   '"leaves"', '"cls_metadata"', '"batch_size"', '"names"', '"device"',
                   '"is_locked"', '"_total_bytes"', '"_device"', '"_storage_device"', '"size"',
                   '"cpu"', '"cuda:0"', "null", "true", "false", "[]", "{}", ", ", ": ",
                   "9223372036854775807", "-1", "18446744073709551615", "1e308", '"\\ud800"',
                   "NaN", "Infinity", "-Infinity", "1e-07", "-0.0"]
    json_tokens += [f'"{d}"' for d in (
        "torch.float16", "torch.float32", "torch.float64", "torch.bfloat16", "torch.int8",
        "torch.int16", "torch.int32", "torch.int64", "torch.uint8", "torch.uint16",
        "torch.uint32", "torch.uint64", "torch.bool", "torch.complex32", "torch.complex64",
        "torch.complex128", "torch.qint8", "torch.quint8", "torch.qint32", "torch.quint4x2",
        "torch.float8_e4m3fn")]
    write_dict("metadata_json", json_tokens)
    write_dict("memmap_meta", json_tokens + [
        '"dtype"', '"shape"', '"is_nested"', '"type"', '"NonTensorData"', '"MetaData"',
        '"_type"', '"_class"', '"_format_version"', '"data"', '"tensordict:TensorDict"',
        '"<class \'tensordict._td.TensorDict\'>"',
        '"<class \'tensordict.tensorclass.NonTensorData\'>"',
        '"<class \'tensordict.tensorclass.NonTensorStack\'>"', '"../a"', "\x00"])
    write_dict("lazy_stack", ["\x00", "\x01", "\x80", "\xff", "\x8c", "\x94"])
    write_dict("pipe_frames", json_tokens + ['"keys"', '"dtypes"', '"shapes"', '"unbatched"',
                                             "\x00", "\x01", "\xff", "\xff" * 8])
    write_dict("pickle", [b"\x80\x04\x95", b"\x80\x02", b"\x80\x05", b"}\x94", b"]\x94",
                          b")\x94", b"(", b"t", b"\x85", b"\x86", b"\x87", b"s", b"u", b"a",
                          b"e", b".", b"N", b"\x88", b"\x89", b"K", b"M", b"J", b"\x8a\x08",
                          b"\x8a\x09", b"G", b"\x8c", b"X", b"\x8d", b"h", b"j", b"q", b"r",
                          b"\x94", b"c", b"\x93", b"R", b"b", b"\x8c\x03cls", b"\x8c\x06leaves",
                          b"\x8c\x0bnon_tensors", b"\x8c\x0ccls_metadata",
                          b"\x8c\x0abatch_size", b"\x8c\x0aTensorDict",
                          b"\x8c\x0dtorch.float32", b"\x8c\x0c_total_bytes"])


if __name__ == "__main__":
    main()
