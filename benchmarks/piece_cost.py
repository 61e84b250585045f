"""What one relayed piece costs the publication, measured: the route model's alpha, from our engine.

Three processes on 127.0.0.1 over Gloo: a Publisher (route "chain") and two Subscribers, the
smallest chain that relays (one subscriber alone is sent a version whole). Each round publishes
one `--mib` MiB version (4 leaves) relayed in pieces of each of two `--pieces` sizes in turn
(forced through the publisher's test hook TENSORDICT_TEST_PIECE_BYTES). A version's time runs
from the publish to the moment both subscribers hold it. Under the route model
(benchmarks/route_model.py) a chain of n takes T(C) = (P + n - 1)(C/bw + alpha), P = B/C
pieces; between two piece sizes the bytes are the same and only the number of pieces (and the
chain's fill, (n - 1) C/bw) differ, so

    alpha = (T(c_small) - T(c_large) + (n - 1)(c_large - c_small)/bw) / (P(c_small) - P(c_large))

is what one piece costs in the engine's pipeline (the publisher keeps 16 pieces posted, a relay
8 receives; each piece checked and copied once): the model's per-message cost. bw is taken
from the large pieces' time, T(c_large) / (P + n - 1) per piece. It prints the medians of
`--rounds` rounds and the spread of alpha over them. The same run also measures, over raw Gloo
on the same machine, the cost of a piece sent one blocking send at a time (route_model.py's
--measure-alpha, the model's cost until now): a cost that only a sender that waits for each
piece pays.

    python benchmarks/piece_cost.py --mib 64 --pieces 65536 1048576 --rounds 15

On a machine of 2 cores the three processes share them: a piece's cost then includes the
scheduler's. The figures are this machine's loopback, not a NIC's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 3  # the publisher and a chain of two


def _rank(rank: int, port: int, a: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from tensordict_cpp import Publisher, Subscriber, TensorDict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    store = dist.TCPStore("127.0.0.1", port + 1, WORLD, rank == 0)
    n = (a.mib << 20) // 4 // 4
    td = TensorDict({f"w{i}": torch.zeros(n) for i in range(4)}, batch_size=[])
    modes = [str(c) for c in a.pieces]
    ends = {m: (Publisher(max_slots=2, channel=i, transport="socket", route="chain")
                if rank == 0 else Subscriber(src=0, channel=i, transport="socket"))
            for i, m in enumerate(modes)}
    times: dict[str, list[float]] = {m: [] for m in modes}

    def meet(tag: str) -> None:
        store.add(tag, 1)
        while int(store.add(tag, 0)) < WORLD:
            time.sleep(0.0005)

    for r in range(a.warmup + a.rounds):
        for m in modes:
            v = r + 1
            key = f"{m}-{v}"
            if rank == 0:
                pub = ends[m]
                os.environ["TENSORDICT_TEST_PIECE_BYTES"] = m
                for leaf in td.values():
                    leaf.fill_(v)
                meet(key + "-ready")
                until = time.time() + 5
                while time.time() < until and not (
                        len(pub.stats()) == WORLD - 1 and all(s["waiting"] for s in pub.stats())):
                    time.sleep(0.0005)
                t0 = time.time()
                pub.publish(td)
                meet(key + "-held")
                if r >= a.warmup:
                    held = max(float(store.get(f"{key}-t1-{k}")) for k in range(1, WORLD))
                    times[m].append(held - t0)
                    # Relayed: one subscriber took the pieces from the publisher, the other
                    # from it.
                    route = sorted(s["relayed_from"] for s in pub.stats())
                    assert route in ([-1, 1], [-1, 2]), (m, v, route)
            else:
                meet(key + "-ready")
                got = ends[m].pull(td, timeout=120.0, min_version=v)
                store.set(f"{key}-t1-{rank}", repr(time.time()))
                assert got == v and bool((td["w3"] == v).all()), (m, got, v)
                meet(key + "-held")
    if rank == 0:
        relayed = sorted(s["relayed_from"] for s in ends[modes[0]].stats())
        with open(out_path, "w") as f:
            json.dump({"times": times, "relayed_from": relayed}, f)
        for e in ends.values():
            e.close()
    dist.destroy_process_group()


def measure(a: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(_rank, args=(port, a, path), nprocs=WORLD, join=True)
        with open(path) as f:
            r = json.load(f)
    finally:
        os.unlink(path)
    times = r["times"]
    b = a.mib << 20
    small, large = min(a.pieces), max(a.pieces)
    pieces = {c: -(-b // c) for c in (small, large)}
    chain = WORLD - 1
    out = {"mib": a.mib, "rounds": a.rounds, "relayed_from": r["relayed_from"],
           "median_ms": {str(c): statistics.median(times[str(c)]) * 1e3 for c in pieces},
           "pieces": {str(c): p for c, p in pieces.items()}}

    def alpha(ts: float, tl: float) -> float:
        per_piece = tl / (pieces[large] + chain - 1)  # C/bw + alpha at the large pieces
        bw = large / per_piece
        return (ts - tl + (chain - 1) * (large - small) / bw) / (pieces[small] - pieces[large])

    per_round = sorted(alpha(ts, tl) for ts, tl in zip(times[str(small)], times[str(large)]))
    out["alpha_us"] = statistics.median(per_round) * 1e6
    out["alpha_iqr_us"] = [per_round[len(per_round) // 4] * 1e6,
                           per_round[(3 * len(per_round)) // 4] * 1e6]
    out["loopback_GBps"] = b / (out["median_ms"][str(large)] / 1e3) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--pieces", type=int, nargs=2, default=[64 << 10, 1 << 20],
                    help="two piece sizes in bytes (64 KiB to 16 MiB)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-raw", action="store_true", help="skip raw Gloo's blocking sends")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    out = {"engine": measure(a)}
    e = out["engine"]
    for m, t in e["median_ms"].items():
        print(f"{a.mib} MiB through a chain of 2, pieces of {int(m) >> 10:>5} KiB "
              f"({e['pieces'][m]:>4}): {t:8.1f} ms")
    print(f"engine, one piece: {e['alpha_us']:.1f} us (median of {a.rounds} rounds; "
          f"IQR {e['alpha_iqr_us'][0]:.1f} .. {e['alpha_iqr_us'][1]:.1f}); relayed_from "
          f"{e['relayed_from']}")
    if not a.no_raw:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import route_model

        raw = route_model.measure_alpha(pings=500, reps=15)
        out["raw_gloo_blocking"] = raw
        print(f"raw Gloo, a piece per blocking send: {raw['per_piece_extra_us']:.1f} us "
              f"(IQR {raw['per_piece_extra_iqr_us'][0]:.1f} .. "
              f"{raw['per_piece_extra_iqr_us'][1]:.1f}); half a round trip "
              f"{raw['half_rtt_us']:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
