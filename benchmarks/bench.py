"""benchmarks/run: every transfer arm side by side in one run, with floors and the reference.

For each case (1 x 1 KB, 100 x 1 KB, 1000 x 64 B nested 3 deep, 16 x 8 MB, 1 x 100 MB):

* build/transfer_bench: ours called from C++ (per leaf, consolidated, the UCX pipe when built)
  and the floors (one raw c10d send of the same bytes, the same number of raw messages,
  memcpy of the same bytes), two C++ ranks;
* two Python ranks (torch.distributed Gloo over a FileStore): the reference tensordict (per
  leaf, consolidated, init_remote) and ours called from Python;
* ucx_perftest (server and client on 127.0.0.1), the floor of the pipe, when the pipe is built.

Then build/micro_bench (Google Benchmark) and the same work done by the reference / Python,
and a NonTensorStack of 1,000,000 strings received from the reference's init_remote messages
beside the same stack's file read by from_consolidated (two Python ranks). Then publication
(benchmarks/publication_bench.py) and torchrl 0.14.1's collectors under each weight-sync scheme,
ours among them (benchmarks/torchrl_collector_bench.py, on the peer stack in .peers/td014).
Prints markdown tables and, unless --no-write, rewrites docs/benchmarks.md and
docs/benchmarks.png. Exits 1 if any received data failed verification.

Method (both rank programs): a timed transfer is sender start -> data received -> a small ack
back; warm-up rounds first; each round runs every arm once, in a new random order; a case
stops when every arm's median is known to within 3% (95% interval) or at a time cap; the
receiver checks every value after timing. Ranks run with one intra-op thread.

    benchmarks/run [--quick] [--no-write] [--json PATH] [--case NAME ...]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import pathlib
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ACK_TAG = 1 << 30  # the C++ program's tags, far above the transfers'
CTRL_TAG = ACK_TAG + 1
TIGHT_CI = 0.03
CI_MIN_REPS = 30

# name, leaves, bytes per leaf, nested 3 deep, lazy-stack members (0: a plain TensorDict).
# A lazy stack's case runs in the Python program only, ours beside the reference's.
CASES = [
    ("1x1KB", 1, 1024, False, 0),
    ("100x1KB", 100, 1024, False, 0),
    ("1000x64B", 1000, 64, True, 0),
    ("16x8MB", 16, 8 << 20, False, 0),
    ("1x100MB", 1, 100 << 20, False, 0),
    ("lazy4x16x1KB", 64, 1024, False, 4),
]
QUICK_CASE = "1x1KB"

# id -> (label, floor id, reference id); the table and the plot follow this order.
ARMS = {
    "floor.raw_one": ("floor: one raw c10d send of the bytes (C++)", None, None),
    "floor.raw_n": ("floor: one raw c10d message per leaf (C++)", None, None),
    "floor.memcpy": ("floor: memcpy of the bytes", None, None),
    "floor.py_raw_one": ("floor: one raw torch.distributed send of the bytes (Python)", None,
                         None),
    "floor.py_raw_n": ("floor: one raw torch.distributed isend per leaf (Python)", None, None),
    "floor.py_init_remote": ("floor of init_remote (Python): consolidate into fresh memory, a "
                             "small message, the storage into a fresh buffer", None, None),
    "ref.per_leaf": ("reference: td.send (per leaf)", "floor.py_raw_n", None),
    "ref.consolidated": ("reference: send(consolidated=True)", "floor.py_raw_one", None),
    "ref.init_remote": ("reference: init_remote / from_remote_init", "floor.py_raw_one", None),
    "cpp.per_leaf": ("ours, C++: dist::send (per leaf)", "floor.raw_n", "ref.per_leaf"),
    "cpp.consolidated": ("ours, C++: dist::send consolidated", "floor.raw_one",
                         "ref.consolidated"),
    "cpp.per_leaf_checked": ("ours, C++: dist::send (per leaf), checked", "floor.raw_n", None),
    "cpp.consolidated_checked": ("ours, C++: dist::send consolidated, checked", "floor.raw_one",
                                 None),
    "cpp.per_leaf_timeout": ("ours, C++: dist::recv (per leaf) with a timeout", "floor.raw_n",
                             None),
    "cpp.consolidated_timeout": ("ours, C++: dist::recv consolidated with a timeout",
                                 "floor.raw_one", None),
    "cpp.init_remote": ("ours, C++: dist::init_remote / from_remote_init", "floor.raw_one",
                        "ref.init_remote"),
    "py.per_leaf": ("ours, Python: td.send (per leaf)", "floor.py_raw_n", "ref.per_leaf"),
    "py.consolidated": ("ours, Python: send(consolidated=True)", "floor.py_raw_one",
                        "ref.consolidated"),
    "py.init_remote": ("ours, Python: init_remote / from_remote_init", "floor.py_init_remote",
                       "ref.init_remote"),
    "floor.allreduce_one": ("floor: one raw c10d all_reduce of the bytes (C++)", None, None),
    "floor.allreduce_n": ("floor: one raw c10d all_reduce per leaf (C++)", None, None),
    "floor.py_allreduce_one": ("floor: one raw torch.distributed all_reduce of the bytes "
                               "(Python)", None, None),
    "floor.py_allreduce_n": ("floor: one raw torch.distributed all_reduce per leaf (Python)",
                             None, None),
    "ref.all_reduce": ("reference: all_reduce (per leaf)", "floor.py_allreduce_n", None),
    "ref.all_reduce_buckets": ("reference: all_reduce(bucket_bytes=1 MiB)",
                               "floor.py_allreduce_one", None),
    "cpp.all_reduce": ("ours, C++: dist::all_reduce (per leaf)", "floor.allreduce_n",
                       "ref.all_reduce"),
    "cpp.all_reduce_buckets": ("ours, C++: dist::all_reduce, bucket_bytes 1 MiB",
                               "floor.allreduce_one", "ref.all_reduce_buckets"),
    "py.all_reduce": ("ours, Python: all_reduce (per leaf)", "floor.py_allreduce_n",
                      "ref.all_reduce"),
    "py.all_reduce_buckets": ("ours, Python: all_reduce(bucket_bytes=1 MiB)",
                              "floor.py_allreduce_one", "ref.all_reduce_buckets"),
    "floor.ucx": ("floor: ucx_perftest tag_lat(bytes) + tag_lat(8 B)", None, None),
    "cpp.pipe": ("ours, C++: TensorDictPipe (UCX, consolidated)", "floor.ucx", None),
}


# ---- statistics, shared by the Python ranks and the report --------------------------------
def summarize(samples: list[float]) -> dict:
    """Median, nearest-rank p25/p75 and the median's distribution-free 95% interval."""
    v = sorted(samples)
    n = len(v)
    if not n:
        return {"n": 0}
    rank = lambda q: v[min(n - 1, max(0, math.ceil(q * n) - 1))]  # noqa: E731
    half = 0.98 * math.sqrt(n)
    return {"median_us": statistics.median(v), "p25_us": rank(0.25), "p75_us": rank(0.75),
            "ci_lo_us": v[max(0, math.floor(n / 2 - half))],
            "ci_hi_us": v[min(n - 1, math.ceil(n / 2 + half))], "n": n}


