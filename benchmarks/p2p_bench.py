"""Point-to-point benchmark table: our C++ transfers against raw c10d and the reference.

Runs build/p2p_bench (ours and raw c10d, two C++ ranks), then the same transfers with the
reference tensordict (Python, torch.distributed Gloo over a FileStore on 127.0.0.1), each
timed transfer closed by a small ack, medians over interleaved rounds. Prints one table whose
ratios all come from this run.

    .venv/bin/python benchmarks/p2p_bench.py [--build-dir build] [--rounds 7]
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ACK_TAG = 1 << 30


def reference_worker(rank, store_dir, rounds, out_path):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist
    from tensordict import TensorDict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=2)
    sender = rank == 0
    ack = torch.zeros(1)

    def leaves(n, floats, value):
        return TensorDict({f"leaf{1000 + i}": torch.full((floats,), value) for i in range(n)}, [])

    per_leaf = leaves(100, 256, 1.0 if sender else 0.0)
    cons = leaves(100, 256, 2.0 if sender else 0.0).consolidate(metadata=True)
    big = TensorDict({"big": torch.full((25_000_000,), 3.0 if sender else 0.0)}, [])
    raw = [torch.full((256,), 1.0 if sender else 0.0) for _ in range(100)]

    def raw_send():
        for w in [dist.isend(t, dst=1, tag=i) for i, t in enumerate(raw)]:
            w.wait()

    def raw_recv():
        for w in [dist.irecv(t, src=0, tag=i) for i, t in enumerate(raw)]:
            w.wait()

    scenarios = [
        ("per-leaf 100 x 1 KB", 20, [
            ("torch.distributed isend x100 (Python)", raw_send, raw_recv),
            ("reference td.send / td.recv", lambda: per_leaf.send(dst=1),
             lambda: per_leaf.recv(src=0)),
            ("reference td.send / recv, pseudo_rand", lambda: per_leaf.send(dst=1, pseudo_rand=True),
             lambda: per_leaf.recv(src=0, pseudo_rand=True)),
        ]),
        ("consolidated 100 x 1 KB", 20, [
            ("reference send(consolidated), consolidated TD",
             lambda: cons.send(dst=1, consolidated=True),
             lambda: cons.recv(src=0, consolidated=True)),
        ]),
        ("1 x 100 MB", 3, [
            ("reference td.send / td.recv", lambda: big.send(dst=1), lambda: big.recv(src=0)),
        ]),
    ]
    times = {}
    for name, iters, variants in scenarios:
        for rnd in range(-1, rounds):
            for vname, send, recv in variants:
                for _ in range(iters):
                    if sender:
                        t0 = time.perf_counter()
                        send()
                        dist.recv(ack, src=1, tag=ACK_TAG)
                        if rnd >= 0:
                            times.setdefault(f"{name}|{vname}", []).append(
                                (time.perf_counter() - t0) * 1e6)
                    else:
                        recv()
                        dist.send(ack, dst=0, tag=ACK_TAG)
    if not sender:
        assert bool((per_leaf == 1.0).all()) and bool((cons == 2.0).all())
        assert bool((big == 3.0).all())
    else:
        from tensordict.utils import _int_generator
        n = 20000
        t0 = time.perf_counter()
        tag = -1
        for _ in range(n):
            tag = _int_generator(tag + 1)
        ns_per_tag = (time.perf_counter() - t0) / n * 1e9
        result = {k: statistics.median(v) for k, v in times.items()}
        result["ns_per_tag"] = ns_per_tag
        pathlib.Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_reference(rounds):
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), tmp,
                                   str(rounds), str(out)], env=env) for r in range(2)]
        deadline = time.monotonic() + 900
        for p in procs:
            rc = p.wait(timeout=max(1, deadline - time.monotonic()))
            if rc != 0:
                for q in procs:
                    q.kill()
                raise SystemExit(f"reference worker failed with exit code {rc}")
        return json.loads(out.read_text())


def run_ours(build_dir, rounds):
    exe = pathlib.Path(build_dir) / "p2p_bench"
    proc = subprocess.run([str(exe), "--rounds", str(rounds)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(f"{exe} failed:\n{proc.stdout}\n{proc.stderr}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("JSON "))
    return json.loads(line[5:])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, rank, tmp, rounds, out = sys.argv
        reference_worker(int(rank), tmp, int(rounds), out)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.environ.get("TENSORDICT_BUILD_DIR",
                                                              str(ROOT / "build")))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ours = run_ours(args.build_dir, args.rounds)
    ref = run_reference(args.rounds)

    def row(label, value, floor_label, floor, target=""):
        print(f"{label:<72} {value:>11.1f} us  {value / floor:>7.3f} x {floor_label:<22} {target}")

    print(f"{'transfer':<72} {'median':>14}  {'ratio':>9}")
    raw_pl = ours["per-leaf 100 x 1 KB|raw c10d (100 sends posted, then waited)"]
    our_pl = ours["per-leaf 100 x 1 KB|dist::send / dist::recv"]
    our_pr = ours["per-leaf 100 x 1 KB|dist::send / recv, pseudo_rand"]
    ref_pl = ref["per-leaf 100 x 1 KB|reference td.send / td.recv"]
    ref_pr = ref["per-leaf 100 x 1 KB|reference td.send / recv, pseudo_rand"]
    row("per-leaf 100x1KB: raw c10d (C++)", raw_pl, "raw", raw_pl)
    row("per-leaf 100x1KB: ours", our_pl, "raw", raw_pl, "target <= 1.2")
    row("per-leaf 100x1KB: ours, pseudo_rand", our_pr, "raw", raw_pl, "target <= 1.2")
    row("per-leaf 100x1KB: torch.distributed isend loop (Python)",
        ref["per-leaf 100 x 1 KB|torch.distributed isend x100 (Python)"], "raw", raw_pl)
    row("per-leaf 100x1KB: reference tensordict", ref_pl, "raw", raw_pl)
    print(f"{'  reference / ours (per-leaf)':<72} {ref_pl / our_pl:>11.2f} x   target >= 5")
    print(f"{'  reference / ours (per-leaf, pseudo_rand)':<72} {ref_pr / our_pr:>11.2f} x   target >= 5")
    raw_c = ours["consolidated 100 x 1 KB|raw c10d (one 100 KB send)"]
    row("consolidated 100x1KB: raw c10d, one 100 KB send", raw_c, "raw", raw_c)
    row("consolidated 100x1KB: ours, consolidated TD",
        ours["consolidated 100 x 1 KB|dist::send(consolidated), consolidated TD"], "raw", raw_c,
        "target <= 1.3")
    row("consolidated 100x1KB: ours, consolidating each send",
        ours["consolidated 100 x 1 KB|dist::send(consolidated), consolidating each time"], "raw",
        raw_c)
    row("consolidated 100x1KB: reference, consolidated TD",
        ref["consolidated 100 x 1 KB|reference send(consolidated), consolidated TD"], "raw", raw_c)
    raw_b = ours["1 x 100 MB|raw c10d (one send)"]
    row("1x100MB: raw c10d", raw_b, "raw", raw_b)
    row("1x100MB: ours", ours["1 x 100 MB|dist::send / dist::recv"], "raw", raw_b,
        "target <= 1.05")
    row("1x100MB: reference", ref["1 x 100 MB|reference td.send / td.recv"], "raw", raw_b)
    print(f"{'pseudo_rand tag: ours':<72} {ours['ns_per_tag'] / 1000:>11.3f} us  target < 1 us")
    print(f"{'pseudo_rand tag: reference (numpy)':<72} {ref['ns_per_tag'] / 1000:>11.3f} us")


if __name__ == "__main__":
    main()
