"""torchrl collectors: ``collector.update_policy_weights_()`` under each weight-sync scheme, side
by side in one run, as a user of torchrl 0.14.1 meets it.

Needs the peer stack (scripts/peers installs it into .peers/td014) on PYTHONPATH before our
build's python/ (torchrl 0.14.1 imports tensordict 0.14.3 there, not the .venv's 0.15.3):

    PYTHONPATH=.peers/td014:build/python .venv/bin/python benchmarks/torchrl_collector_bench.py \
        [--quick] [--reps N] [--policy NAME ...] [--scheme NAME ...]

Prints one JSON line per (policy, scheme) on stdout.

Each case is a process of its own (its own session; the launcher kills its process group at the
end, whatever happened): a ``MultiSyncCollector`` over 4 ``ContinuousActionVecMockEnv`` workers
(spawned), ``frames_per_batch`` 8, ``total_frames=-1``, with

* ``default``: no ``weight_sync_schemes`` (torchrl then uses ``SharedMemWeightSyncScheme``: the
  workers' policies are one shared buffer the trainer overwrites in place, then each worker's
  thread applies it and acknowledges through a queue);
* ``multiprocess``: ``MultiProcessWeightSyncScheme()`` (the weights put on an mp.Queue per
  worker: torch's reductions move their storages into shared memory and pickle handles; each
  worker's thread copies them into its policy and acknowledges);
* ``tensordict_cpp``: ``tensordict_cpp.torchrl.TensorDictCppWeightSyncScheme()`` (one publish,
  the workers' threads pull it; python/tensordict_cpp/torchrl.py).

Policies (``TensorDictModule`` on "observation" -> "action", 7 -> 7):

* ``mlp_64MiB``: ``Linear(7,4096)-Tanh-Linear(4096,4096)-Tanh-Linear(4096,7)`` (6 leaves);
* ``linear300_1MiB``: 300 ``Linear(32,32)`` (600 leaves, 1.2 MiB) as residual tanh blocks
  (the observation zero-padded to 32, the first 7 outputs the action), so that every layer
  moves the action.

Timed: ``update_policy_weights_()`` (all defaults: the trainer's policy, every worker, each
scheme's own sync), after warm-up updates. Between two updates (untimed) the trainer changes
its weights in place and takes one batch, checking that the batch's actions are its policy's
on the batch's observations: each update reached every worker before the next batch.
Reported: median, p25/p75 (nearest rank) and max of the updates, in ms.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

NUM_WORKERS = 4
FRAMES_PER_BATCH = 8
POLICIES = ("mlp_64MiB", "linear300_1MiB")
SCHEMES = ("default", "multiprocess", "tensordict_cpp")

try:  # a class the spawned workers can unpickle: this file is their __mp_main__
    import torch
    from torch import nn

    class Residual300(nn.Module):
        """300 Linear(32, 32), each a residual tanh block."""

        def __init__(self, layers: int = 300, width: int = 32) -> None:
            super().__init__()
            self.width = width
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            x = nn.functional.pad(obs, (0, self.width - obs.shape[-1]))
            for layer in self.layers:
                x = x + 0.05 * torch.tanh(layer(x))
            return x[..., :obs.shape[-1]]
except ImportError:  # pragma: no cover - the launcher needs no torch
    pass


def make_policy(name: str):
    from tensordict.nn import TensorDictModule

    torch.manual_seed(0)
    if name == "mlp_64MiB":
        net = nn.Sequential(nn.Linear(7, 4096), nn.Tanh(), nn.Linear(4096, 4096), nn.Tanh(),
                            nn.Linear(4096, 7))
    else:
        net = Residual300()
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])


def make_scheme(name: str, timeout: float):
    if name == "default":
        return None
    if name == "multiprocess":
        from torchrl.weight_update import MultiProcessWeightSyncScheme

        return MultiProcessWeightSyncScheme()
    from tensordict_cpp.torchrl import TensorDictCppWeightSyncScheme

    return TensorDictCppWeightSyncScheme(timeout=timeout, connect_timeout=timeout)


def pctl(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def case_main(args) -> int:
    def fire():
        emit({"policy": args.policy, "scheme": args.scheme, "error": "watchdog"})
        os._exit(3)

    watchdog = threading.Timer(args.deadline, fire)
    watchdog.daemon = True
    watchdog.start()
    import tensordict
    import torchrl
    from torchrl.collectors import MultiSyncCollector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    torch.set_num_threads(1)
    base = {"policy": args.policy, "scheme": args.scheme, "workers": NUM_WORKERS,
            "versions": {"torchrl": torchrl.__version__, "tensordict": tensordict.__version__,
                         "torch": torch.__version__}}
    policy = make_policy(args.policy)
    params = list(policy.parameters())
    base["leaves"] = len(params)
    base["bytes"] = sum(p.numel() * p.element_size() for p in params)
    scheme = make_scheme(args.scheme, args.deadline)
    kwargs = {} if scheme is None else {"weight_sync_schemes": {"policy": scheme}}
    t0 = time.perf_counter()
    collector = MultiSyncCollector([ContinuousActionVecMockEnv] * NUM_WORKERS, policy,
                                   frames_per_batch=FRAMES_PER_BATCH, total_frames=-1, **kwargs)
    it = iter(collector)
    next(it)
    base["setup_s"] = round(time.perf_counter() - t0, 2)
    base["scheme_class"] = type(collector._weight_sync_schemes["policy"]).__name__
    errors, times = [], []
    try:
        for rep in range(args.warmup + args.reps):
            with torch.no_grad():  # a new version: every weight moves
                for p in params:
                    p.mul_(-1.0 if rep % 2 else 1.0).add_(1e-3)
            t = time.perf_counter()
            collector.update_policy_weights_()
            dt = time.perf_counter() - t
            batch = next(it)
            with torch.no_grad():
                expected = policy.module(batch["observation"])
            errors.append((batch["action"] - expected).abs().max().item())
            if rep >= args.warmup:
                times.append(dt * 1e3)
        emit(dict(base, reps=len(times), warmup=args.warmup,
                  median_ms=round(statistics.median(times), 3),
                  p25_ms=round(pctl(times, 0.25), 3), p75_ms=round(pctl(times, 0.75), 3),
                  max_ms=round(max(times), 3), samples_ms=[round(x, 3) for x in times],
                  max_action_error=max(errors), verified=max(errors) < 1e-4))
    finally:
        collector.shutdown()
        if scheme is not None and hasattr(scheme, "shutdown"):
            scheme.shutdown()
    sys.stdout.flush()
    os._exit(0)


def run_case(args, policy: str, scheme: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_case", "--policy", policy, "--scheme",
           scheme, "--reps", str(args.reps), "--warmup", str(args.warmup), "--deadline",
           str(args.deadline)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore:resource_tracker:UserWarning")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    t0 = time.perf_counter()
    out = {"policy": policy, "scheme": scheme, "error": "no result"}
    try:
        stdout, stderr = proc.communicate(timeout=args.deadline + 30)
        for line in stdout.splitlines():
            if line.startswith("{"):
                out = json.loads(line)
        if "error" in out:
            out["stderr"] = stderr[-2000:]
    except subprocess.TimeoutExpired:
        out = {"policy": policy, "scheme": scheme, "error": "timed out"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the case, its workers, its resource tracker
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def measure(reps: int, warmup: int, policies=POLICIES, schemes=SCHEMES,
            deadline: float = 240.0) -> list[dict]:
    args = argparse.Namespace(reps=reps, warmup=warmup, deadline=deadline)
    results = []
    for policy in policies:
        for scheme in schemes:
            print(f"torchrl_collector_bench: {policy}, {scheme} ...", file=sys.stderr,
                  flush=True)
            results.append(run_case(args, policy, scheme))
    return results


# ---- benchmarks/run -----------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_STACK = os.path.join(ROOT, ".peers", "td014")
LABELS = {"default": "torchrl's default (SharedMemWeightSyncScheme)",
          "multiprocess": "MultiProcessWeightSyncScheme",
          "tensordict_cpp": "ours (TensorDictCppWeightSyncScheme)"}
# Issue 52's goals for ours against torchrl's default: policy -> (words, measure, met).
GOALS = {"mlp_64MiB": ("ours / default <= 1.5", lambda o, d: f"{o / d:.2f}",
                       lambda o, d: o / d <= 1.5),
         "linear300_1MiB": ("default / ours >= 5 (5x faster)", lambda o, d: f"{d / o:.1f}x",
                            lambda o, d: d / o >= 5)}


def memcpy_ms(nbytes: int, reps: int = 8) -> float:
    """Median time of one copy of `nbytes` between two buffers already touched: the floor of a
    publication that is never torn (it copies each version once; torchrl's default copies
    nothing, its workers reading the trainer's own buffer as it changes)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def run(quick: bool) -> dict:
    """Every case on the peer stack, for benchmarks/run (bench.py): anything missing is
    reported, not raised. --quick: the 600-leaf policy, torchrl's default and ours, 2 updates."""
    if not os.path.isdir(os.path.join(PEER_STACK, "torchrl")):
        return {"status": f"missing: {PEER_STACK} (run scripts/peers)"}
    import tensordict_cpp  # where this process imports ours from, for the cases' path

    # The package's directory, not resolved: in a build tree its .py files are links into
    # python/tensordict_cpp, beside the built _C.
    ours = os.path.dirname(os.path.abspath(tensordict_cpp.__path__[0]))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [PEER_STACK, ours] + ([saved] if saved else []))
    t0 = time.monotonic()
    try:
        if quick:
            results = measure(2, 1, ("linear300_1MiB",), ("default", "tensordict_cpp"))
        else:
            results = measure(8, 2)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    floor = {c["policy"]: memcpy_ms(c["bytes"]) for c in results
             if c.get("scheme") == "default" and "bytes" in c}
    return {"status": "ok", "quick": quick, "cases": results, "memcpy_ms": floor,
            "seconds": round(time.monotonic() - t0, 1)}


