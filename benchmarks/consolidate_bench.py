"""consolidate() against memcpy and against the reference tensordict, in one run.

Runs the consolidate_bench program (Google Benchmark, medians of repetitions), times the
installed reference's ``td.consolidate(metadata=True)`` on TensorDicts of the same shape,
and prints a markdown table of medians and ratios.

    TENSORDICT_BUILD_DIR=build .venv/bin/python benchmarks/consolidate_bench.py [--repetitions 7]

Targets (issue 3): >= 0.8x memcpy bandwidth on the large cases; >= 10x faster than the
reference on 1000 small leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from tensordict import TensorDict

CASES = [("1x100MB", 1, 100 << 20), ("16x8MB", 16, 8 << 20), ("1000x64B", 1000, 64)]


def make_case(count: int, nbytes: int) -> TensorDict:
    """The same TensorDict as consolidate_bench.cpp: leaves a{i}/b{j}/c{k}/x, float32."""
    per_level = 1
    while per_level**3 < count:
        per_level += 1
    td = TensorDict()
    for i in range(count):
        a, b, c = i // (per_level * per_level), (i // per_level) % per_level, i % per_level
        td[f"a{a}", f"b{b}", f"c{c}", "x"] = torch.rand(nbytes // 4)
    return td


def time_reference(td: TensorDict, repetitions: int, min_time: float) -> float:
    """Median over repetitions of the mean time of one call, in microseconds."""
    td.consolidate(metadata=True)  # warm-up
    samples = []
    for _ in range(repetitions):
        n, start = 0, time.perf_counter()
        while True:
            td.consolidate(metadata=True)
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / n * 1e6)
    return statistics.median(samples)


def run_ours(binary: Path, repetitions: int, min_time: float) -> dict[str, float]:
    out = subprocess.run(
        [str(binary), "--benchmark_format=json", f"--benchmark_repetitions={repetitions}",
         "--benchmark_report_aggregates_only=true", f"--benchmark_min_time={min_time}"],
        check=True, capture_output=True, text=True).stdout
    medians = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") == "median":
            medians[b["run_name"]] = b["real_time"]  # microseconds (Unit set in the program)
    return medians


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.3)
    args = parser.parse_args()
    build = Path(os.environ.get("TENSORDICT_BUILD_DIR", "/work/main/build"))
    ours = run_ours(build / "consolidate_bench", args.repetitions, args.min_time)

    def get(name, case, threads=1):
        return ours[f"BM_{name}/case:{case}/threads:{threads}/real_time"]

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"medians of {args.repetitions} runs")
    print()
    print("| case | threads | ours (us) | GB/s | memcpy warm (us) | x memcpy warm | "
          "alloc+memcpy (us) | x alloc+memcpy | reference (us) | x faster than reference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, (name, count, nbytes) in enumerate(CASES):
        ref = time_reference(make_case(count, nbytes), args.repetitions, args.min_time)
        warm, fresh = get("MemcpyWarm", i), get("MemcpyFresh", i)
        total = count * ((nbytes + 7) // 8 * 8)
        for threads in (1, 4):
            key = f"BM_Consolidate/case:{i}/threads:{threads}/real_time"
            if key not in ours:
                continue
            t = ours[key]
            # Bandwidth ratio = time ratio inverted: > 1 means faster than the baseline.
            print(f"| {name} | {threads} | {t:.1f} | {total / t / 1e3:.2f} | {warm:.1f} | "
                  f"{warm / t:.2f} | {fresh:.1f} | {fresh / t:.2f} | {ref:.1f} | {ref / t:.1f} |")


if __name__ == "__main__":
    main()
