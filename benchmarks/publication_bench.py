"""Publication's benchmark: tensordict_cpp.Publisher / Subscriber (docs/publication.md) beside
its baselines, every one measured in this run, on one host (Gloo over 127.0.0.1):

1. Torn reads: 1 publisher publishing back to back a nested TensorDict (6 leaves, 64 KiB)
   whose every element holds the version number, 3 subscribers pulling in a loop, each pull
   checked: every leaf constant and equal to the version returned, versions increasing.
2. Stalls: a 16 MiB TensorDict published at a steady rate to 3 subscribers pulling
   continuously; healthy, with one subscriber SIGSTOPped mid-pull, with one SIGKILLed mid-pull
   (each a launch of its own: a killed rank ends its world). publish() p50 / p99 and the
   healthy subscribers' delivery time (publish() return -> pull() return).
3. Speed: one pull of 100 MiB (one leaf; 100 leaves, consolidated) beside our consolidated
   td.send / td.recv, one raw torch.distributed send / recv of the same bytes and a memcpy of
   them into a warm buffer, alternating arms in the same two processes.
4. Memory: peak and current RSS of the publisher and of a subscriber with a 256 MiB TensorDict
   and max_slots=2, above their RSS before the TensorDict existed.
5. Fan-out: time from publish() start until the last of 4 workers waiting in pull() holds the
   update, 1000 leaves (4 MiB) and one 64 MiB leaf, beside torchrl 0.14.1's
   DistributedWeightSyncScheme (benchmarks/torchrl_baseline.py, run in a process of its own
   on the peer stack, .peers/td014, which scripts/peers installs).

Every rank is a process of this file (--rank), launched here with its own TCPStore rendezvous
and a deadline; whatever happens, every process is killed before its launch returns.
--quick shrinks the sizes and counts (the smoke run).

    .venv/bin/python benchmarks/publication_bench.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench import summarize  # noqa: E402

MiB = 1 << 20
CTRL_TAG = 1 << 20  # our control messages on the group, beside the publication's own
PEER_STACK = ROOT / ".peers" / "td014"
TORCHRL_BASELINE = ROOT / "benchmarks" / "torchrl_baseline.py"


STALL_MODES = ("healthy", "stopped", "killed")


def config(quick: bool) -> dict:
    """Every size and count of a run. Stalls: (bytes, publish period s, publishes, scenarios);
    16 MiB every 50 ms leaves the 2-core machine time to spare (every 20 ms, 3 subscribers'
    pulls of 16 MiB do not keep up); 64 MiB is more than loopback TCP buffers hold (a
    stopped subscriber's 16 MiB can land whole in the kernel: tcp_rmem's maximum is 32 MiB
    here), so that the stopped subscriber pins its slot to the end."""
    if quick:
        return dict(torn_pulls=3000, stall_cases=[(16 * MiB, 0.05, 30, STALL_MODES)],
                    speed_bytes=4 * MiB, speed_rounds=3, memory_bytes=16 * MiB,
                    fanout_reps=3, fanout_warmup=1, torchrl_reps=1, torchrl_warmup=0,
                    torchrl_stall_cap=2.0)
    return dict(torn_pulls=100_000, stall_cases=[(16 * MiB, 0.05, 150, STALL_MODES),
                                                 (64 * MiB, 0.15, 50, STALL_MODES[:2])],
                speed_bytes=100 * MiB, speed_rounds=15, memory_bytes=256 * MiB,
                fanout_reps=20, fanout_warmup=3, torchrl_reps=10, torchrl_warmup=2,
                torchrl_stall_cap=10.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pctl(xs: list[float], q: float) -> float:
    """Nearest rank (with fewer than 100 samples, p99 is the maximum)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def stats_ms(seconds: list[float]) -> dict:
    """summarize()'s figures (µs) of samples in seconds, plus p99 and max, in ms."""
    s = summarize([x * 1e6 for x in seconds])
    if not s["n"]:
        return s
    return {"n": s["n"], "median_ms": s["median_us"] / 1e3, "p25_ms": s["p25_us"] / 1e3,
            "p75_ms": s["p75_us"] / 1e3, "ci_lo_ms": s["ci_lo_us"] / 1e3,
            "ci_hi_ms": s["ci_hi_us"] / 1e3, "p99_ms": pctl(seconds, 0.99) * 1e3,
            "max_ms": max(seconds) * 1e3}


def proc_status() -> dict:
    """VmRSS and VmHWM of this process, bytes."""
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