def tight(times: dict[str, list[float]], rounds: int) -> bool:
    if rounds < CI_MIN_REPS:
        return False
    for t in times.values():
        s = summarize(t)
        if s["ci_hi_us"] - s["ci_lo_us"] > TIGHT_CI * s["median_us"]:
            return False
    return True


# ---- the Python ranks ------------------------------------------------------------------------
def leaf_paths(leaves: int, nested: bool) -> list:
    """The keys of transfer_bench.cpp's make_td, in insertion order."""
    if not nested:
        return [f"leaf{1000 + i}" for i in range(leaves)]
    per = 1
    while per ** 3 < leaves:
        per += 1
    return [(f"a{i // (per * per)}", f"b{(i // per) % per}", f"c{i % per}", "x")
            for i in range(leaves)]


def pattern(torch, i: int, floats: int):
    """Leaf i's values: the C++ program's pattern(), bit for bit."""
    return torch.arange(floats, dtype=torch.float32).fmod_(1000).add_(i)


def python_rank(cfg: dict, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist
    import tensordict as ref
    import tensordict_cpp as ours

    torch.set_num_threads(1)
    sender = rank == 0
    ack = torch.zeros(1)
    ctrl = torch.zeros(1, dtype=torch.int32)
    results = []
    for name, leaves, nbytes, nested, members in cfg["cases"]:
        paths = leaf_paths(leaves // max(members, 1), nested)
        floats = nbytes // 4

        def make(lib, filled=sender):
            tds = []
            for j in range(max(members, 1)):  # member j holds leaves j * len(paths) + i
                td = lib.TensorDict({}, batch_size=[])
                for i, p in enumerate(paths):
                    k = j * len(paths) + i
                    td[p] = pattern(torch, k, floats) if filled else torch.zeros(floats)
                tds.append(td)
            return lib.lazy_stack(tds) if members else tds[0]

        def check(td):
            tds = td.tensordicts if members else [td]
            return all(torch.equal(m[p], pattern(torch, j * len(paths) + i, floats))
                       for j, m in enumerate(tds) for i, p in enumerate(paths))

        ref_td, our_td = make(ref), make(ours)
        ref_cons = make(ref).consolidate(metadata=True)
        our_cons = make(ours).consolidate()
        got = {}  # init_remote results, kept for the check
        raw = [pattern(torch, i, floats) if sender else torch.zeros(floats)
               for i in range(leaves)]
        raw_one = (torch.cat(raw) if sender else torch.zeros(leaves * floats)).view(torch.uint8)

        def raw_n(sending):
            post = dist.isend if sending else dist.irecv
            for w in [post(t, 1 - rank, tag=i) for i, t in enumerate(raw)]:
                w.wait()

        # The floors of this program: ratios to them compare arms that ran side by side.
        arms = {
            "floor.py_raw_one": (lambda: dist.send(raw_one, dst=1),
                                 lambda: dist.recv(raw_one, src=0),
                                 lambda: torch.equal(raw_one.view(torch.float32).view(
                                     leaves, floats), torch.stack(
                                     [pattern(torch, i, floats) for i in range(leaves)]))),
        }
        if leaves > 1:
            arms["floor.py_raw_n"] = (lambda: raw_n(True), lambda: raw_n(False),
                                      lambda: all(torch.equal(t, pattern(torch, i, floats))
                                                  for i, t in enumerate(raw)))
        arms |= {
            "ref.per_leaf": (lambda: ref_td.send(dst=1), lambda: ref_td.recv(src=0),
                             lambda: check(ref_td)),
            "ref.consolidated": (lambda: ref_cons.send(dst=1, consolidated=True),
                                 lambda: ref_cons.recv(src=0, consolidated=True),
                                 lambda: check(ref_cons)),
            # A cold start: consolidate, pickle the metadata, send it and the storage.
            "ref.init_remote": (lambda: ref_td.init_remote(dst=1),
                                lambda: got.__setitem__("ref", ref.TensorDict.from_remote_init(
                                    src=0)),
                                lambda: check(got["ref"])),
            "py.per_leaf": (lambda: our_td.send(dst=1), lambda: our_td.recv(src=0),
                            lambda: check(our_td)),
            "py.consolidated": (lambda: our_cons.send(dst=1, consolidated=True),
                                lambda: our_cons.recv(src=0, consolidated=True),
                                lambda: check(our_cons)),
        }
        small = torch.zeros(64, dtype=torch.uint8)
        storage_bytes = our_cons._cpp.consolidated_storage().numel()

        def floor_init_send():  # what init_remote cannot avoid: a fresh copy, two messages
            dist.send(small, dst=1)
            dist.send(our_td.consolidate()._cpp.consolidated_storage(), dst=1)

        def floor_init_recv():
            dist.recv(small, src=0)
            got["floor"] = torch.empty(storage_bytes, dtype=torch.uint8)
            dist.recv(got["floor"], src=0)

        if hasattr(ours._C, "from_remote_init"):  # a build with the collectives
            arms["floor.py_init_remote"] = (floor_init_send, floor_init_recv, lambda: True)
            arms["py.init_remote"] = (
                lambda: our_td.init_remote(dst=1),
                lambda: got.__setitem__("ours", ours.TensorDict.from_remote_init(src=0)),
                lambda: check(got["ours"]))
        if leaves >= 100 and leaves * nbytes <= 1 << 20:
            arms |= all_reduce_arms(torch, dist, ref, ours, make, check, raw, sender)
        ids = list(arms)
        times = {a: [] for a in ids}
        start = time.monotonic()
        rnd = -cfg["warmup"]
        while True:
            if sender:
                go = rnd < cfg["min_reps"] or (
                    rnd < cfg["max_reps"] and time.monotonic() - start < cfg["py_cap"]
                    and not tight(times, rnd))
                ctrl.fill_(int(go))
                dist.send(ctrl, dst=1, tag=CTRL_TAG)
            else:
                dist.recv(ctrl, src=0, tag=CTRL_TAG)
                go = bool(ctrl.item())
            if not go:
                break
            order = list(ids)  # shuffled alike on both ranks, as in transfer_bench.cpp
            random.Random(rnd).shuffle(order)
            for a in order:
                send, recv, _ = arms[a]
                if sender:
                    t0 = time.perf_counter_ns()
                    send()
                    dist.recv(ack, src=1, tag=ACK_TAG)
                    if rnd >= 0:
                        times[a].append((time.perf_counter_ns() - t0) / 1e3)
                else:
                    recv()
                    dist.send(ack, dst=0, tag=ACK_TAG)
            rnd += 1
        # Verification after timing, on the receiver, reported to the sender.
        ok = torch.tensor([int(arms[a][2]()) if not sender else 1 for a in ids],
                          dtype=torch.int32)
        if sender:
            dist.recv(ok, src=1, tag=CTRL_TAG)
            results.append({"name": name, "seconds": time.monotonic() - start,
                            "arms": {a: dict(summarize(times[a]), verified=bool(ok[i]))
                                     for i, a in enumerate(ids)}})
        else:
            dist.send(ok, dst=0, tag=CTRL_TAG)
    if sender:
        pathlib.Path(cfg["json"]).write_text(json.dumps({"cases": results}))


def all_reduce_arms(torch, dist, ref, ours, make, check, raw, sender) -> dict:
    """all_reduce with MAX (the values stay the sender's pattern, the receiver's zeros rise to
    it), per leaf and with bucket_bytes, ours beside the reference's and raw torch.distributed
    all_reduces of the same bytes (one of all of them, one per leaf). Both ranks run each arm:
    its send and recv are the same call."""
    max_op = dist.ReduceOp.MAX
    flat = torch.cat(raw) if sender else torch.zeros(sum(t.numel() for t in raw))
    each = [t.clone() for t in raw]

    def reduce_each():
        for w in [dist.all_reduce(t, op=max_op, async_op=True) for t in each]:
            w.wait()

    def both(fn):
        return fn, fn

    arms = {
        "floor.py_allreduce_one": (*both(lambda: dist.all_reduce(flat, op=max_op)),
                                   lambda: torch.equal(flat, torch.cat(
                                       [pattern(torch, i, raw[0].numel()) for i in range(len(raw))]))),
        "floor.py_allreduce_n": (*both(reduce_each), lambda: all(
            torch.equal(t, pattern(torch, i, t.numel())) for i, t in enumerate(each))),
    }
    for lib, prefix in ((ref, "ref"), (ours, "py")):
        for suffix, kwargs in (("", {}), ("_buckets", {"bucket_bytes": 1 << 20})):
            td = make(lib)
            arms[f"{prefix}.all_reduce{suffix}"] = (
                *both(lambda td=td, kwargs=kwargs: td.all_reduce(op=max_op, **kwargs)),
                lambda td=td: check(td))
    return arms


def run_python(cases, settings, tmp) -> dict:
    from tensordict_cpp.distributed import run

    out = pathlib.Path(tmp) / "python.json"
    cfg = dict(settings, cases=cases, json=str(out))
    run(functools.partial(python_rank, cfg), 2, timeout=1200, group_timeout=300)
    return json.loads(out.read_text())


# ---- the C++ ranks ---------------------------------------------------------------------------
def run_cpp(build: pathlib.Path, cases, settings, tmp) -> dict:
    out = pathlib.Path(tmp) / "cpp.json"
    cmd = [str(build / "transfer_bench"), "--json", str(out), "--cap", str(settings["cpp_cap"]),
           "--min-reps", str(settings["min_reps"]), "--max-reps", str(settings["max_reps"]),
           "--warmup", str(settings["warmup"])]
    for name, leaves, nbytes, nested, _ in cases:
        cmd += ["--case", f"{name}:{leaves}:{nbytes}:{int(nested)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks/run: {cmd[0]} failed ({proc.returncode}):\n"
                         f"{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


# ---- ucx_perftest ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ucx_lat(nbytes: int, quick: bool) -> float | None:
    """Median one-way latency (us) of ucx_perftest tag_lat (the libucx-cu12 wheel's, the UCX the
    pipe links): ping-pong of nbytes as UCP tag messages, as the pipe sends its frames, with peer
    error handling as the pipe's endpoints have it, over TCP on loopback (as transfer_bench runs
    the pipe). None if it cannot run."""
    try:
        import libucx
    except ImportError:
        return None
    home = pathlib.Path(libucx.__path__[0])
    exe = str(home / "bin" / "ucx_perftest")
    iters = max(8 if quick else 10, min(200 if quick else 2000, int(4e8 // nbytes)))
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n",
               LD_LIBRARY_PATH=str(home / "lib"))
    for _ in range(3):  # the free port may be taken between the check and the bind
        port = str(free_port())
        server = subprocess.Popen([exe, "-p", port, "-e"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            client = subprocess.run(
                [exe, "127.0.0.1", "-p", port, "-e", "-t", "tag_lat", "-s", str(nbytes),
                 "-n", str(iters), "-w", str(max(2, iters // 10)), "-f", "-v"],
                env=env, capture_output=True, text=True, timeout=120)
        finally:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        rows = [l.strip() for l in client.stdout.splitlines() if l.strip()[:1].isdigit()]
        if client.returncode == 0 and rows:
            return float(rows[-1].split(",")[1])  # the 50th-percentile column
    return None


# ---- micro-benchmarks ------------------------------------------------------------------------
def run_micro(build: pathlib.Path, quick: bool) -> dict[str, float]:
    """Median real time per iteration, in ns, by benchmark name."""
    cmd = [str(build / "micro_bench"), "--benchmark_format=json",
           f"--benchmark_repetitions={1 if quick else 5}", "--benchmark_report_aggregates_only=true",
           f"--benchmark_min_time={0.01 if quick else 0.2}"]
    if quick:  # the large consolidate cases take seconds to build
        cmd.append("--benchmark_filter="
                   "BM_IntGenerator|BM_SortedKeys|BM_Metadata|BM_Pickle|BM_Rebuild|case:2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks/run: micro_bench failed:\n{proc.stderr}")
    scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}
    out = {}
    for b in json.loads(proc.stdout)["benchmarks"]:
        if b.get("aggregate_name", "median") == "median":
            out[b["run_name"]] = b["real_time"] * scale[b["time_unit"]]
    return out


def time_python(fn, quick: bool) -> float:
    """Median over repetitions of the mean time of one call, in ns."""
    fn()
    per, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < (0.01 if quick else 0.05):  # calls per sample
        fn()
        per += 1
    samples = []
    for _ in range(3 if quick else 7):
        t0 = time.perf_counter_ns()
        for _ in range(per):
            fn()
        samples.append((time.perf_counter_ns() - t0) / per)
    return statistics.median(samples)


def reference_micro(quick: bool) -> dict[str, float]:
    """The same work done by the reference (or by Python itself where the reference uses it),
    keyed like micro_bench's names; ns per call."""
    import json as js
    import pickle

    import torch
    from tensordict import TensorDict
    from tensordict.utils import _int_generator

    torch.set_num_threads(1)
    out = {}
    tag = [0]

    def tags():
        tag[0] = _int_generator(tag[0] + 1)
    out["BM_IntGenerator"] = time_python(tags, quick)
    keyed = TensorDict({f"key{(i * 7919) % 1000}": torch.zeros(1) for i in range(1000)}, [])
    out["BM_SortedKeys"] = time_python(lambda: keyed.sorted_keys, quick)
    cases = [("1x100MB", 1, 100 << 20), ("16x8MB", 16, 8 << 20), ("1000x64B", 1000, 64)]
    for i, (_, count, nbytes) in enumerate(cases):
        if quick and i < 2:
            continue  # as micro_bench --quick: only the small case
        td = TensorDict({}, [])
        for p in leaf_paths(count, True):
            td[p] = torch.rand(nbytes // 4)
        out[f"BM_Consolidate/case:{i}/threads:1/real_time"] = time_python(
            lambda: td.consolidate(metadata=True), quick)
    metadata = td.consolidate(metadata=True)._consolidated["metadata"]  # the 1000 x 64 B case
    text = js.dumps(metadata, sort_keys=True)
    data = pickle.dumps(metadata)
    out["BM_MetadataToJson"] = time_python(lambda: js.dumps(metadata, sort_keys=True), quick)
    out["BM_MetadataFromJson"] = time_python(lambda: js.loads(text), quick)
    out["BM_PickleLoads"] = time_python(lambda: pickle.loads(data), quick)
    out["BM_MetadataFromPickleBytes"] = out["BM_PickleLoads"]  # Python's read, unvalidated
    out["BM_MetadataToPickleBytes"] = time_python(lambda: pickle.dumps(metadata), quick)
    return out


MICRO_ROWS = [  # micro_bench name, label, what the comparison column ran
    ("BM_IntGenerator", "pseudo_rand tag (int_generator)", "tensordict.utils._int_generator"),
    ("BM_SortedKeys", "sort 1000 keys", "td.sorted_keys"),
    ("BM_Consolidate/case:0/threads:1/real_time", "consolidate 1 x 100 MB", "td.consolidate"),
    ("BM_Consolidate/case:0/threads:4/real_time", "consolidate 1 x 100 MB, 4 threads", ""),
    ("BM_MemcpyWarm/case:0/threads:1/real_time", "memcpy 100 MB, warm destination", ""),
    ("BM_MemcpyFresh/case:0/threads:1/real_time", "memcpy 100 MB, fresh destination", ""),
    ("BM_Consolidate/case:1/threads:1/real_time", "consolidate 16 x 8 MB", "td.consolidate"),
    ("BM_Consolidate/case:1/threads:4/real_time", "consolidate 16 x 8 MB, 4 threads", ""),
    ("BM_MemcpyWarm/case:1/threads:1/real_time", "memcpy 16 x 8 MB, warm destination", ""),
    ("BM_Consolidate/case:2/threads:1/real_time", "consolidate 1000 x 64 B (nested)",
     "td.consolidate"),
    ("BM_MemcpyWarm/case:2/threads:1/real_time", "memcpy 1000 x 64 B, warm destination", ""),
    ("BM_MetadataToJson", "metadata -> JSON, 1000 leaves", "json.dumps (C)"),
    ("BM_MetadataFromJson", "JSON -> metadata, validated", "json.loads (C, no validation)"),
    ("BM_PickleLoads", "restricted pickle read, 1000-leaf metadata", "pickle.loads (C)"),
    ("BM_MetadataFromPickleBytes", "pickle -> metadata, validated", "pickle.loads (C)"),
    ("BM_MetadataToPickleBytes", "metadata -> pickle, 1000 leaves", "pickle.dumps (C)"),
    ("BM_Rebuild", "rebuild 1000 views from metadata + storage", ""),
]

# The ratios set as goals for the wire layer, each computed from arms or micro-benchmarks of this run:
# (label, what it divides, the goal as text, whether it is met).
def target_rows(rows: list[dict], ours: dict[str, float], theirs: dict[str, float]) -> list:
    med = {(r["case"], r["arm"]): r["median"] for r in rows}

    def over(case, arm, floor):
        a, b = med.get((case, arm)), med.get((case, floor))
        return a / b if a and b else None

    def faster(name):
        return theirs[name] / ours[name] if name in ours and name in theirs else None

    # The same ratio at 1 x 1 KB, where there is next to no work: what the message sequence
    # the wire prescribes costs by itself (init_remote: a length, the pickle, the storage, each
    # taken before the next is posted; checked: a header before the rest).
    init_floor = over("1x1KB", "cpp.init_remote", "floor.raw_one")
    checked_floor = over("1x1KB", "cpp.consolidated_checked", "cpp.consolidated")

    def fresh(name):  # consolidate against a memcpy into a fresh buffer, 1 x 100 MB
        base = ours.get("BM_MemcpyFresh/case:0/threads:1/real_time")
        return base / ours[name] if base and name in ours else None

    return [
        ("init_remote / from_remote_init of 1 x 100 MB, Python × C++",
         over("1x100MB", "py.init_remote", "cpp.init_remote"), None, "≤ 1.2",
         lambda x: x <= 1.2),
        ("init_remote / from_remote_init of 1 x 100 MB, Python × its floor",
         over("1x100MB", "py.init_remote", "floor.py_init_remote"), None, "≤ 2",
         lambda x: x <= 2),
        ("consolidate 1 x 100 MB, × faster than a memcpy into a fresh buffer",
         fresh("BM_Consolidate/case:0/threads:1/real_time"), None, "≥ 0.8",
         lambda x: x >= 0.8),
        ("init_remote / from_remote_init, 1000 x 64 B, × one raw send (C++)",
         over("1000x64B", "cpp.init_remote", "floor.raw_one"), init_floor, "≤ 5",
         lambda x: x <= 5),
        ("init_remote / from_remote_init, 100 x 1 KB, × one raw send (C++)",
         over("100x1KB", "cpp.init_remote", "floor.raw_one"), init_floor, "≤ 3",
         lambda x: x <= 3),
        ("checked consolidated send, 1000 leaves, × the unchecked one (C++)",
         over("1000x64B", "cpp.consolidated_checked", "cpp.consolidated"), checked_floor,
         "≤ 1.5", lambda x: x <= 1.5),
        ("validated metadata read (JSON, 1000 leaves), × faster than json.loads",
         faster("BM_MetadataFromJson"), None, "≥ 20", lambda x: x >= 20),
        ("restricted pickle read (1000-leaf metadata), × faster than pickle.loads",
         faster("BM_PickleLoads"), None, "≥ 10", lambda x: x >= 10),
        ("pickle -> validated metadata (1000 leaves), × faster than pickle.loads",
         faster("BM_MetadataFromPickleBytes"), None, "≥ 10", lambda x: x >= 10),
    ]


def target_table(rows: list[dict], ours: dict[str, float], theirs: dict[str, float]) -> str:
    out = ["| ratio | this run | at 1 x 1 KB (the messages alone) | goal | met |",
           "|---|--:|--:|--:|---|"]
    for label, value, floor, goal, met in target_rows(rows, ours, theirs):
        shown = f"{value:.2f}" if value is not None else "–"
        shown_floor = f"{floor:.2f}" if floor is not None else ""
        ok = "" if value is None else ("yes" if met(value) else "**no**")
        out.append(f"| {label} | {shown} | {shown_floor} | {goal} | {ok} |")
    return "\n".join(out)


# ---- report ----------------------------------------------------------------------------------
def fmt_us(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def fmt_ns(v: float) -> str:
    return f"{v / 1e3:,.1f} µs" if v >= 1e4 else f"{v:,.0f} ns"


def merge(case_results: list[dict]) -> list[dict]:
    """One row per (case, arm) that ran, in ARMS order, with its floor and reference ratios."""
    rows = []
    for case in case_results:
        arms = case["arms"]
        for arm_id, (label, floor_id, ref_id) in ARMS.items():
            if arm_id not in arms:
                continue
            a = arms[arm_id]
            if floor_id and floor_id.endswith("raw_n") and floor_id not in arms:
                floor_id = floor_id.replace("raw_n", "raw_one")  # one leaf: the same message
            floor = arms.get(floor_id, {}).get("median_us") if floor_id else None
            ref = arms.get(ref_id, {}).get("median_us") if ref_id else None
            rows.append({"case": case["name"], "bytes": case["bytes"], "arm": arm_id,
                         "label": label, "median": a.get("median_us"), "p25": a.get("p25_us"),
                         "n": a.get("n"), "verified": a.get("verified"),
                         "floor": floor_id if floor else None,
                         "x_floor": a["median_us"] / floor if floor else None,
                         "speedup": ref / a["median_us"] if ref else None,
                         # the reference ran in the Python program, this arm in the C++ one
                         "cross": arm_id.startswith("cpp.")})
    return rows


def transfer_table(rows: list[dict]) -> str:
    short = {"floor.raw_one": "one send", "floor.raw_n": "N messages", "floor.ucx": "ucx_perftest",
             "floor.py_raw_one": "one send, Py", "floor.py_raw_n": "N messages, Py",
             "floor.allreduce_one": "one all_reduce", "floor.allreduce_n": "N all_reduces",
             "floor.py_allreduce_one": "one all_reduce, Py",
             "floor.py_allreduce_n": "N all_reduces, Py",
             "floor.py_init_remote": "init_remote floor, Py"}
    out = ["| case | arm | median µs | p25 µs | reps | × floor | × faster than reference | data |",
           "|---|---|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        xf = f"{r['x_floor']:.2f} ({short[r['floor']]})" if r["x_floor"] else ""
        sp = f"{r['speedup']:.1f}{' †' if r['cross'] else ''}" if r["speedup"] else ""
        ver = {True: "ok", False: "**FAILED**", None: ""}[r["verified"]]
        n = "" if r["n"] is None else str(r["n"])
        out.append(f"| {r['case']} | {r['label']} | {fmt_us(r['median'])} | {fmt_us(r['p25'])} "
                   f"| {n} | {xf} | {sp} | {ver} |")
    return "\n".join(out)


def conversion_micro(quick: bool) -> list[tuple[str, float, float | None, str]]:
    """Converting the reference's objects to ours and back (Python, one process): (label,
    ours in ns, the reference's construction of the same leaves from a dict in ns, what that
    ran)."""
    import tensordict
    import torch

    import tensordict_cpp

    out = []
    for nested in (False, True):
        leaves = {p: torch.zeros(4) for p in leaf_paths(1000, nested)}
        ref = tensordict.TensorDict(leaves, batch_size=[])
        ours = tensordict_cpp.TensorDict(ref)
        shape = "nested in 1111 levels" if nested else "flat"
        baseline = time_python(lambda: tensordict.TensorDict(leaves, batch_size=[]), quick)
        out.append((f"TensorDict(reference TensorDict), 1000 leaves, {shape}",
                    time_python(lambda: tensordict_cpp.TensorDict(ref), quick), baseline,
                    "tensordict.TensorDict(dict of the leaves)"))
        out.append((f"to_reference(), 1000 leaves, {shape}",
                    time_python(ours.to_reference, quick), baseline,
                    "tensordict.TensorDict(dict of the leaves)"))
    return out


# Everyday methods (docs/api-coverage.md), called the same way on either library's TensorDict.
METHOD_CALLS = {
    "td[key]": lambda td, torch: td["k0"],
    "td[key] = tensor": lambda td, torch: td.__setitem__("k0", td["k1"]),
    # materialized: the reference's keys() is a lazy view, ours a list
    "list(keys(True, True))": lambda td, torch: list(td.keys(True, True)),
    "select(10 keys)": lambda td, torch: td.select(*[f"k{i}" for i in range(10)]),
    "exclude(10 keys)": lambda td, torch: td.exclude(*[f"k{i}" for i in range(10)]),
    "flatten_keys()": lambda td, torch: td.flatten_keys(),
    "clone()": lambda td, torch: td.clone(),
    "apply(fn)": lambda td, torch: td.apply(lambda t: t),
    "td[0]": lambda td, torch: td[0],
    "to(torch.float64)": lambda td, torch: td.to(torch.float64),
    "sum(dim=0)": lambda td, torch: td.sum(dim=0),
    "td + td": lambda td, torch: td + td,
    "masked_fill(mask, 0)": lambda td, torch: td.masked_fill(td["k0"] > 0, 0),
    "permute(1, 0)": lambda td, torch: td.permute(1, 0),
}


def method_micro(quick: bool) -> list[tuple[str, float, float | None, str]]:
    """Per-call cost of everyday methods on a 100-leaf TensorDict (batch [4, 3], nested one level
    for half the leaves), ours and the reference's, in one process."""
    import tensordict
    import torch

    import tensordict_cpp

    def build(lib):
        td = lib.TensorDict({}, batch_size=[4, 3])
        for i in range(100):
            td["k" + str(i) if i < 50 else ("n", f"k{i}")] = torch.full((4, 3), float(i))
        return td

    mine, theirs = build(tensordict_cpp), build(tensordict)
    return [(f"{name}, 100 leaves", time_python(lambda: call(mine, torch), quick),
             time_python(lambda: call(theirs, torch), quick), "the same call")
            for name, call in METHOD_CALLS.items()]


# ---- a large NonTensorStack received -------------------------------------------------------
def stack_metadata(n: int) -> dict:
    """The metadata dict the reference's init_remote pickles for TensorDict(a=NonTensorStack of
    n strings "s{i}"), written out directly: the reference takes 20 s to consolidate 1e6."""
    return {"cls": "TensorDict", "non_tensors": {}, "leaves": {},
            "cls_metadata": {"device": None, "names": [None], "batch_size": [n],
                             "is_locked": False},
            "a": {"cls": "NonTensorStack",
                  "non_tensors": {str(i): (f"s{i}", [], None) for i in range(n)}, "leaves": {},
                  "cls_metadata": {"stack_dim": 0, "stack_dim_name": None, "is_locked": False}},
            "_total_bytes": 0}


def stack_rank(cfg: dict, rank: int, world_size: int) -> None:
    """Rank 0 sends the reference's init_remote messages for the stack (send_object_list
    framing, as the reference's sender: its pickle's length, Python's pickle of the dict, an
    empty storage), rank 1 times from_remote_init; then rank 1 times from_consolidated of the
    same stack's file. Seconds per call, median of the repetitions."""
    import pickle

    import torch
    import torch.distributed as dist

    import tensordict_cpp as ours

    torch.set_num_threads(1)
    n, reps = cfg["members"], cfg["reps"]
    if rank == 0:
        blob = pickle.dumps(stack_metadata(n))
        for _ in range(reps):
            dist.barrier()
            dist.send(torch.tensor([len(blob)]), dst=1)
            dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=1)
            dist.send(torch.empty(0, dtype=torch.uint8), dst=1)
        return
    remote, local = [], []
    for _ in range(reps):
        dist.barrier()  # the sender's pickle is ready: the time is the receive and the parse
        t0 = time.perf_counter()
        got = ours.TensorDict.from_remote_init(src=0)
        remote.append(time.perf_counter() - t0)
        ok = got["a"][n - 1] == f"s{n - 1}" and len(got["a"]) == n
        del got
    td = ours.TensorDict(a=ours.NonTensorStack.from_list([f"s{i}" for i in range(n)]),
                         batch_size=[n])
    path = os.path.join(cfg["tmp"], "stack.td")
    td.consolidate(filename=path)
    for _ in range(reps):
        t0 = time.perf_counter()
        got = ours.TensorDict.from_consolidated(path)
        local.append(time.perf_counter() - t0)
        ok = ok and got["a"][n - 1] == f"s{n - 1}"
        del got
    pathlib.Path(cfg["json"]).write_text(json.dumps(
        {"members": n, "pickle_bytes": len(pickle.dumps(stack_metadata(n))),
         "file_bytes": os.path.getsize(path), "from_remote_init_s": statistics.median(remote),
         "from_consolidated_s": statistics.median(local), "verified": bool(ok)}))


def stack_receive(quick: bool, tmp: str) -> dict:
    from tensordict_cpp.distributed import run

    out = pathlib.Path(tmp) / "stack.json"
    cfg = dict(members=100_000 if quick else 1_000_000, reps=1 if quick else 3, json=str(out),
               tmp=tmp)
    run(functools.partial(stack_rank, cfg), 2, timeout=600, group_timeout=300)
    return json.loads(out.read_text())


def stack_table(r: dict) -> str:
    n = f"{r['members']:,}"
    return "\n".join([
        "| receiving a NonTensorStack of " + n + " strings | bytes read | time | × the file |",
        "|---|--:|--:|--:|",
        f"| from_remote_init of the reference's init_remote (Python's pickle) | "
        f"{human(r['pickle_bytes'])} | {r['from_remote_init_s'] * 1e3:.0f} ms | "
        f"{r['from_remote_init_s'] / r['from_consolidated_s']:.2f} |",
        f"| from_consolidated of the same stack's file (JSON metadata) | "
        f"{human(r['file_bytes'])} | {r['from_consolidated_s'] * 1e3:.0f} ms | 1.00 |"])


def timeout_rank(cfg: dict, rank: int, world_size: int) -> None:
    """Rank 0 sends per-leaf (and consolidated) transfers, small ones in blocks back to back,
    large ones one per barrier; rank 1 times receives without a timeout, then with one (which
    lands in the library's buffers and is copied in), alternating, seconds per receive. Rank 1
    also times a memcpy of the large case into a warm buffer: the one copy a timeout adds."""
    import torch
    import torch.distributed as dist

    import tensordict_cpp as ours

    torch.set_num_threads(1)
    times: dict = {}
    for name, nbytes, consolidated, block, rounds in cfg["cases"]:
        td = ours.TensorDict(a=torch.full((nbytes // 4,), 1.0), batch_size=[])
        if consolidated:
            td = td.consolidate()
        for _ in range(rounds):
            for arm in ("plain", "timeout"):
                kw = {"timeout": 60.0} if arm == "timeout" else {}
                dist.barrier()
                if rank == 0:
                    for _ in range(block):
                        td.send(dst=1, consolidated=consolidated)
                    continue
                t0 = time.perf_counter()
                for _ in range(block):
                    td.recv(src=0, consolidated=consolidated, **kw)
                times.setdefault(name, {}).setdefault(arm, []).append(
                    (time.perf_counter() - t0) / block)
    if rank == 0:
        return
    big = max(c[1] for c in cfg["cases"])
    src, dst = torch.ones(big // 4), torch.zeros(big // 4)
    copies = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    pathlib.Path(cfg["json"]).write_text(json.dumps(
        {"cases": {k: {arm: statistics.median(v) for arm, v in arms.items()}
                   for k, arms in times.items()},
         "memcpy_s": statistics.median(copies[2:]), "memcpy_bytes": big}))


def timeout_cost(quick: bool, tmp: str) -> dict:
    from tensordict_cpp.distributed import run

    out = pathlib.Path(tmp) / "timeouts.json"
    big = (4 << 20) if quick else (100 << 20)
    cases = [("1 KB, per leaf", 1 << 10, False, 200 if quick else 1000, 3 if quick else 9),
             (f"{human(big)}, per leaf", big, False, 1, 3 if quick else 15),
             (f"{human(big)}, consolidated", big, True, 1, 3 if quick else 15)]
    run(functools.partial(timeout_rank, dict(cases=cases, json=str(out))), 2, timeout=900,
        group_timeout=300)
    return json.loads(out.read_text())


def timeout_table(r: dict) -> str:
    lines = ["| receive | without a timeout (µs) | with one (µs) | × "
             "| extra, in memcpys of the bytes |", "|---|--:|--:|--:|--:|"]
    per_byte = r["memcpy_s"] / r["memcpy_bytes"]
    for name, arms in r["cases"].items():
        plain, timed = arms["plain"], arms["timeout"]
        nbytes = 1 << 10 if name.startswith("1 KB") else r["memcpy_bytes"]
        lines.append(f"| {name} | {fmt_us(plain * 1e6)} | {fmt_us(timed * 1e6)} | "
                     f"{timed / plain:.3f} | {(timed - plain) / (per_byte * nbytes):.2f} |")
    lines.append(f"\nmemcpy of {human(r['memcpy_bytes'])} into a warm buffer: "
                 f"{r['memcpy_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def conversion_table(rows: list[tuple[str, float, float | None, str]]) -> str:
    out = ["| work | ours (Python) | reference | what ran there | × faster |",
           "|---|--:|--:|---|--:|"]
    for label, ours, theirs, what in rows:
        out.append(f"| {label} | {fmt_ns(ours)} | {fmt_ns(theirs) if theirs else ''} | {what} | "
                   f"{f'{theirs / ours:.1f}' if theirs else ''} |")
    return "\n".join(out)


def micro_table(ours: dict[str, float], theirs: dict[str, float]) -> str:
    out = ["| work | ours (C++) | reference / Python | what ran there | × faster |",
           "|---|--:|--:|---|--:|"]
    for name, label, what in MICRO_ROWS:
        if name not in ours:
            continue
        other = theirs.get(name) if what else None
        out.append(f"| {label} | {fmt_ns(ours[name])} | {fmt_ns(other) if other else ''} | "
                   f"{what} | {f'{other / ours[name]:.1f}' if other else ''} |")
    return "\n".join(out)


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} B"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(12, 6.5), dpi=100)
    colors = plt.cm.tab20.colors  # more arms than the default cycle's 10 colours
    for k, (arm_id, (label, _, _)) in enumerate(ARMS.items()):
        pts = sorted((r["bytes"], r["median"]) for r in rows if r["arm"] == arm_id and r["median"])
        if not pts:
            continue
        style = "--" if arm_id.startswith("floor") else ("-." if arm_id.startswith("ref") else "-")
        ax.plot(*zip(*pts), style, marker="o", markersize=4, label=label,
                color=colors[k % len(colors)])
    ax.set_xscale("log")
    ax.set_yscale("log")
    # The cases differ in leaf count as well as bytes: name them on the axis.
    cases = sorted({(r["bytes"], r["case"]) for r in rows})
    ax.set_xticks([b for b, _ in cases], [f"{n} ({human(b)})" for b, n in cases], fontsize=7,
                  rotation=90)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("case, bytes per transfer")
    ax.set_ylabel("median latency, send to ack (µs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("tensordict-cpp transfers vs the reference and the floors")
    fig.tight_layout()
    fig.savefig(path)


def machine() -> dict:
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines()
                  if l.startswith("Model name")), platform.processor())
    mem = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    import tensordict
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem / 2**20, 1),
            "kernel": platform.release(), "torch": torch.__version__,
            "reference": f"tensordict {tensordict.__version__}",
            "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")}


def write_docs(info: dict, transfer: str, micro: str, targets: str, pipe: str, command: str,
               loads: list[float], note: str) -> None:
    docs = ROOT / "docs"
    doc = f"""# Benchmarks

Generated by `{command}` (do not edit by hand; rerun it). Latest run:

| machine | |
|---|---|
| CPU | {info['cpu']} |
| cores | {info['cores']} |
| memory | {info['memory_gib']} GiB |
| kernel | Linux {info['kernel']} |
| torch | {info['torch']} (CPU) |
| reference | {info['reference']} |
| date | {info['date']} |
| load average (1 min) before each case | {', '.join(f'{x:.2f}' for x in loads)} |
{note}
## How it measures

Each case is run by two C++ ranks (`build/transfer_bench`), then by two Python ranks (the
reference `tensordict` and ours through `tensordict_cpp`), then by `ucx_perftest` when the pipe
is built. Ranks talk over Gloo on 127.0.0.1 (a FileStore rendezvous), one intra-op thread each.
A timed transfer runs from the sender's first call until a small acknowledgement from the
receiver arrives, so it includes delivery. Warm-up rounds come first; then every round runs
each arm once, in a new random order (the same on both ranks), so that drift and the
after-effects of one arm on the next hit all arms alike. A
case stops when every arm's median is known to within ±1.5% (distribution-free 95% interval,
at least 30 rounds) or at a time cap. After timing the receiver checks every value it got
("data" column).

Floors: **one send**: one raw c10d send of the same bytes (the consolidated storage);
**N messages**: the same number of raw c10d messages as leaves, all posted then waited. Each
rank program measures its own (C++: `ProcessGroup::send`; Python, "Py": `torch.distributed`),
so every "× floor" compares arms that ran side by side;
**memcpy**: one memcpy of the same bytes into a warm buffer (rank 0 alone, no ack);
**ucx_perftest**: `tag_lat` (UCP tag messages, as the pipe sends its frames, with peer error
handling; TCP on loopback, as the pipe runs here) median one-way latency of the bytes plus that
of 8 bytes (the ack), run right after the case. ucx_perftest busy-polls; the pipe spins for
100 µs, then sleeps in epoll. The pipe on shared memory, beside ucx_perftest, the reference's
pipe and a raw Gloo send, has a section of its own below. Per-leaf arms are compared with N
messages, consolidated and init_remote arms with one send; "× faster than reference"
compares the same kind of transfer. † marks a C++ arm compared with the reference measured by
the Python program a few seconds later: on a loaded machine the two programs can land in
different latency modes, so compare the floors of both programs before trusting it.
init_remote arms include consolidating and pickling the metadata each time (a cold start).
all_reduce arms (cases of 100 leaves or more, up to 1 MiB) run on both ranks with MAX, so the
values stay put round after round; per leaf they are compared with one raw all_reduce per
leaf, with `bucket_bytes` (1 MiB: one bucket) with one raw all_reduce of all the bytes.

The run keeps both cores busy itself, so the load average read before a case includes the
previous case; a value well above 2 means other work shared the machine.

On a 2-core VM small transfers are bimodal: a fast mode of tens of µs, and a slow one near a
4 ms scheduler tick (a rank that is not woken at once runs at the next tick of the kernel's
250 Hz timer, and the share of such iterations varies from run to run, from under 1% to about
30%). The median follows whichever mode dominates in that run; the p25 column shows the fast
mode.

## Transfers

![latency against bytes](benchmarks.png)

{transfer}

## The pipe

{pipe}

## Micro-benchmarks

`build/micro_bench` (Google Benchmark, median of repetitions); the comparison column ran the
same work in the reference or in Python's C-accelerated modules, in one process. Python's
times include its garbage collector, as a caller's would.

{micro}

## Goals

The ratios set as goals for the wire layer, from the arms and micro-benchmarks
above. The third column is the same ratio for one 1 KB leaf, where there is next to no work
to do: it is what the sequence of messages costs by itself. init_remote's wire (the
reference's) is three messages, each received before the next can be posted (the pickle's
length, the pickle, then the storage, whose size the pickle gives); a checked transfer's
receiver reads the header before it posts anything else. On this machine each such step costs
a thread wake-up, so a goal below that column cannot be met without another wire.

{targets}
"""
    (docs / "benchmarks.md").write_text(doc)


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"one small case ({QUICK_CASE}), few repetitions, the pipe with 4 MB "
                             "for 100 MB (the smoke test)")
    parser.add_argument("--no-write", action="store_true",
                        help="print only: leave docs/benchmarks.md and docs/benchmarks.png")
    parser.add_argument("--json", help="also write every result to this file")
    parser.add_argument("--case", action="append", choices=[c[0] for c in CASES],
                        help="run only this case (repeatable)")
    args = parser.parse_args()
    build = pathlib.Path(os.environ.get("TENSORDICT_BUILD_DIR", ROOT / "build"))
    missing = [p for p in ("transfer_bench", "micro_bench") if not (build / p).is_file()]
    if missing:
        print(f"benchmarks/run: {', '.join(missing)} not found in {build}: run scripts/setup "
              "(or set TENSORDICT_BUILD_DIR to a build with benchmarks)", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    names = args.case or ([QUICK_CASE] if args.quick else [c[0] for c in CASES])
    cases = [c for c in CASES if c[0] in names]
    if args.quick:
        settings = dict(cpp_cap=2.0, py_cap=3.0, min_reps=5, max_reps=200, warmup=2)
    else:
        settings = dict(cpp_cap=12.0, py_cap=20.0, min_reps=8, max_reps=3000, warmup=3)
    t_start = time.monotonic()
    results, loads = [], []
    with tempfile.TemporaryDirectory(prefix="tensordict_bench_") as tmp:
        for case in cases:
            loads.append(os.getloadavg()[0])
            name, leaves, nbytes, _, members = case
            print(f"benchmarks/run: {name} ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            cpp = ({"arms": {}} if members  # the C++ program has no lazy stacks to send
                   else run_cpp(build, [case], settings, tmp)["cases"][0])
            t1 = time.monotonic()
            py = run_python([case], settings, tmp)["cases"][0]
            t2 = time.monotonic()
            merged = {"name": name, "bytes": leaves * nbytes, "leaves": leaves,
                      "arms": dict(cpp["arms"], **py["arms"])}
            if "cpp.pipe" in cpp["arms"]:
                lat, ack = ucx_lat(leaves * nbytes, args.quick), ucx_lat(8, args.quick)
                if lat is not None and ack is not None:
                    merged["arms"]["floor.ucx"] = {"median_us": lat + ack}
            results.append(merged)
            print(f"benchmarks/run: {name}: C++ {t1 - t0:.0f} s, Python {t2 - t1:.0f} s, "
                  f"ucx_perftest {time.monotonic() - t2:.0f} s", file=sys.stderr, flush=True)
        print("benchmarks/run: micro-benchmarks ...", file=sys.stderr, flush=True)
        micro = run_micro(build, args.quick)
        ref_micro = reference_micro(args.quick)
        conversions = conversion_micro(args.quick)
        methods = method_micro(args.quick)
        print("benchmarks/run: a large NonTensorStack received ...", file=sys.stderr, flush=True)
        stack = stack_receive(args.quick, tmp)
        print("benchmarks/run: receives with a timeout ...", file=sys.stderr, flush=True)
        timeouts = timeout_cost(args.quick, tmp)
    pipe_md = "(not built: no build/pipe_bench)"
    if (build / "pipe_bench").is_file():
        print("benchmarks/run: the pipe ...", file=sys.stderr, flush=True)
        import pipe_bench
        pipe_md = pipe_bench.section(pipe_bench.measure(args.quick, 1 if args.quick else 3))
    print("benchmarks/run: publication ...", file=sys.stderr, flush=True)
    import publication_bench
    publication = publication_bench.measure(args.quick)
    pipe_md += "\n\n" + publication_bench.section(publication)
    print("benchmarks/run: torchrl collectors ...", file=sys.stderr, flush=True)
    import torchrl_collector_bench
    collectors = torchrl_collector_bench.run(args.quick)
    pipe_md += "\n\n" + torchrl_collector_bench.section(collectors)
    print("benchmarks/run: across hosts ...", file=sys.stderr, flush=True)
    import hosts_bench
    hosts = hosts_bench.run(args.quick)
    pipe_md += "\n\n" + hosts_bench.section(hosts)
    rows = merge(results)
    transfer, micro_md = transfer_table(rows), micro_table(micro, ref_micro)
    micro_md += (
        "\n\nConverting the reference's objects (docs/with-tensordict.md), in Python: the leaves "
        "are shared, so the cost is O(leaves) and no data is copied (goal: under 1 ms for 1000 "
        "leaves). The comparison builds the reference's TensorDict from a dict of the same "
        "leaves.\n\n" + conversion_table(conversions) +
        "\n\nEveryday methods (docs/api-coverage.md), per call, in Python, on a 100-leaf "
        "TensorDict: the same call on ours and on the reference, side by side in this run (goal: "
        "ours within 1.5x of the reference's time, i.e. × faster at least 0.67).\n\n" +
        conversion_table(methods) +
        "\n\nA large NonTensorStack received, in Python: from_remote_init of the "
        "messages the reference's init_remote sends (Python's pickle fills the stack's dict "
        "1000 entries at a time), beside from_consolidated of the same stack's file, median of "
        "the repetitions (goal: within 2x of the file).\n\n" + stack_table(stack) +
        "\n\nA receive with a timeout (docs/reliability.md, \"Timeouts\"), in "
        "Python: it lands in the library's buffers and is copied in once whole, so that a "
        "timeout leaves the TensorDict unchanged. Medians of alternating blocks, sender "
        "sending back to back (goals: 1.05x at 1 KB; at 100 MB at most one memcpy more).\n\n" +
        timeout_table(timeouts))
    targets = target_table(rows, micro, ref_micro)
    verified = (all(r["verified"] is not False for r in rows) and stack["verified"]
                and all(c.get("verified") is not False for c in collectors.get("cases", []))
                and all("error" not in r for r in hosts.get("runs", [])))
    print(transfer)
    print()
    print(micro_md)
    print()
    print(targets)
    print()
    print(pipe_md)
    print()
    elapsed = time.monotonic() - t_start
    print(f"data verification: {'passed' if verified else 'FAILED'}; {elapsed:.0f} s; "
          f"load averages before each case: {', '.join(f'{x:.2f}' for x in loads)}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"cases": results, "rows": rows, "micro": micro, "reference_micro": ref_micro,
             "stack_receive": stack, "timeouts": timeouts, "publication": publication,
             "torchrl_collectors": collectors, "hosts": hosts,
             "verified": verified,
             "seconds": elapsed}, indent=1))
    if not args.no_write:
        # The options that change what is measured; --json only copies the results elsewhere.
        shown = [f"--case {c}" for c in args.case or []] + (["--quick"] if args.quick else [])
        command = " ".join(["benchmarks/run", *shown])
        note = os.environ.get("TENSORDICT_BENCH_NOTE", "")
        write_docs(machine(), transfer, micro_md, targets, pipe_md, command, loads,
                   f"\n{note}\n" if note else "")
        plot(rows, ROOT / "docs" / "benchmarks.png")
        print("wrote docs/benchmarks.md and docs/benchmarks.png")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