def goals(result: dict) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for each policy measured with torchrl's default and ours."""
    out = []
    got = {(c["policy"], c["scheme"]): c for c in result.get("cases", [])}
    for policy, (words, measured, met) in GOALS.items():
        d, o = got.get((policy, "default")), got.get((policy, "tensordict_cpp"))
        if not d or not o:
            continue  # not run (--quick)
        if "median_ms" not in d or "median_ms" not in o:
            out.append((f"{policy}: {words}", "no result", False))
            continue
        d, o, ok = d["median_ms"], o["median_ms"], bool(o.get("verified"))
        out.append((f"{policy}: {words}", measured(o, d), ok and met(o, d)))
    return out


def section(result: dict) -> str:
    """The Markdown section "## torchrl collectors": how it measures, the table, the goals."""
    head = "## torchrl collectors\n\n"
    if result.get("status") != "ok":
        return head + f"Not run: {result.get('status')}."
    cases = result["cases"]
    got = {(c["policy"], c["scheme"]): c for c in cases}
    policies = [p for p in POLICIES if any(k[0] == p for k in got)]
    schemes = [s for s in SCHEMES if any(k[1] == s for k in got)]

    def cell(c):
        if c is None:
            return "not run"
        if "median_ms" not in c:
            return f"**{c.get('error', 'no result')}**"
        flag = "" if c.get("verified") else " **wrong actions**"
        return f"{c['median_ms']:,.1f} ms ({c['p25_ms']:,.1f}-{c['p75_ms']:,.1f}){flag}"

    rows = ["| policy | " + " | ".join(LABELS[s] for s in schemes) + " | ours / default |",
            "|---|" + "--:|" * (len(schemes) + 1)]
    for policy in policies:
        c = [got.get((policy, s)) for s in schemes]
        d, o = got.get((policy, "default"), {}), got.get((policy, "tensordict_cpp"), {})
        ratio = (f"{o['median_ms'] / d['median_ms']:.2f}" if "median_ms" in d and
                 "median_ms" in o else "")
        some = next((x for x in c if x and "leaves" in x), {})
        name = (f"{policy} ({some['leaves']} leaves, {some['bytes'] / (1 << 20):.1f} MiB)"
                if some else policy)
        rows.append(f"| {name} | " + " | ".join(cell(x) for x in c) + f" | {ratio} |")
    goal_rows = ["| goal (issue 52) | measured | met |", "|---|--:|---|"]
    goal_rows += [f"| {g} | {v} | {'yes' if ok else '**no**'} |" for g, v, ok in goals(result)]
    goal_rows += [f"| floor: one memcpy of {p}'s bytes, this run | {ms:.1f} ms |  |"
                  for p, ms in result.get("memcpy_ms", {}).items()]
    reps = next((c["reps"] for c in cases if "reps" in c), 0)
    warmup = next((c["warmup"] for c in cases if "warmup" in c), 0)
    return (head + "`benchmarks/torchrl_collector_bench.py`: torchrl 0.14.1 (tensordict 0.14.3, "
            f"the peer stack) `MultiSyncCollector` over {NUM_WORKERS} spawned "
            "`ContinuousActionVecMockEnv` workers; `collector.update_policy_weights_()` timed, "
            f"median (p25-p75) of {reps} updates after {warmup} warm-up, each case a process "
            "of its own, one after another in this run. Between two updates (untimed) the "
            "trainer changes its weights in place and takes a batch, whose actions must be its "
            "policy's. mlp_64MiB: `Linear(7,4096)-Tanh-Linear(4096,4096)-Tanh-Linear(4096,7)`; "
            "linear300_1MiB: 300 `Linear(32,32)`. "
            f"Whole section: {result['seconds']:.0f} s.\n\n" + "\n".join(rows) + "\n\n"
            + "\n".join(goal_rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8, help="timed updates per case")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 updates, 1 warm-up")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="default: both")
    ap.add_argument("--scheme", action="append", choices=SCHEMES, help="default: all")
    ap.add_argument("--deadline", type=float, default=240.0, help="per case, seconds")
    ap.add_argument("--_case", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._case:
        args.policy, args.scheme = args.policy[0], args.scheme[0]
        return case_main(args)
    if args.quick:
        args.reps, args.warmup = 3, 1
    results = measure(args.reps, args.warmup, args.policy or POLICIES, args.scheme or SCHEMES,
                      args.deadline)
    for r in results:
        emit(r)
    for r in results:
        if r.get("scheme") == "default" and "bytes" in r:
            emit({"policy": r["policy"], "scheme": "memcpy", "median_ms": memcpy_ms(r["bytes"])})
    return 0 if all(r.get("verified") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