# ---- the launcher ------------------------------------------------------------------------------
def launch(scenario: str, world: int, cfg: dict, timeout: float, may_die: tuple = ()) -> list:
    """Runs `world` ranks of this file for `scenario` (rank 0 the TCPStore's master), waits at
    most `timeout` s, kills what is left; returns each rank's result (None for a rank in
    `may_die` that left none). Raises if any other rank failed."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="publication_bench_"))
    port = free_port()
    cfg = dict(cfg, deadline=timeout, tmp=str(tmp))
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = []
    try:
        for rank in range(world):
            log = open(tmp / f"rank{rank}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, str(pathlib.Path(__file__).resolve()), "--rank", str(rank),
                 "--world", str(world), "--port", str(port), "--scenario", scenario,
                 "--cfg", str(tmp / "cfg.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))
            log.close()
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        results, failed = [], []
        for rank, p in enumerate(procs):
            out = tmp / f"rank{rank}.json"
            results.append(json.loads(out.read_text()) if out.is_file() else None)
            if rank in may_die:
                continue
            if p.poll() is None:
                failed.append(f"rank {rank} still running after {timeout:.0f} s")
            elif p.returncode != 0 or results[-1] is None:
                failed.append(f"rank {rank} exited {p.returncode}")
        if failed:
            logs = "\n".join(f"--- rank {r}:\n{(tmp / f'rank{r}.log').read_text()[-3000:]}"
                             for r in range(world))
            raise RuntimeError(f"publication_bench {scenario}: {', '.join(failed)}\n{logs}")
        for rank, res in enumerate(results):
            if res is not None:
                res["exit_code"] = procs[rank].returncode
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
                p.wait()
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


# ---- the ranks ---------------------------------------------------------------------------------
def watchdog(seconds: float, parent: int) -> None:
    """os._exit(3) after `seconds`; os._exit(4) as soon as the launcher is gone."""
    def fire():
        sys.stderr.write(f"publication_bench: watchdog after {seconds:.0f} s\n")
        sys.stderr.flush()
        os._exit(3)

    def orphan():
        while True:
            if os.getppid() != parent:
                os._exit(4)
            time.sleep(0.5)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    threading.Thread(target=orphan, daemon=True).start()


def rank_main(args) -> int:
    cfg = json.loads(pathlib.Path(args.cfg).read_text())
    watchdog(cfg["deadline"], os.getppid())
    import torch
    import torch.distributed as dist
    import tensordict_cpp  # noqa: F401  (imported before the base memory figure)

    torch.set_num_threads(1)
    limit = datetime.timedelta(seconds=min(120, cfg["deadline"]))
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=args.rank == 0,
                          timeout=limit)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                            timeout=limit)
    store.set(f"pid{args.rank}", str(os.getpid()))
    result = SCENARIOS[args.scenario](args.rank, args.world, store, cfg)
    t0 = time.monotonic()
    dist.destroy_process_group()
    result["teardown_s"] = time.monotonic() - t0
    out = pathlib.Path(cfg["tmp"]) / f"rank{args.rank}.json"
    tmp = out.with_suffix(".part")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)
    return 0


def wait_keys(store, keys: list[str], seconds: float) -> bool:
    """Whether every key was set within `seconds` (polled: a survivor must not block on a
    dead rank's key)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if store.check(keys):
            return True
        time.sleep(0.005)
    return False


def subscriber_rows(pub, ranks=None) -> list:
    return [dict(s) for s in pub.stats() if ranks is None or s["rank"] in ranks]


# 1. Torn reads ----------------------------------------------------------------------------------
def torn_td(v: int):
    """Six leaves, three levels, 64 KiB, every element v."""
    import torch
    from tensordict_cpp import TensorDict

    td = TensorDict({
        "obs": torch.zeros(64, 64),                                       # 16 KiB
        "step": torch.zeros(2048, dtype=torch.int64),                     # 16 KiB
        "policy": {"w": torch.zeros(1024, dtype=torch.float64),          # 8 KiB
                   "b": torch.zeros(1024, dtype=torch.int64),            # 8 KiB
                   "deep": {"x": torch.zeros(2048, dtype=torch.int32),   # 8 KiB
                            "y": torch.zeros(16, 128)}},                  # 8 KiB
    }, batch_size=[])
    for leaf in td.values(include_nested=True, leaves_only=True):
        leaf.fill_(v)
    return td


def torn_rank(rank: int, world: int, store, cfg: dict) -> dict:
    from tensordict_cpp import Publisher, Subscriber

    subs = world - 1
    if rank == 0:
        td = torn_td(0)
        leaves = list(td.values(include_nested=True, leaves_only=True))
        pub = Publisher(max_slots=2)
        store.set("ready0", "1")
        mismatched, v = 0, 0
        t0 = time.monotonic()
        while True:
            for leaf in leaves:
                leaf.fill_(v + 1)
            got = pub.publish(td)
            mismatched += got != v + 1
            v = got
            if v % 32 == 0 and store.add("done", 0) >= subs:
                break
        seconds = time.monotonic() - t0
        stats = subscriber_rows(pub)
        pub.close()
        return {"published": v, "seconds": seconds, "version_mismatch": mismatched,
                "stats": stats}
    sub = Subscriber(src=0)
    td = torn_td(0)
    leaves = list(td.values(include_nested=True, leaves_only=True))
    target = cfg["torn_pulls"] // subs + (rank <= cfg["torn_pulls"] % subs)
    store.wait(["ready0"])
    pulls = torn = not_increasing = timeouts = 0
    last, versions, first_bad = 0, [], None
    t0 = time.monotonic()
    while pulls < target:
        v = sub.pull(td, timeout=5)
        if v is None:
            timeouts += 1
            if timeouts > 3:
                break
            continue
        pulls += 1
        bad = any(int(leaf.min()) != v or int(leaf.max()) != v for leaf in leaves)
        if bad:
            torn += 1
            if first_bad is None:
                first_bad = {"version": v, "leaves": [[int(leaf.min()), int(leaf.max())]
                                                      for leaf in leaves]}
        not_increasing += v <= last
        last = v
        versions.append(v)
    seconds = time.monotonic() - t0
    store.add("done", 1)
    return {"pulls": pulls, "torn": torn, "not_increasing": not_increasing,
            "timeouts": timeouts, "seconds": seconds, "versions": versions,
            "first_torn": first_bad, "last": last}


def run_torn(cfg: dict) -> dict:
    res = launch("torn", 4, cfg, timeout=240 if cfg["torn_pulls"] > 10_000 else 90)
    pub, subs = res[0], res[1:]
    seen = set()
    for s in subs:
        seen.update(s.pop("versions"))
    pulls = sum(s["pulls"] for s in subs)
    return {"subscribers": len(subs), "pulls": pulls, "torn": sum(s["torn"] for s in subs),
            "not_increasing": sum(s["not_increasing"] for s in subs),
            "timeouts": sum(s["timeouts"] for s in subs), "distinct_versions": len(seen),
            "published": pub["published"], "version_mismatch": pub["version_mismatch"],
            "seconds": pub["seconds"], "pulls_per_s": pulls / max(s["seconds"] for s in subs),
            "per_subscriber": subs, "publisher": pub}


# 2. Stalls --------------------------------------------------------------------------------------
STALL_LEAVES = 4
VICTIM = 3


def stall_td(nbytes: int):
    import torch
    from tensordict_cpp import TensorDict

    n = nbytes // 4 // STALL_LEAVES
    return TensorDict({f"w{i}": torch.zeros(n) for i in range(STALL_LEAVES)}, batch_size=[])


def stall_rank(rank: int, world: int, store, cfg: dict) -> dict:
    from tensordict_cpp import Publisher, Subscriber

    mode, n, period = cfg["mode"], cfg["stall_publishes"], cfg["stall_period"]
    last_version = n + 1  # one warm-up publish, then n
    event_at = n // 5     # the publish after which the victim is stopped / killed
    td = stall_td(cfg["stall_bytes"])
    leaves = list(td.values())
    if rank == 0:
        pub = Publisher(max_slots=2)
        store.wait([f"ready{r}" for r in range(1, world)])
        for leaf in leaves:
            leaf[0] = leaf[-1] = 1
        pub.publish(td)
        wait_keys(store, [f"warm{r}" for r in range(1, world)], 30)
        victim_pid = int(store.get(f"pid{VICTIM}"))
        event: dict = {}

        def strike():
            """SIGSTOP / SIGKILL the victim as soon as it is receiving a version."""
            sig = signal.SIGSTOP if mode == "stopped" else signal.SIGKILL
            end = time.monotonic() + 5
            while time.monotonic() < end:
                row = subscriber_rows(pub, [VICTIM])[0]
                if row["pinned"] is not None:
                    os.kill(victim_pid, sig)
                    event.update(at=time.monotonic(), pinned=row["pinned"], before=row)
                    time.sleep(0.1)
                    event["after_100ms"] = subscriber_rows(pub, [VICTIM])[0]
                    return
                time.sleep(0.0002)
            event["missed"] = True

        striker = None
        published, durations = {}, []
        t_next = time.monotonic()
        for i in range(n):
            t_next += period
            delay = t_next - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            for leaf in leaves:
                leaf[0] = leaf[-1] = i + 2
            t0 = time.monotonic()
            v = pub.publish(td, timeout=30)
            t1 = time.monotonic()
            published[v] = t1
            durations.append((i, t1 - t0))
            if i == event_at and mode != "healthy":
                striker = threading.Thread(target=strike)
                striker.start()
        if striker:
            striker.join()
        end_stats = subscriber_rows(pub)
        if mode == "stopped":
            os.kill(victim_pid, signal.SIGCONT)
        survivors = [r for r in range(1, world) if mode != "killed" or r != VICTIM]
        finished = wait_keys(store, [f"done{r}" for r in survivors], 60)
        final_stats = subscriber_rows(pub)
        t0 = time.monotonic()
        pub.close()
        close_s = time.monotonic() - t0
        return {"mode": mode, "event_at": event_at, "published": published,
                "durations": durations, "event": event, "stats_at_end": end_stats,
                "stats_final": final_stats, "survivors_finished": finished,
                "close_s": close_s}
    sub = Subscriber(src=0)
    store.set(f"ready{rank}", "1")
    pulls, bad, timeouts, warm = [], 0, 0, False
    while True:
        t0 = time.monotonic()
        v = sub.pull(td, timeout=2)
        t1 = time.monotonic()
        if v is None:
            timeouts += 1
            if timeouts > 5:
                break
            continue
        bad += any(int(leaf[0]) != v or int(leaf[-1]) != v for leaf in leaves)
        pulls.append((v, t0, t1))
        if not warm:
            store.set(f"warm{rank}", "1")
            warm = True
        if v >= last_version:
            break
    store.set(f"done{rank}", "1")
    return {"pulls": pulls, "bad": bad, "timeouts": timeouts}


def run_stall(cfg: dict, case: tuple, mode: str) -> dict:
    nbytes, period, publishes, _ = case
    res = launch("stall", 4, dict(cfg, mode=mode, stall_bytes=nbytes, stall_period=period,
                                  stall_publishes=publishes), timeout=60 + 2 * period * publishes,
                 may_die=(VICTIM,) if mode == "killed" else ())
    pub = res[0]
    published = {int(k): t for k, t in pub["published"].items()}
    event_at = pub["event_at"]
    window = [d for i, d in pub["durations"] if i > event_at]  # publishes after the event
    first_v = event_at + 3  # the version of the first publish after the event
    healthy = [r for r in range(1, 4) if r != VICTIM or mode == "healthy"]
    delivery, calls, bad, timeouts = [], [], 0, 0
    for r in healthy:
        for v, t0, t1 in res[r]["pulls"]:
            if v >= first_v and v in published:
                delivery.append(t1 - published[v])
                calls.append(t1 - t0)
        bad += res[r]["bad"]
        timeouts += res[r]["timeouts"]
    victim = res[VICTIM]
    return {"mode": mode, "bytes": nbytes, "period_s": period, "publishes": publishes,
            "publish": stats_ms(window), "delivery": stats_ms(delivery),
            "pull_call": stats_ms(calls), "healthy_pulls": len(delivery), "bad": bad,
            "timeouts": timeouts, "event": pub["event"],
            "victim": None if victim is None else {
                "pulls": len(victim["pulls"]), "bad": victim["bad"],
                "last": victim["pulls"][-1][0] if victim["pulls"] else None,
                "exit_code": victim["exit_code"]},
            "stats_final": pub["stats_final"], "survivors_finished": pub["survivors_finished"],
            "close_s": pub["close_s"], "publisher_teardown_s": pub["teardown_s"],
            "versions": len(published)}


# 3. Speed ---------------------------------------------------------------------------------------
def speed_td(leaves: int, nbytes: int):
    import torch
    from tensordict_cpp import TensorDict

    return TensorDict({f"x{i:03d}": torch.zeros(nbytes // leaves, dtype=torch.uint8)
                       for i in range(leaves)}, batch_size=[])


def stamp(td, r: int) -> None:
    for leaf in td.values():
        leaf[0] = leaf[-1] = r % 256


def stamped(td, r: int) -> bool:
    return all(int(leaf[0]) == r % 256 and int(leaf[-1]) == r % 256 for leaf in td.values())


def pipes(rank: int, store) -> tuple:
    """(publisher or subscriber, plain pipe, what to close) over the UCX pipe, UCX's choice of
    transports: rank 0 runs a publishing server and a second server for the plain pipe."""
    from tensordict_cpp import Publisher, Subscriber, TensorDictPipe, TensorDictServer
    if rank == 0:
        servers = [TensorDictServer(0, timeout=60.0), TensorDictServer(0, timeout=60.0)]
        pub = Publisher(servers[0], max_slots=2)
        store.set("pipe_ports", json.dumps([s.port for s in servers]))
        plain = servers[1].accept_sync(60)
        return pub, plain, [pub] + servers
    ports = json.loads(store.get("pipe_ports"))
    sub_pipe = TensorDictPipe.connect_sync("127.0.0.1", ports[0], timeout=60.0)
    plain = TensorDictPipe.connect_sync("127.0.0.1", ports[1], timeout=60.0)
    return Subscriber(sub_pipe), plain, [sub_pipe, plain]


def speed_rank(rank: int, world: int, store, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from tensordict_cpp import Publisher, Subscriber

    nbytes, rounds = cfg["speed_bytes"], cfg["speed_rounds"]
    go = torch.zeros(1, dtype=torch.int32)
    arms = ("pull", "recv", "raw", "pipe pull", "pipe recv")
    out: dict = {}
    pub = Publisher(max_slots=2) if rank == 0 else None
    sub = Subscriber(src=0) if rank == 1 else None
    pipe_end, plain, to_close = pipes(rank, store)
    for case, leaves, consolidated in (("1 leaf", 1, False), ("100 leaves, consolidated", 100,
                                                                True)):
        pull_td = speed_td(leaves, nbytes)
        if consolidated:
            pull_td = pull_td.consolidate()
        cons = speed_td(leaves, nbytes).consolidate()
        raw = torch.zeros(nbytes, dtype=torch.uint8)
        times = {a: [] for a in arms}
        copies, verified = [], True
        src = torch.ones(nbytes, dtype=torch.uint8) if rank == 1 else None
        dst = torch.zeros(nbytes, dtype=torch.uint8) if rank == 1 else None
        piped = cons  # the plain pipe's receiver: its last result, refilled in place
        for r in range(-1, rounds):  # round -1: the warm-up (the schema, the buffers)
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                tag = 256 + r
                if rank == 0:
                    dist.recv(go, src=1, tag=CTRL_TAG)
                    if arm in ("pull", "pipe pull"):
                        stamp(pull_td, tag)
                        (pub if arm == "pull" else pipe_end).publish(pull_td)
                        dist.send(go, dst=1, tag=CTRL_TAG)
                    elif arm == "recv":
                        stamp(cons, tag)
                        cons.send(dst=1, consolidated=True)
                    elif arm == "pipe recv":
                        stamp(cons, tag)
                        plain.send(cons)
                    else:
                        raw[0] = raw[-1] = tag % 256
                        dist.send(raw, dst=1)
                    continue
                if arm in ("pull", "pipe pull"):
                    dist.send(go, dst=0, tag=CTRL_TAG)
                    dist.recv(go, src=0, tag=CTRL_TAG)
                    t0 = time.perf_counter()
                    got = (sub if arm == "pull" else pipe_end).pull(pull_td, timeout=60)
                    t1 = time.perf_counter()
                    verified &= got is not None and stamped(pull_td, tag)
                elif arm == "pipe recv":
                    t0 = time.perf_counter()
                    dist.send(go, dst=0, tag=CTRL_TAG)
                    piped = plain.recv(piped)
                    t1 = time.perf_counter()
                    verified &= stamped(piped, tag)
                elif arm == "recv":
                    t0 = time.perf_counter()
                    dist.send(go, dst=0, tag=CTRL_TAG)
                    cons.recv(src=0, consolidated=True)
                    t1 = time.perf_counter()
                    verified &= stamped(cons, tag)
                else:
                    t0 = time.perf_counter()
                    dist.send(go, dst=0, tag=CTRL_TAG)
                    dist.recv(raw, src=0)
                    t1 = time.perf_counter()
                    verified &= int(raw[0]) == tag % 256 and int(raw[-1]) == tag % 256
                if r >= 0:
                    times[arm].append(t1 - t0)
            if rank == 1:  # the floor: one memcpy of the bytes into a warm buffer
                t0 = time.perf_counter()
                dst.copy_(src)
                t1 = time.perf_counter()
                if r >= 0:
                    copies.append(t1 - t0)
        if rank == 1:
            out[case] = {"leaves": leaves, "bytes": nbytes, "verified": bool(verified),
                         "memcpy": stats_ms(copies), **{a: stats_ms(t) for a, t in times.items()}}
        del pull_td, cons, raw, src, dst, piped
    dist.barrier()
    if pub is not None:
        pub.close()
    for x in to_close:
        x.close()
    return out


def run_speed(cfg: dict) -> dict:
    res = launch("speed", 2, cfg, timeout=240)[1]
    return {case: v for case, v in res.items() if isinstance(v, dict)}


# 4. Memory --------------------------------------------------------------------------------------
def memory_rank(rank: int, world: int, store, cfg: dict) -> dict:
    import torch
    from tensordict_cpp import Publisher, Subscriber, TensorDict

    nbytes = cfg["memory_bytes"]
    base = proc_status()
    n = nbytes // 4 // 4
    td = TensorDict({f"w{i}": torch.empty(n).fill_(i) for i in range(4)}, batch_size=[])
    with_td = proc_status()
    versions = 3
    if rank == 0:
        pub = Publisher(max_slots=2)
        for v in range(1, versions + 1):
            for leaf in td.values():
                leaf[0] = v
            pub.publish(td)
            store.set(f"pub{v}", "1")
            store.wait([f"pulled{v}_{r}" for r in range(1, world)])
        end = proc_status()
        store.set("measured0", "1")
        store.wait([f"measured{r}" for r in range(1, world)])
        pub.close()
    else:
        sub = Subscriber(src=0)
        ok = True
        for v in range(1, versions + 1):
            store.wait([f"pub{v}"])
            got = sub.pull(td, timeout=60, min_version=v)
            ok &= got == v and all(int(leaf[0]) == v for leaf in td.values())
            store.set(f"pulled{v}_{rank}", "1")
        end = proc_status()
        store.set(f"measured{rank}", "1")
        store.wait(["measured0"])
    return {"bytes": nbytes, "base": base, "with_td": with_td, "end": end,
            **({"verified": bool(ok)} if rank else {})}


def run_memory(cfg: dict) -> dict:
    res = launch("memory", 3, cfg, timeout=120)
    nbytes, slots = cfg["memory_bytes"], 2
    out = {"bytes": nbytes, "max_slots": slots, "subscribers": 2}
    for name, r, limit in (("publisher", res[0], nbytes + slots * nbytes + 32 * MiB),
                           ("subscriber", res[1], 2 * nbytes + 32 * MiB)):
        added = r["end"]["VmHWM"] - r["base"]["VmRSS"]
        out[name] = {"base_rss": r["base"]["VmRSS"], "base_hwm": r["base"]["VmHWM"],
                     "hwm": r["end"]["VmHWM"], "rss": r["end"]["VmRSS"],
                     "added_peak": added, "added_rss": r["end"]["VmRSS"] - r["base"]["VmRSS"],
                     "limit": limit, "met": added <= limit,
                     "verified": r.get("verified", True)}
    out["other_subscriber"] = {"hwm": res[2]["end"]["VmHWM"],
                               "added_peak": res[2]["end"]["VmHWM"] - res[2]["base"]["VmRSS"]}
    return out


# 5. Fan-out -------------------------------------------------------------------------------------
FANOUT_CASES = {  # as benchmarks/torchrl_baseline.py's CASES: (leaves, float32 elements each)
    "leaves1000_4MiB": (1000, 1048),
    "leaf1_64MiB": (1, 16 * 1024 * 1024),
}
FANOUT_WORKERS = 4


def fanout_td(case: str):
    import torch
    from tensordict_cpp import TensorDict

    n, numel = FANOUT_CASES[case]
    return TensorDict({f"p{i:04d}": torch.zeros(numel) for i in range(n)}, batch_size=[])


def fanout_rank(rank: int, world: int, store, cfg: dict) -> dict:
    from tensordict_cpp import Publisher, Subscriber

    case, reps = cfg["case"], cfg["fanout_warmup"] + cfg["fanout_reps"]
    td = fanout_td(case)
    leaves = list(td.values())
    if rank == 0:
        pub = Publisher(max_slots=2)
        all_ms, publish_ms, per_worker, verified = [], [], [], True
        for rep in range(1, reps + 1):
            for leaf in leaves:  # untimed, as the torchrl baseline stamps its leaves
                leaf[0] = rep
            end = time.monotonic() + 30
            while not all(s["waiting"] for s in pub.stats()):  # every worker is in pull()
                if time.monotonic() > end:
                    raise RuntimeError(f"workers not waiting: {pub.stats()}")
                time.sleep(0.0005)
            t0 = time.monotonic()
            pub.publish(td)
            t1 = time.monotonic()
            got = [json.loads(store.get(f"r{rep}_{w}")) for w in range(1, world)]
            verified &= all(g["first"] == rep and g["last"] == rep for g in got)
            if rep > cfg["fanout_warmup"]:
                all_ms.append(max(g["t"] for g in got) - t0)
                publish_ms.append(t1 - t0)
                per_worker.append([g["t"] - t0 for g in got])
        pub.close()
        return {"case": case, "all_workers": stats_ms(all_ms), "publish": stats_ms(publish_ms),
                "per_worker_median_ms": [statistics.median(w[i] for w in per_worker) * 1e3
                                         for i in range(world - 1)],
                "verified": bool(verified)}
    sub = Subscriber(src=0)
    for rep in range(1, reps + 1):
        v = sub.pull(td, timeout=60)
        t = time.monotonic()
        store.set(f"r{rep}_{rank}", json.dumps({"t": t, "v": v, "first": float(leaves[0][0]),
                                                "last": float(leaves[-1][0])}))
    return {}


def torchrl_baseline(cfg: dict, *args: str) -> dict:
    """benchmarks/torchrl_baseline.py with ``args`` in a process of its own, on the peer stack
    (the hook: anything missing is reported, not raised)."""
    if not TORCHRL_BASELINE.is_file():
        return {"status": "missing: benchmarks/torchrl_baseline.py"}
    if not (PEER_STACK / "torchrl").is_dir():
        return {"status": f"missing: {PEER_STACK} (run scripts/peers)"}
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(PEER_STACK), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(TORCHRL_BASELINE), "--reps", str(cfg["torchrl_reps"]),
           "--warmup", str(cfg["torchrl_warmup"]), *args]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        return {"status": "timed out"}
    cases = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            if "case" in obj:
                cases[obj["case"]] = obj
    if not cases:
        return {"status": f"failed (rc {out.returncode}): {out.stderr[-1000:]}"}
    return {"status": "ok", "cases": cases}


def run_torchrl_stall(cfg: dict) -> dict:
    """The stall scenario with torchrl's scheme as shipped: one of its 4 workers SIGSTOPped,
    how long the trainer's send() blocks (benchmarks/torchrl_baseline.py --stall)."""
    return torchrl_baseline(dict(cfg, torchrl_reps=1, torchrl_warmup=1), "--stall", "--case",
                            "leaves1000_4MiB", "--stall-cap", str(cfg["torchrl_stall_cap"]))


def run_fanout(cfg: dict) -> dict:
    ours = {case: launch("fanout", 1 + FANOUT_WORKERS, dict(cfg, case=case), timeout=180)[0]
            for case in FANOUT_CASES}
    return {"ours": ours, "torchrl": torchrl_baseline(cfg)}


SCENARIOS = {"torn": torn_rank, "stall": stall_rank, "speed": speed_rank,
             "memory": memory_rank, "fanout": fanout_rank}


# ---- the run ----------------------------------------------------------------------------------
def measure(quick: bool) -> dict:
    cfg = config(quick)
    t0 = time.monotonic()
    result: dict = {"quick": quick, "config": cfg}

    def step(name, fn, *args):
        t = time.monotonic()
        print(f"publication_bench: {name} ...", file=sys.stderr, flush=True)
        out = fn(*args)
        print(f"publication_bench: {name}: {time.monotonic() - t:.0f} s", file=sys.stderr,
              flush=True)
        return out

    result["torn"] = step("torn reads", run_torn, cfg)
    result["stalls"] = {human(case[0]): {mode: step(f"stalls, {human(case[0])}, {mode}",
                                                    run_stall, cfg, case, mode)
                                         for mode in case[3]}
                        for case in cfg["stall_cases"]}
    result["torchrl_stall"] = step("stalls, torchrl's scheme, stopped", run_torchrl_stall, cfg)
    result["speed"] = step("speed", run_speed, cfg)
    result["memory"] = step("memory", run_memory, cfg)
    result["fanout"] = step("fan-out", run_fanout, cfg)
    result["seconds"] = time.monotonic() - t0
    return result


def torchrl_stall_words(trl: dict) -> str:
    """The torchrl stall scenario's result as a sentence."""
    if trl.get("status") != "ok":
        return f"torchrl's scheme with a stopped worker: {trl.get('status', 'not run')}."
    (x,) = trl["cases"].values()
    if x.get("error"):
        return f"torchrl's scheme with a stopped worker: {x['error']}."
    early = ", ".join(f"rank {r} after {v:.0f} ms"
                      for r, v in x["workers_updated_while_stopped_ms"].items()) or "none"
    late = ", ".join(f"rank {r} after {v:.0f} ms"
                     for r, v in x["workers_updated_after_SIGCONT_ms"].items()) or "none"
    where = x["blocked_in"][0] if x.get("blocked_in") else "?"
    return (f"torchrl 0.14.1's `DistributedWeightSyncScheme` (as shipped, tensordict 0.14.3), "
            f"with a stopped worker: a {x['leaves']}-leaf {x['bytes'] / MiB:.0f} MiB policy to 4 "
            f"workers, "
            f"rank {x['stopped_rank']} SIGSTOPped before `send()`: **send() {x['send_blocked']}"
            f"** (in `{where}`); workers updated while it was stopped (from send()'s start): {early}; "
            f"after SIGCONT: "
            f"{late}; {x['after_SIGCONT']}. It serves its workers one after another and waits "
            f"for each one's acknowledgement, so one stopped worker blocks the trainer and "
            f"every worker after it for as long as it stays stopped.")


def goals(result: dict) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for every goal."""
    out = []
    t = result["torn"]
    out.append(("torn reads: 0 (and versions strictly increasing)",
                f"{t['torn']} torn, {t['not_increasing']} not increasing in {t['pulls']:,} pulls",
                t["torn"] == 0 and t["not_increasing"] == 0 and t["pulls"] > 0))
    for size, s in result["stalls"].items():
        h = s["healthy"]
        for mode, x in s.items():
            if mode == "healthy":
                continue
            r = x["publish"]["p99_ms"] / h["publish"]["p99_ms"]
            out.append((f"{size}: publish() p99, one subscriber {mode} mid-pull / healthy "
                        "(<= 1.2)", f"{r:.2f}", r <= 1.2))
            r = x["delivery"]["median_ms"] / h["delivery"]["median_ms"]
            out.append((f"{size}: healthy subscribers' pull p50, one {mode} / healthy (<= 1.2)",
                        f"{r:.2f}", r <= 1.2))
    for case, v in result["speed"].items():
        for pull, recv, words in (("pull", "recv", "recv(consolidated)"),
                                  ("pipe pull", "pipe recv", "the pipe's recv")):
            r = v[recv]["median_ms"] / v[pull]["median_ms"]
            bound = v[recv]["median_ms"] / (v[recv]["median_ms"] + v["memcpy"]["median_ms"])
            out.append((f"{human(v['bytes'])}, {case}: {pull} / {words} throughput (>= 0.8; "
                        f"one-copy bound {bound:.2f})", f"{r:.2f}", r >= 0.8))
    m = result["memory"]
    for name in ("publisher", "subscriber"):
        out.append((f"{name} peak RSS <= base + {limit_words(name, m)}",
                    f"+{m[name]['added_peak'] / MiB:.0f} MiB (limit +{m[name]['limit'] / MiB:.0f})",
                    m[name]["met"]))
    trl = result["fanout"]["torchrl"]
    for case, want, words in (("leaves1000_4MiB", 20, ">= 20x faster"),
                              ("leaf1_64MiB", 1, "no slower")):
        ours = result["fanout"]["ours"][case]["all_workers"]["median_ms"]
        got = trl["cases"].get(case, {}) if trl.get("status") == "ok" else {}
        if "all_workers_ms" in got:
            r = trl["cases"][case]["all_workers_ms"]["median"] / ours
            out.append((f"fan-out {case}: torchrl / ours ({words})", f"{r:.1f}x", r >= want))
        else:
            out.append((f"fan-out {case}: torchrl / ours ({words})",
                        f"no baseline ({trl.get('status')})", False))
    return out


def victim_words(x: dict) -> str:
    """What happened to the stopped / killed subscriber, from the publisher's stats()."""
    if x["mode"] == "healthy":
        return "pulls like the others"
    ev = x["event"]
    if ev.get("missed"):
        return "**not caught mid-pull**"
    after = ev["after_100ms"]
    held = (f"100 ms later it still pinned v{after['pinned']}" if after["pinned"] is not None
            else f"100 ms later its pull of v{ev['pinned']} had left the publisher whole "
                 "(the kernel's socket buffers hold it), the slot free")
    words = f"{'SIGSTOP' if x['mode'] == 'stopped' else 'SIGKILL'} while it pinned " \
            f"v{ev['pinned']}; {held}"
    row = next((r for r in x["stats_final"] if r["rank"] == VICTIM), {})
    if x["mode"] == "stopped":
        v = x["victim"]
        return words + (f"; after SIGCONT it pulled up to v{v['last']} ({v['bad']} bad), "
                        "exit 0" if v["exit_code"] == 0 else f"; exit {v['exit_code']}")
    return words + (f"; at the end stats() says lost={row.get('lost')}, pinned="
                    f"{row.get('pinned')}")


def limit_words(name: str, m: dict) -> str:
    if name == "publisher":
        return f"its TensorDict + {m['max_slots']} slots + 32 MiB"
    return "its TensorDict + its buffer (2 x bytes) + 32 MiB"


def human(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / 1024:g} KiB"


def ms(x: float) -> str:
    return f"{x:,.1f} ms" if x >= 10 else f"{x:,.2f} ms" if x >= 0.1 else f"{x * 1e3:,.0f} µs"


def mbps(nbytes: int, t_ms: float) -> str:
    return f"{nbytes / MiB / (t_ms / 1e3):,.0f}"


def section(result: dict) -> str:
    """The Markdown section "## Publication": how it measures, the tables, the goals."""
    cfg = result["config"]
    t = result["torn"]
    torn = ("| subscribers | pulls | torn | not increasing | pull timeouts | distinct versions "
            "seen | versions published | pulls / s (all) |\n|--:|--:|--:|--:|--:|--:|--:|--:|\n"
            f"| {t['subscribers']} | {t['pulls']:,} | {t['torn']} | {t['not_increasing']} | "
            f"{t['timeouts']} | {t['distinct_versions']:,} | {t['published']:,} | "
            f"{t['pulls_per_s']:,.0f} |")
    rows = ["| TensorDict, period | scenario | publish() p50 | publish() p99 | healthy pull p50 "
            "(delivery) | healthy pull p99 | p99 / healthy | pull p50 / healthy | the victim "
            "(rank 3) |", "|---|---|--:|--:|--:|--:|--:|--:|---|"]
    for size, scen in result["stalls"].items():
        h = scen["healthy"]
        for mode, x in scen.items():
            ratio = ("|" if mode == "healthy" else
                     f"{x['publish']['p99_ms'] / h['publish']['p99_ms']:.2f} | "
                     f"{x['delivery']['median_ms'] / h['delivery']['median_ms']:.2f}")
            rows.append(f"| {size}, every {x['period_s'] * 1e3:g} ms | {mode} | "
                        f"{ms(x['publish']['median_ms'])} | {ms(x['publish']['p99_ms'])} | "
                        f"{ms(x['delivery']['median_ms'])} | {ms(x['delivery']['p99_ms'])} | "
                        f"{ratio} | {victim_words(x)} |")
    stalls = "\n".join(rows) + "\n\n" + torchrl_stall_words(result.get("torchrl_stall", {}))
    rows = ["| case | pull | our recv(consolidated=True) | raw dist.recv | memcpy (floor) | "
            "pull / recv | one-copy bound: recv / (recv + memcpy) | pull / raw | data |",
            "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for case, v in result["speed"].items():
        b = v["bytes"]
        p, r, w, c = (v[a]["median_ms"] for a in ("pull", "recv", "raw", "memcpy"))
        rows.append(f"| {human(b)}, {case} | {mbps(b, p)} MB/s ({ms(p)}) | {mbps(b, r)} MB/s "
                    f"({ms(r)}) | {mbps(b, w)} MB/s ({ms(w)}) | {ms(c)} | {r / p:.2f} | "
                    f"{r / (r + c):.2f} | {w / p:.2f} | "
                    f"{'ok' if v['verified'] else '**FAILED**'} |")
    rows += ["", "| case, over the pipe | pull | the pipe's recv | memcpy (floor) | pull / recv | "
             "one-copy bound: recv / (recv + memcpy) | data |", "|---|--:|--:|--:|--:|--:|---|"]
    for case, v in result["speed"].items():
        b = v["bytes"]
        p, r, c = (v[a]["median_ms"] for a in ("pipe pull", "pipe recv", "memcpy"))
        rows.append(f"| {human(b)}, {case} | {mbps(b, p)} MB/s ({ms(p)}) | {mbps(b, r)} MB/s "
                    f"({ms(r)}) | {ms(c)} | {r / p:.2f} | {r / (r + c):.2f} | "
                    f"{'ok' if v['verified'] else '**FAILED**'} |")
    speed = "\n".join(rows)
    m = result["memory"]
    rows = ["| process | base VmRSS | peak VmHWM | VmRSS at the end | added (peak - base) | "
            "limit | met |", "|---|--:|--:|--:|--:|--:|---|"]
    for name in ("publisher", "subscriber"):
        x = m[name]
        rows.append(f"| {name} | {x['base_rss'] / MiB:,.0f} MiB | {x['hwm'] / MiB:,.0f} MiB | "
                    f"{x['rss'] / MiB:,.0f} MiB | {x['added_peak'] / MiB:,.0f} MiB | "
                    f"{x['limit'] / MiB:,.0f} MiB ({limit_words(name, m)}) | "
                    f"{'yes' if x['met'] else '**no**'} |")
    memory = "\n".join(rows)
    f = result["fanout"]
    trl = f["torchrl"]
    rows = ["| case | ours: all 4 workers hold it, p50 | p99 | ours: publish() p50 | "
            "torchrl: all 4 workers, p50 | p99 | torchrl: send() p50 | torchrl / ours | "
            "each worker's p50, ours / torchrl |", "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    for case, o in f["ours"].items():
        a = o["all_workers"]
        tc = trl.get("cases", {}).get(case) if trl.get("status") == "ok" else None
        if tc and "all_workers_ms" in tc:
            tw = tc["all_workers_ms"]
            theirs = (f"{ms(tw['median'])} | {ms(tw['p99'])} | {ms(tc['send_ms']['median'])} | "
                      f"{tw['median'] / a['median_ms']:.1f}x")
            each = " / ".join(", ".join(f"{x:.0f}" for x in xs) + " ms" for xs in (
                o["per_worker_median_ms"], tc.get("per_worker_ms_median", [])))
        else:
            theirs, each = f"{trl.get('status')} | | | ", ", ".join(
                f"{x:.0f}" for x in o["per_worker_median_ms"]) + " ms"
        rows.append(f"| {case} | {ms(a['median_ms'])} | {ms(a['p99_ms'])} | "
                    f"{ms(o['publish']['median_ms'])} | {theirs} | {each} |")
    fanout = "\n".join(rows)
    goal_rows = ["| goal | measured | met |", "|---|--:|---|"]
    goal_rows += [f"| {g} | {v} | {'yes' if ok else '**no**'} |" for g, v, ok in goals(result)]
    trl_note = ("torchrl 0.14.1's DistributedWeightSyncScheme(backend=\"gloo\", sync=True) on "
                "tensordict 0.14.3 (benchmarks/torchrl_baseline.py, in a process of its own; "
                "time to its workers' update_policy_weights_ hook, weights applied), "
                f"{cfg['torchrl_reps']} repetitions after {cfg['torchrl_warmup']} warm-up"
                if trl.get("status") == "ok" else f"the torchrl baseline: {trl.get('status')}")
    return (
        "## Publication\n\n"
        "`benchmarks/publication_bench.py`: `tensordict_cpp.Publisher` / `Subscriber` "
        "(docs/publication.md), every rank a process of its own, Gloo over 127.0.0.1 with a "
        "TCPStore rendezvous, one intra-op thread each; the baselines ran in the same run. "
        f"Whole run: {result['seconds']:.0f} s.\n\n"
        "**Torn reads**: one publisher publishing back to back a TensorDict of 6 leaves "
        "(3 levels, 6 dtypes, 64 KiB) whose every element holds the version number, 3 "
        "subscribers each calling `sub.pull(td, timeout=5)` in a loop and checking after every "
        "pull that every leaf is constant and equal to the version returned, and that versions "
        "strictly increase.\n\n" + torn + "\n\n"
        "**Stalls**: a TensorDict (4 leaves) published at a steady rate (max_slots=2) to 3 "
        "subscribers pulling continuously (`pull(td, timeout=2)`, each pull checked). After a "
        "fifth of the publishes the publisher watches `stats()` until rank 3 pins a slot (it "
        "is receiving a version), then SIGSTOPs it (left stopped to the end, then SIGCONT: it "
        "must finish) or SIGKILLs it; each scenario is a launch of its own, and the survivors "
        "finish without a barrier (keys in the TCPStore). Figures cover the publishes after "
        "that point; a healthy subscriber's pull time is delivery: from publish()'s return to "
        "its pull()'s return (CLOCK_MONOTONIC, which the processes share). 16 MiB is "
        "published every 50 ms: every 20 ms, three 16 MiB pulls at once do not keep up on 2 "
        "cores." + (" 64 MiB is more than loopback TCP buffers take (tcp_rmem's maximum is 32 "
                    "MiB here; a stopped subscriber's 16 MiB can land whole in its kernel), so "
                    "there the stopped subscriber pins its slot to the end."
                    if "64 MiB" in result["stalls"] else "") + "\n\n" + stalls + "\n\n"
        "**Speed**: two processes, alternating arms in a new order each round, medians of "
        f"{cfg['speed_rounds']} rounds after a warm-up. pull: the version already published "
        "(a control message says so), `sub.pull(td)` timed (request, offer, data, copy into "
        "td); recv: the receiver's go message, then `td.recv(src=0, consolidated=True)` "
        "(sender `td.send(1, consolidated=True)`, both TensorDicts consolidated); raw: the go "
        "message, then one `dist.recv` of a uint8 tensor of the same bytes. memcpy: `copy_` "
        "of the bytes into a warm buffer in the receiver (a floor: pull copies once from its "
        "buffer into td, so a pull that lands as fast as recv takes recv + memcpy: the bound "
        "column). Over the pipe (UCX's choice of transports, the version published by a "
        "TensorDictServer's Publisher): pull as above; the pipe's recv: the go message, then "
        "`pipe.recv(td)` into its previous result (sender `pipe.send(td)`, consolidated, the "
        "same schema: the storage alone). MB/s are MiB/s.\n\n" + speed + "\n\n"
        f"**Memory**: a {human(m['bytes'])} TensorDict (4 leaves), max_slots={m['max_slots']}, "
        f"publisher and {m['subscribers']} subscribers, 3 versions published and pulled; base: "
        "VmRSS after importing torch and tensordict_cpp and joining the group, before the "
        "TensorDict; peak: VmHWM at the end (/proc/self/status). The other subscriber's peak "
        f"added {m['other_subscriber']['added_peak'] / MiB:,.0f} MiB.\n\n" + memory + "\n\n"
        f"**Fan-out**: a trainer and {FANOUT_WORKERS} workers, each waiting in `sub.pull(td)` "
        "(the publisher's `stats()` shows all 4 waiting before each publish): from `publish()`'s "
        "start to the last worker's `pull()` return, on CLOCK_MONOTONIC; "
        f"{cfg['fanout_reps']} repetitions after {cfg['fanout_warmup']} warm-up, every leaf's "
        f"element 0 stamped and checked. Beside it {trl_note}.\n\n" + fanout + "\n\n"
        + "\n".join(goal_rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(args)
    result = measure(args.quick)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    print(section(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
