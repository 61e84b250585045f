"""Soak: pulls through relays are never torn.

A publisher (rank 0, route="chain" or `--route tree`, transport="socket") and 3 subscribers
over Gloo on
127.0.0.1. For each version the publisher waits until every subscriber's pull waits (so that
the version is relayed: the first subscriber takes it from the publisher, the others from the
one before with `--hosts apart`, each subscriber playing a host of its own, or from the first
one's shared memory with `--hosts one`, the default), then publishes a TensorDict of 3 leaves whose every element holds the version
number plus the leaf's index; each subscriber checks every pull: every element of every leaf
holds what its version says, and the versions only increase. It prints the pulls checked, the
torn ones (0 unless a check failed: then it exits 1), and the publisher's stats.

    .venv/bin/python tests/soak/relay_torn.py --pulls 100000
    .venv/bin/python tests/soak/relay_torn.py --pulls 100000 --hosts apart
    .venv/bin/python tests/soak/relay_torn.py --pulls 100000 --hosts apart --route tree

Not in the suite (minutes); tests/python/test_relays.py runs a short one.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SUBSCRIBERS = 3


def rank_main(rank: int, port: int, versions: int, numel: int, apart: bool, route: str) -> None:
    if apart and rank != 0:
        os.environ["TENSORDICT_TEST_HOST"] = f"host{rank}"  # a test hook: hosts of their own
    from tensordict_cpp import Publisher, Subscriber, TensorDict

    world = SUBSCRIBERS + 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    td = TensorDict({f"l{i}": torch.zeros(numel) for i in range(3)}, batch_size=[])
    if rank == 0:
        pub = Publisher(max_slots=2, transport="socket", route=route)
        for v in range(1, versions + 1):
            # Every subscriber took the last version and waits for this one.
            while not all(s["waiting"] and (s["version"] or 0) == v - 1 for s in pub.stats()):
                time.sleep(0.0002)
            for i, leaf in enumerate(td.values()):
                leaf.fill_(v * 4 + i)
            pub.publish(td)
        dist.barrier()
        stats = pub.stats()
        print("STATS " + json.dumps([{k: s[k] for k in ("rank", "version", "pulls",
                                                          "relayed_from", "relayed_second",
                                                          "routed_around")}
                                     for s in stats]), flush=True)
        pub.close()
    else:
        sub = Subscriber(src=0, transport="socket")
        last, pulls, torn = 0, 0, 0
        while last < versions:
            got = sub.pull(td, timeout=60.0)
            assert got is not None, f"rank {rank}: no version within 60 s after {last}"
            pulls += 1
            whole = all(bool((leaf == got * 4 + i).all()) for i, leaf in enumerate(td.values()))
            if not whole or got <= last:
                torn += 1
                print(f"rank {rank}: version {got} after {last} torn={not whole}", flush=True)
            last = got
        print(f"PULLS {rank} {pulls} {torn} {json.dumps(sub.routed_around)}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        sys.exit(1 if torn else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pulls", type=int, default=100_000, help="pulls in all (subscribers')")
    ap.add_argument("--kib", type=int, default=64, help="each leaf's KiB")
    ap.add_argument("--hosts", choices=["one", "apart"], default="one",
                    help="the subscribers on one host (its first's slots) or each on its own")
    ap.add_argument("--route", choices=["chain", "tree"], default="chain")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    versions = -(-a.pulls // SUBSCRIBERS)
    start = time.time()
    mp.spawn(rank_main, args=(port, versions, a.kib * 256, a.hosts == "apart", a.route),
             nprocs=SUBSCRIBERS + 1)
    print(f"relay_torn: {versions} versions to {SUBSCRIBERS} subscribers in "
          f"{time.time() - start:.0f} s; every pull checked (a torn or stale one fails the run)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
