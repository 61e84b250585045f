"""Publication across hosts made of network namespaces (scripts/hosts), paced like NICs.

One publisher on host 0 and a subscriber on each other host, over the default Gloo group. For
each route (`--route`: "star", whole to each subscriber from the publisher; "chain", relayed in
pieces; "tree", relayed in pieces along two trees) and each version of a `--mib` MiB TensorDict (4 leaves) it reports when the last
subscriber holds it, beside one paced point-to-point send of the same bytes measured in the same
run (a `torch.distributed.send` from host 0 to host 1), and the bytes host 0's interface sent per
byte of the version.

`--fault` plays a failing relay in version `--fault-version` of the relayed routes: the
subscriber on host 1 (the chain's first relay; with N even, the second tree's root) is SIGKILLed ("kill") or SIGSTOPped for 3 s ("stop") 40 % into
the version, or its host's egress is paced to a quarter of the rate from that version on
("slow"). The others' times in that version and the next are reported beside the healthy
versions' median.

    python benchmarks/hosts_bench.py --hosts 5 --mib 64 --rate 400mbit --versions 3
    python benchmarks/hosts_bench.py --hosts 5 --route chain --fault kill --versions 12

`--lang cpp` runs every rank as benchmarks/hosts_rank.cpp (build/hosts_rank, or
$TENSORDICT_BUILD_DIR/hosts_rank): the same steps through the C++ API, for the same figures
measured from C++.

Root only. It makes the hosts (scripts/hosts up) and removes them when it ends. The ranks meet
through a TCPStore on host 0, not the group's collectives: a killed rank would end those.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "scripts", "hosts")
FAULTY = 1  # the rank a fault plays on: the chain's first relay


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tensordict_cpp import Publisher, Subscriber, TensorDict

    rank, world = a._rank, 1 + (a.hosts - 1) * a.per_host
    # Subscribers go round the hosts (rank r on host 1 + (r - 1) % (hosts - 1)), so that a route
    # in rank order would cross hosts at every hop; the first of each host counts what the
    # host's interface received.
    counts_rx = 0 < rank < a.hosts
    dist.init_process_group("gloo", init_method=f"tcp://10.77.0.1:{a.port}", rank=rank,
                            world_size=world)
    store = dist.TCPStore("10.77.0.1", a.port + 1, world, rank == 0, timeout=__import__(
        "datetime").timedelta(seconds=600))

    def live(route: str, v: int) -> int:
        """How many ranks meet at version v of `route`: a killed rank is gone from then on."""
        gone = route != "star" and a.fault == "kill" and v >= a.fault_version
        return world - (1 if gone else 0)

    def meet(tag: str, count: int) -> None:
        store.add(tag, 1)
        while int(store.add(tag, 0)) < count:
            time.sleep(0.001)

    n = (a.mib << 20) // 4 // 4  # four float32 leaves
    td = TensorDict({f"w{i}": torch.zeros(n) for i in range(4)}, batch_size=[])
    out: dict = {"rank": rank}
    # The floor: one paced send of the same bytes, host 0 to host 1.
    flat = torch.zeros((a.mib << 20) // 4)
    dist.barrier()
    if rank == 0:
        t = time.time()
        dist.send(flat, 1)
        dist.recv(torch.zeros(1), 1)
        out["p2p_s"] = time.time() - t
        store.set("p2p", str(out["p2p_s"]))
    elif rank == 1:
        dist.recv(flat, 0)
        dist.send(torch.zeros(1), 0)
    dist.barrier()
    p2p = float(store.get("p2p"))

    for channel, route in enumerate(a.route.split(",")):
        faulty = route != "star" and a.fault != "none"
        if rank == 0:
            pub = Publisher(max_slots=2, channel=channel, transport="socket", route=route)
            starts, tx = [], []
            for v in range(1, a.versions + 1):
                for leaf in td.values():
                    leaf.fill_(v)
                if faulty and a.fault == "slow" and v == a.fault_version:
                    subprocess.run([HOSTS, "rate", str(FAULTY), a.slow_rate], check=True)
                before = int(open("/sys/class/net/eth0/statistics/tx_bytes").read())
                meet(f"{route}-ready-{v}", live(route, v))
                # Every live subscriber's pull waiting first (as a trainer's workers are): a
                # request that comes after the publish is sent the version whole, which under
                # load would measure the scheduler rather than the route.
                until = time.time() + 5
                while time.time() < until and not all(
                        st["waiting"] or st["lost"] or st["routed_around"] and a.fault == "kill"
                        for st in pub.stats()):
                    time.sleep(0.001)
                starts.append(time.time())
                pub.publish(td)
                meet(f"{route}-held-{v}", live(route, v))
                tx.append(int(open("/sys/class/net/eth0/statistics/tx_bytes").read()) - before)
            if faulty and a.fault == "slow":
                subprocess.run([HOSTS, "rate", str(FAULTY), a.rate], check=True)
            out[route] = {"starts": starts, "tx": tx, "stats": pub.stats()}
            meet(f"{route}-end", live(route, a.versions))
            pub.close()
        else:
            sub = Subscriber(src=0, channel=channel, transport="socket")
            held, rx = [], []
            for v in range(1, a.versions + 1):
                before = int(open("/sys/class/net/eth0/statistics/rx_bytes").read())
                meet(f"{route}-ready-{v}", live(route, v))
                if faulty and rank == FAULTY and v == a.fault_version:
                    me, after = os.getpid(), 0.4 * p2p
                    if a.fault == "kill":
                        threading.Timer(after, os.kill, (me, signal.SIGKILL)).start()
                    elif a.fault == "stop":
                        subprocess.Popen(["sh", "-c", f"sleep {after}; kill -STOP {me}; "
                                          f"sleep 3; kill -CONT {me}"])
                got = sub.pull(td, timeout=300.0, min_version=v)
                assert got is not None and got >= v and bool((td["w0"] == got).all()), (got, v)
                held.append(time.time())
                meet(f"{route}-held-{v}", live(route, v))
                rx.append(int(open("/sys/class/net/eth0/statistics/rx_bytes").read()) - before)
            out[route] = {"held": held, "transport": sub.transport,
                          "routed_around": sub.routed_around, "rx": rx if counts_rx else None}
            meet(f"{route}-end", live(route, a.versions))
    print("RESULT " + json.dumps(out), flush=True)
    # Not destroy_process_group(): with a rank killed, Gloo's teardown may wait on it.
    sys.stdout.flush()
    os._exit(0)


def summarize(a: argparse.Namespace, results: list[dict]) -> dict:
    pub = next(r for r in results if r["rank"] == 0)
    subs = [r for r in results if r["rank"] != 0]
    floor = pub["p2p_s"]
    version_bytes = a.mib << 20
    report = {"lang": a.lang, "subscribers": len(subs), "per_host": a.per_host,
              "p2p_seconds": floor, "rate": a.rate, "mib": a.mib, "routes": {}}
    print(f"hosts_bench ({a.lang}): {len(subs)} subscribers on {a.hosts - 1} hosts paced to "
          f"{a.rate}, {a.mib} MiB, {a.versions} versions; one paced send of the bytes: {floor:.2f} s")
    for route in a.route.split(","):
        starts, txs = pub[route]["starts"], pub[route]["tx"]
        faulty = route != "star" and a.fault != "none"
        fv = a.fault_version - 1
        times, others = [], []
        for v in range(a.versions):
            held = [s[route]["held"][v] for s in subs if v < len(s[route]["held"])]
            times.append(max(held) - starts[v])
            rest = [s[route]["held"][v] for s in subs
                    if s["rank"] != FAULTY and v < len(s[route]["held"])]
            others.append(max(rest) - starts[v])
        healthy_versions = [v for v in range(1, a.versions) if not faulty or v < fv] or [0]
        healthy = statistics.median(times[v] for v in healthy_versions)
        tx = statistics.median(txs[v] / version_bytes for v in healthy_versions)
        r = {"seconds": healthy, "ratio": healthy / floor, "tx_ratio": tx,
             "times": times, "tx": [t / version_bytes for t in txs],
             "transports": [s[route]["transport"] for s in subs if route in s],
             # The most a subscriber host's interface received, per byte of the version.
             "rx_ratio": statistics.median(
                 max(s[route]["rx"][v] for s in subs if s[route].get("rx")) / version_bytes
                 for v in healthy_versions),
             "relayed_from": [st.get("relayed_from") for st in pub[route]["stats"]],
             "routed_around": [st.get("routed_around") for st in pub[route]["stats"]],
             "subscribers_routed_around": {s["rank"]: s[route]["routed_around"] for s in subs
                                           if route in s and s[route]["routed_around"]}}
        print(f"  {route}: every subscriber holds a version: median {healthy:.2f} s = "
              f"{healthy / floor:.2f}x one paced send; the publisher's interface sent "
              f"{tx:.2f}x the version's bytes, a subscriber host's received at most "
              f"{r['rx_ratio']:.2f}x")
        if faulty:
            r["fault"] = a.fault
            r["fault_version_others"] = others[fv]
            r["fault_ratio"] = others[fv] / healthy
            after = others[fv + 1:] if a.fault != "kill" else times[fv + 1:]
            if after:
                r["next_ratio"] = after[0] / healthy
                r["after_fault_versions"] = len(after)
            print(f"  {route}, relay on host {FAULTY} {a.fault} in version {a.fault_version}: the "
                  f"others hold it after {others[fv]:.2f} s = {others[fv] / healthy:.2f}x the "
                  f"healthy median; the next version {r.get('next_ratio', 0):.2f}x; "
                  f"{len(after)} versions after it, all held")
            print(f"    publisher's stats, routed_around: {r['routed_around']}")
        report["routes"][route] = r
    return report


# What benchmarks/run measures (bench.py): the routes side by side, then the relays' faults.
RUNS = [
    ("N = 4", ["--hosts", "5", "--mib", "64", "--versions", "3", "--route", "star,chain,tree"]),
    ("N = 8", ["--hosts", "9", "--mib", "64", "--versions", "3", "--route", "star,chain,tree"]),
    # The same as N = 4, every rank in C++ (benchmarks/hosts_rank.cpp).
    ("N = 4, C++", ["--hosts", "5", "--mib", "64", "--versions", "3", "--route",
                    "star,chain,tree", "--lang", "cpp"]),
    ("relay killed", ["--hosts", "5", "--mib", "64", "--versions", "14", "--route", "chain",
                      "--fault", "kill"]),
    ("relay stopped 3 s", ["--hosts", "5", "--mib", "64", "--versions", "5", "--route", "chain",
                           "--fault", "stop"]),
    ("relay at a quarter rate", ["--hosts", "5", "--mib", "64", "--versions", "5", "--route",
                                 "chain", "--fault", "slow"]),
    # Two trees: host 1's subscriber is the second tree's root (N even: each forwards in one).
    ("tree: relay killed", ["--hosts", "5", "--mib", "64", "--versions", "8", "--route", "tree",
                            "--fault", "kill"]),
    ("tree: relay stopped 3 s", ["--hosts", "5", "--mib", "64", "--versions", "5", "--route",
                                 "tree", "--fault", "stop"]),
    ("tree: relay at a quarter rate", ["--hosts", "5", "--mib", "64", "--versions", "5",
                                       "--route", "tree", "--fault", "slow"]),
    # A host's other subscribers read its first's slots from version 3 on.
    ("2 subscribers a host", ["--hosts", "5", "--per-host", "2", "--mib", "64", "--versions", "5",
                              "--route", "star,chain,tree"]),
]
QUICK = [("N = 3", ["--hosts", "4", "--mib", "4", "--rate", "200mbit", "--versions", "2",
                    "--route", "star,chain,tree"])]


def run(quick: bool) -> dict:
    """Every run of RUNS (QUICK), each hosts_bench.py in a process of its own."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return {"status": "needs root and iproute2 (network namespaces)"}
    import tempfile
    out = {"status": "ok", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in QUICK if quick else RUNS:
            path = os.path.join(tmp, "run.json")
            done = subprocess.run([sys.executable, __file__, *args, "--json", path],
                                  capture_output=True, text=True, timeout=1200)
            if done.returncode != 0:
                out["runs"].append({"name": name, "error": done.stdout[-500:] + done.stderr[-500:]})
                continue
            with open(path) as f:
                out["runs"].append({"name": name, **json.load(f)})
    return out


def section(result: dict) -> str:
    """The Markdown section "## Across hosts": the routes and the faults, beside their goals."""
    head = "## Across hosts\n\n"
    if result.get("status") != "ok":
        return head + f"Not run: {result.get('status')}."
    rows = ["| run | route | every subscriber holds a version | x one paced send | "
            "publisher's interface sent | a subscriber host's received | fault: the others in "
            "that version | the next |",
            "|---|---|--:|--:|--:|--:|--:|--:|"]
    for run_ in result["runs"]:
        if "error" in run_:
            rows.append(f"| {run_['name']} | **failed** | {run_['error'][-200:]!r} | | | | | |")
            continue
        for route, r in run_["routes"].items():
            fault = (f"{r['fault_ratio']:.2f}x healthy" if "fault_ratio" in r else "")
            after = (f"{r['next_ratio']:.2f}x" if "next_ratio" in r else "")
            rows.append(f"| {run_['name']} ({run_['subscribers']} subscribers, {run_['mib']} MiB, "
                        f"{run_['rate']}) | {route} | {r['seconds']:.2f} s | {r['ratio']:.2f} | "
                        f"{r['tx_ratio']:.2f}x | {r['rx_ratio']:.2f}x | {fault} | {after} |")
    return (head + "`benchmarks/hosts_bench.py`: one publisher and a subscriber on each other "
            "host, hosts made of network namespaces on a bridge (scripts/hosts), each host's "
            "egress paced by tc; medians of the versions (the faults: the version the relay "
            "failed in, and the next, beside the healthy median). One paced point-to-point "
            "send of the same bytes is measured in each run. Goals: relays (chain, tree) within "
            "1.3x one send at N = 4 (1.4x at N = 8), the publisher's interface at most 1.1x the "
            "bytes, each host's about 1x; a killed relay: the others within the healthy time + "
            "1 s; a relay at a quarter of "
            "the rate: 1.5x in that version, 1.1x the next.\n\n" + "\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=5)
    ap.add_argument("--per-host", type=int, default=1,
                    help="subscribers on each host but the publisher's")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--slow-rate", default=None, help="a slow relay's rate (default: rate / 4)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--route", default="star,chain", help="routes, comma-separated, in order")
    ap.add_argument("--fault", choices=["none", "kill", "stop", "slow"], default="none")
    ap.add_argument("--fault-version", type=int, default=3)
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--lang", choices=["python", "cpp"], default="python",
                    help="the ranks' language: this file's rank_main, or build/hosts_rank")
    ap.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.slow_rate is None:
        value, unit = a.rate.rstrip("bitkmg"), a.rate[len(a.rate.rstrip("bitkmg")):]
        a.slow_rate = f"{float(value) / 4:g}{unit}"
    if a._rank is not None:
        rank_main(a)
        return
    if a.fault != "none" and (a.hosts < 4 or a.route.split(",") == ["star"]
                              or a.fault_version >= a.versions):
        raise SystemExit("hosts_bench: a fault needs relays (\"chain\" or \"tree\"), 4 hosts or "
                         "more, and a version after the fault's")
    subprocess.run([HOSTS, "up", str(a.hosts), a.rate], check=True)
    try:
        args = ["--hosts", str(a.hosts), "--per-host", str(a.per_host), "--mib", str(a.mib),
                "--rate", a.rate, "--versions",
                str(a.versions), "--route", a.route, "--fault", a.fault, "--fault-version",
                str(a.fault_version), "--port", str(a.port)]
        world = 1 + (a.hosts - 1) * a.per_host
        host_of = [0] + [1 + (r - 1) % (a.hosts - 1) for r in range(1, world)]
        if a.lang == "cpp":
            build = os.environ.get("TENSORDICT_BUILD_DIR", os.path.join(ROOT, "build"))
            rank_cmd = [os.path.join(build, "hosts_rank"), *args, "--hosts-script", HOSTS]
        else:
            rank_cmd = [sys.executable, __file__, *args]
        procs = [subprocess.Popen([HOSTS, "exec", str(host_of[r]), *rank_cmd, "--_rank", str(r),
                                   "--slow-rate", a.slow_rate],
                                  stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        results = []
        for r, p in enumerate(procs):
            stdout, _ = p.communicate(timeout=900)
            killed = a.fault == "kill" and r == FAULTY
            if p.returncode != 0 and not killed:
                raise SystemExit(f"hosts_bench: rank {r} failed ({p.returncode})")
            results += [json.loads(line[7:]) for line in stdout.splitlines()
                        if line.startswith("RESULT ")]
    finally:
        subprocess.run([HOSTS, "down"], check=False)
    if a.fault == "kill":
        # The killed rank printed nothing: its times are those it reached.
        results.append({"rank": FAULTY, **{route: {"held": [], "transport": "killed",
                                                   "routed_around": [], "rx": None}
                                           for route in a.route.split(",")}})
    report = summarize(a, results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
