"""Publication across hosts made of network namespaces (scripts/hosts), paced like NICs.

One publisher on host 0 and a subscriber on each other host, over the default Gloo group. For
each version of a `--mib` MiB TensorDict (4 leaves) it reports when the last subscriber holds
it, beside one paced point-to-point send of the same bytes measured in the same run (a
`torch.distributed.send` from host 0 to host 1), and the bytes host 0's interface sent per byte
of the version. The star (today's publication) sends every version once per subscriber.

    python benchmarks/hosts_bench.py --hosts 5 --mib 64 --rate 400mbit --versions 3

Root only. It makes the hosts (scripts/hosts up) and removes them when it ends.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "scripts", "hosts")


def rank_main(rank: int, world: int, port: int, mib: int, versions: int) -> None:
    import torch
    import torch.distributed as dist

    from tensordict_cpp import Publisher, Subscriber, TensorDict

    dist.init_process_group("gloo", init_method=f"tcp://10.77.0.1:{port}", rank=rank,
                            world_size=world)
    n = (mib << 20) // 4 // 4  # four float32 leaves
    td = TensorDict({f"w{i}": torch.zeros(n) for i in range(4)}, batch_size=[])
    out = {"rank": rank}
    # The floor: one paced send of the same bytes, host 0 to host 1.
    flat = torch.zeros((mib << 20) // 4)
    dist.barrier()
    if rank == 0:
        t = time.time()
        dist.send(flat, 1)
        dist.recv(torch.zeros(1), 1)
        out["p2p_s"] = time.time() - t
    elif rank == 1:
        dist.recv(flat, 0)
        dist.send(torch.zeros(1), 0)
    dist.barrier()
    if rank == 0:
        pub = Publisher(max_slots=2)
        starts, tx = [], []
        for v in range(1, versions + 1):
            for leaf in td.values():
                leaf.fill_(v)
            before = int(open("/sys/class/net/eth0/statistics/tx_bytes").read())
            dist.barrier()  # every subscriber pulling
            starts.append(time.time())
            pub.publish(td)
            dist.barrier()  # every subscriber holds it
            tx.append(int(open("/sys/class/net/eth0/statistics/tx_bytes").read()) - before)
        out["starts"], out["tx"] = starts, tx
        dist.barrier()
        pub.close()
    else:
        sub = Subscriber(src=0)
        held = []
        for v in range(1, versions + 1):
            dist.barrier()
            got = sub.pull(td, timeout=300.0, min_version=v)
            assert got == v and bool((td["w0"] == v).all()), (got, v)
            held.append(time.time())
            dist.barrier()
        out["held"], out["transport"] = held, sub.transport
        dist.barrier()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._rank is not None:
        rank_main(a._rank, a.hosts, a.port, a.mib, a.versions)
        return
    subprocess.run([HOSTS, "up", str(a.hosts), a.rate], check=True)
    try:
        procs = [subprocess.Popen([HOSTS, "exec", str(r), sys.executable, __file__,
                                   "--_rank", str(r), "--hosts", str(a.hosts), "--mib", str(a.mib),
                                   "--versions", str(a.versions), "--port", str(a.port)],
                                  stdout=subprocess.PIPE, text=True)
                 for r in range(a.hosts)]
        results = []
        for p in procs:
            stdout, _ = p.communicate(timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"hosts_bench: a rank failed ({p.returncode})")
            results += [json.loads(line[7:]) for line in stdout.splitlines()
                        if line.startswith("RESULT ")]
    finally:
        subprocess.run([HOSTS, "down"], check=False)
    pub = next(r for r in results if r["rank"] == 0)
    subs = [r for r in results if r["rank"] != 0]
    times = [max(s["held"][v] for s in subs) - pub["starts"][v] for v in range(a.versions)]
    version_bytes = a.mib << 20
    t, floor = statistics.median(times), pub["p2p_s"]
    tx = statistics.median(pub["tx"]) / version_bytes
    print(f"hosts_bench: {a.hosts - 1} subscribers on hosts paced to {a.rate}, {a.mib} MiB, "
          f"{a.versions} versions")
    print(f"  every subscriber holds a version: median {t:.2f} s = {t / floor:.2f}x one paced "
          f"send of the bytes ({floor:.2f} s)")
    print(f"  the publisher's interface sent {tx:.2f}x the version's bytes")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"subscribers": a.hosts - 1, "seconds": t, "p2p_seconds": floor,
                       "ratio": t / floor, "tx_ratio": tx,
                       "transports": [s["transport"] for s in subs]}, f)


if __name__ == "__main__":
    main()
