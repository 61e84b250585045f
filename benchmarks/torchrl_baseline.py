"""Baseline: torchrl 0.14.1's DistributedWeightSyncScheme, as shipped, on tensordict 0.14.3.

Needs the peer stack (scripts/peers installs it into .peers/td014) and is run with it on
PYTHONPATH, so that torchrl 0.14.1 imports tensordict 0.14.3 and not the .venv's 0.15.3:

    PYTHONPATH=$(scripts/peers) .venv/bin/python benchmarks/torchrl_baseline.py [--quick]
    PYTHONPATH=$(scripts/peers) .venv/bin/python benchmarks/torchrl_baseline.py --stall

Prints one JSON line per case (and per stall case) on stdout.

Topology: this launcher starts 1 trainer process (its own session / process group); the
trainer starts 4 worker processes (multiprocessing "spawn"), exactly as torchrl's
DistributedCollector(launcher="mp") does. World of 5 Gloo ranks over 127.0.0.1 (rank 0 =
trainer, ranks 1..4 = workers; MASTER_ADDR=127.0.0.1, env:// rendezvous).

What is driven, and how (no collector; the same calls DistributedCollector / its
_run_collector make, and only those):
  trainer: scheme = DistributedWeightSyncScheme(backend="gloo", sync=True)   # defaults
           scheme.init_on_sender(model_id="policy", context=ctx, num_workers=4)
               (ctx: a plain object with .policy, as the collector is; creates the scheme's
               TCPStore master on gethostbyname(gethostname()) = 127.0.0.1, a free port)
           start the 4 worker processes, the scheme object pickled into their arguments
               (its __getstate__ drops the TCPStore and transports, keeps _store_info)
           scheme.connect()   # init_process_group(rank 0, world 5) + initial weights
           timed: scheme.send()  # weights=None -> extracted from ctx.policy each time
  worker:  scheme.init_on_receiver(model_id="policy", context=wctx, worker_idx=rank)
           scheme.connect()   # init_process_group(rank), receive initial weights, start
                              # the scheme's background receiver thread
           then idles: the scheme's own background thread polls the store key
           NODE_<rank>_in, recv()s every leaf into the policy, applies it, calls
           wctx.update_policy_weights_(model_id=, policy_or_weights=) (the cascade hook a
           collector gets), then sets NODE_<rank>_out=b"updated" (the ack send() waits for).
The worker timestamp is taken in that update_policy_weights_ hook (weights received and
applied, ack not yet sent), with CLOCK_MONOTONIC, which all processes on a host share; the
trainer timestamps send() start and return on the same clock. Reported per case:
  send_ms            trainer: scheme.send() start -> return (returns after all 4 acks)
  all_workers_ms     send() start -> the last worker's hook (every worker holds the update)
  per_worker_ms      median of send() start -> that worker's hook, for ranks 1..4
median and p99 over N repetitions (p99 by nearest rank: with N < 100 it is the maximum),
after warm-up repetitions. Before each repetition the trainer writes the repetition number
into element 0 of every leaf (untimed); each worker reports element 0 of its first and last
leaf from the hook, and at the end a float64 sum of all its weights, which must equal the
trainer's.

--stall: after warm-up, worker --stall-worker (0-based; default 1 = rank 2) gets SIGSTOP,
then send() runs in a thread; the trainer waits up to --stall-cap seconds (10) for it to
return and reports how long it blocked ("blocked > 10 s" if it did not return), which
other workers got the update meanwhile, and where send() is stuck (innermost Python
frames of its thread); then SIGCONT, and how long send() took to finish
after that (capped likewise). Then everything is killed.

Every process has a deadline: workers and trainer arm a watchdog (os._exit), workers also
exit when their parent goes away, and the launcher kills the trainer's whole process group
(SIGKILL) at the end of each case, whatever happened.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

NUM_WORKERS = 4
CASES = {
    # name: (num_leaves, elements per leaf) float32
    "leaves1000_4MiB": (1000, 1048),
    "leaf1_64MiB": (1, 16 * 1024 * 1024),
}


def _now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _watchdog(seconds: float, what: str) -> None:
    def fire():
        sys.stderr.write(f"torchrl_baseline: {what} watchdog after {seconds:.0f} s\n")
        sys.stderr.flush()
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def _build_policy(case: str, fill: str):
    import torch
    from torch import nn

    n, numel = CASES[case]
    g = torch.Generator().manual_seed(1234)
    params = {}
    for i in range(n):
        t = torch.randn(numel, generator=g) if fill == "randn" else torch.zeros(numel)
        params[f"p{i:04d}"] = nn.Parameter(t, requires_grad=False)
    return nn.ParameterDict(params)


def _leaves(policy):
    return [policy[k] for k in sorted(policy.keys())]


def _checksum(policy) -> float:
    return float(sum(p.detach().double().sum().item() for p in policy.values()))


def _pctl(xs, q):
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))
    return s[k]


def _stats(xs):
    return {
        "median": round(statistics.median(xs), 3),
        "p99": round(_pctl(xs, 0.99), 3),
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
    }


# ----------------------------------------------------------------------------- worker
class _WorkerCtx:
    """Context handed to init_on_receiver: what the scheme resolves (.policy) and the
    cascade hook it calls after applying weights (update_policy_weights_)."""

    def __init__(self, policy, rank, results):
        self.policy = policy
        self.rank = rank
        self.results = results
        self.first, self.last = _leaves(policy)[0], _leaves(policy)[-1]

    def update_policy_weights_(self, model_id=None, policy_or_weights=None, **kw):
        t = _now_ns()
        self.results.put(
            ("hook", self.rank, t, float(self.first[0]), float(self.last[0]))
        )


def _worker_main(rank, case, scheme, results, done_evt, deadline_s, parent_pid):
    _watchdog(deadline_s, f"worker {rank}")
    import torch

    torch.set_num_threads(1)

    def parent_watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(4)
            time.sleep(0.5)

    threading.Thread(target=parent_watch, daemon=True).start()
    try:
        policy = _build_policy(case, fill="zeros")
        ctx = _WorkerCtx(policy, rank, results)
        scheme.init_on_receiver(model_id="policy", context=ctx, worker_idx=rank)
        scheme.connect()
        results.put(("ready", rank, _now_ns(), float(ctx.first[0]), float(ctx.last[0])))
        done_evt.wait(deadline_s)
        results.put(("checksum", rank, _checksum(policy), 0.0, 0.0))
        time.sleep(0.2)  # let the queue feeder thread flush
    except BaseException as e:  # report, then die
        results.put(("error", rank, repr(e), 0.0, 0.0))
        time.sleep(0.2)
    os._exit(0)


# ----------------------------------------------------------------------------- trainer
class _TrainerCtx:
    def __init__(self, policy):
        self.policy = policy


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_T0 = time.perf_counter()


def _dbg(msg: str) -> None:
    if os.environ.get("TORCHRL_BASELINE_DEBUG"):
        sys.stderr.write(f"[{time.perf_counter() - _T0:7.2f}s pid {os.getpid()}] {msg}\n")
        sys.stderr.flush()


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _trainer_main(args) -> int:
    _watchdog(args.deadline, "trainer")
    import queue as queue_mod

    import tensordict
    import torch
    import torch.multiprocessing as mp
    import torchrl
    from torchrl.weight_update import DistributedWeightSyncScheme

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    case = args.case
    n_leaves, numel = CASES[case]
    nbytes = n_leaves * numel * 4
    base = {
        "bench": "torchrl_baseline",
        "scheme": "torchrl.weight_update.DistributedWeightSyncScheme(backend='gloo', sync=True)",
        "versions": {
            "torchrl": torchrl.__version__,
            "tensordict": tensordict.__version__,
            "torch": torch.__version__,
        },
        "case": case,
        "leaves": n_leaves,
        "bytes": nbytes,
        "workers": NUM_WORKERS,
        "host": f"{socket.gethostname()} -> {socket.gethostbyname(socket.gethostname())}",
    }
    if tensordict.__version__ != "0.14.3" or torchrl.__version__ != "0.14.1":
        _emit({**base, "error": "wrong peer stack on PYTHONPATH (need scripts/peers)"})
        return 2

    policy = _build_policy(case, fill="randn")
    leaves = _leaves(policy)
    tctx = _TrainerCtx(policy)
    scheme = DistributedWeightSyncScheme(backend="gloo", sync=True)
    scheme.init_on_sender(model_id="policy", context=tctx, num_workers=NUM_WORKERS)

    mpctx = mp.get_context("spawn")
    results = mpctx.Queue()
    done_evt = mpctx.Event()
    procs = []
    for i in range(NUM_WORKERS):
        p = mpctx.Process(
            target=_worker_main,
            args=(i + 1, case, scheme, results, done_evt, args.deadline, os.getpid()),
            daemon=True,
        )
        p.start()
        procs.append(p)

    def get(timeout):
        msg = results.get(timeout=timeout)
        if msg[0] == "error":
            raise RuntimeError(f"worker {msg[1]}: {msg[2]}")
        return msg

    _dbg("workers started")
    t0 = time.perf_counter()
    scheme.connect()  # init_process_group + initial weights to every worker
    ready = {}
    while len(ready) < NUM_WORKERS:
        m = get(60)
        if m[0] == "ready":
            ready[m[1]] = m
    init_s = time.perf_counter() - t0
    _dbg(f"connected + ready in {init_s:.2f} s")
    init_ok = all(
        m[3] == float(leaves[0][0]) and m[4] == float(leaves[-1][0]) for m in ready.values()
    )

    def one_rep(rep):
        with torch.no_grad():
            for p in leaves:
                p.data[0] = float(rep)
        ts = _now_ns()
        scheme.send()
        te = _now_ns()
        hooks = {}
        while len(hooks) < NUM_WORKERS:
            m = get(60)
            if m[0] == "hook":
                hooks[m[1]] = m
        ok = all(m[3] == rep and m[4] == rep for m in hooks.values())
        per = [(hooks[r][2] - ts) / 1e6 for r in range(1, NUM_WORKERS + 1)]
        return (te - ts) / 1e6, per, ok

    rep = 0
    for _ in range(args.warmup):
        rep += 1
        one_rep(rep)

    out = dict(base)
    if not args.stall:
        send_ms, all_ms, per_ms, verified = [], [], [[] for _ in range(NUM_WORKERS)], init_ok
        for _ in range(args.reps):
            rep += 1
            s, per, ok = one_rep(rep)
            verified &= ok
            send_ms.append(s)
            all_ms.append(max(per))
            for i, x in enumerate(per):
                per_ms[i].append(x)
        # final check: every worker's weights equal the trainer's
        done_evt.set()
        sums = {}
        while len(sums) < NUM_WORKERS:
            m = get(60)
            if m[0] == "checksum":
                sums[m[1]] = m[2]
        mine = _checksum(policy)
        verified &= all(abs(v - mine) <= 1e-6 * max(1.0, abs(mine)) for v in sums.values())
        out.update(
            {
                "mode": "latency",
                "reps": args.reps,
                "warmup": args.warmup,
                "setup_s": round(init_s, 3),
                "send_ms": _stats(send_ms),
                "all_workers_ms": _stats(all_ms),
                "per_worker_ms_median": [round(statistics.median(x), 3) for x in per_ms],
                "GBps_all_workers_median": round(
                    NUM_WORKERS * nbytes / (statistics.median(all_ms) / 1e3) / 1e9, 3
                ),
                "clock_sane": all(0 < x <= s + 1e-3 for s, x in zip(send_ms, all_ms)),
                "verified": bool(verified),
            }
        )
    else:
        victim = procs[args.stall_worker]
        vrank = args.stall_worker + 1
        rep += 1
        with torch.no_grad():
            for p in leaves:
                p.data[0] = float(rep)
        os.kill(victim.pid, signal.SIGSTOP)
        time.sleep(0.2)
        finished = threading.Event()
        err = []

        def sender():
            try:
                scheme.send()
            except BaseException as e:  # noqa: BLE001
                err.append(repr(e))
            finished.set()

        ts = _now_ns()
        sender_thread = threading.Thread(target=sender, daemon=True)
        sender_thread.start()
        returned = finished.wait(args.stall_cap)
        t_block = (_now_ns() - ts) / 1e9
        blocked_in = None
        if not returned:  # where send() is stuck: innermost Python frames of its thread
            import traceback

            frame = sys._current_frames().get(sender_thread.ident)
            if frame is not None:
                blocked_in = [
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.name}: {f.line}"
                    for f in traceback.extract_stack(frame)[-3:]
                ]
        got = {}
        try:
            while True:
                m = results.get(timeout=0.2)
                if m[0] == "hook":
                    got[m[1]] = round((m[2] - ts) / 1e6, 3)
        except queue_mod.Empty:
            pass
        os.kill(victim.pid, signal.SIGCONT)
        tc = _now_ns()
        returned2 = returned or finished.wait(args.stall_cap)
        t_after = (_now_ns() - tc) / 1e9
        try:
            while True:
                m = results.get(timeout=0.5)
                if m[0] == "hook" and m[1] not in got:
                    got[m[1]] = ("after SIGCONT", round((m[2] - tc) / 1e6, 3))
        except queue_mod.Empty:
            pass
        out.update(
            {
                "mode": "stall",
                "stopped_rank": vrank,
                "cap_s": args.stall_cap,
                "send_blocked": (
                    f"returned after {t_block:.3f} s"
                    if returned
                    else f"blocked > {args.stall_cap:g} s"
                ),
                "blocked_in": blocked_in,
                "workers_updated_while_stopped_ms": {
                    str(k): v for k, v in sorted(got.items()) if not isinstance(v, tuple)
                },
                "after_SIGCONT": (
                    f"send() returned {t_after:.3f} s after SIGCONT"
                    if returned2 and not returned
                    else ("n/a" if returned else f"still blocked > {args.stall_cap:g} s")
                ),
                "workers_updated_after_SIGCONT_ms": {
                    str(k): v[1] for k, v in sorted(got.items()) if isinstance(v, tuple)
                },
                "send_error": err[0] if err else None,
            }
        )
    _emit(out)
    _dbg("emitted; teardown")
    # teardown: no destroy_process_group (can hang with a stalled peer); kill the workers
    done_evt.set()
    for p in procs:
        p.join(2)
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
            p.join(2)
    _dbg("workers joined")
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- launcher
def _run_case(args, case, stall) -> bool:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_trainer",
        "--case",
        case,
        "--reps",
        str(args.reps),
        "--warmup",
        str(args.warmup),
        "--deadline",
        str(args.deadline),
        "--stall-worker",
        str(args.stall_worker),
        "--stall-cap",
        str(args.stall_cap),
    ] + (["--stall"] if stall else [])
    env = dict(os.environ)
    # the os._exit teardown leaves the mp queues' semaphores to the resource tracker
    env["PYTHONWARNINGS"] = "ignore:resource_tracker:UserWarning"
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    ok = False
    t0 = time.perf_counter()
    try:
        out, _ = proc.communicate(timeout=args.deadline + 10)
        for line in out.splitlines():
            line = line.strip()
            if line.startswith("{"):
                obj = json.loads(line)
                obj["wall_s"] = round(time.perf_counter() - t0, 1)
                print(json.dumps(obj), flush=True)
                ok = "error" not in obj and obj.get("verified", True)
        if proc.returncode != 0:
            print(json.dumps({"case": case, "stall": stall,
                              "error": f"trainer rc {proc.returncode}"}), flush=True)
            ok = False
    except subprocess.TimeoutExpired:
        print(json.dumps({"case": case, "stall": stall, "error": "timeout"}), flush=True)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # trainer, its workers, resource tracker
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="3 repetitions, 1 warm-up")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    ap.add_argument("--stall", action="store_true", help="stall mode (SIGSTOP one worker)")
    ap.add_argument("--stall-worker", type=int, default=1, help="0-based worker to stop")
    ap.add_argument("--stall-cap", type=float, default=10.0)
    ap.add_argument("--deadline", type=float, default=120.0, help="per case, seconds")
    ap.add_argument("--_trainer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._trainer:
        args.case = args.case[0]
        return _trainer_main(args)
    import importlib.util

    if importlib.util.find_spec("torchrl") is None:
        print(json.dumps({"bench": "torchrl_baseline", "error": "torchrl not importable: "
                          "run with PYTHONPATH=$(scripts/peers)"}), flush=True)
        return 2
    if args.quick:
        args.reps, args.warmup = 3, 1
    ok = True
    for case in args.case or list(CASES):
        ok &= _run_case(args, case, args.stall)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
