"""Publication across hosts made of network namespaces (scripts/hosts), paced like NICs: every
subscriber on another host holds each version whole, and what the publisher's interface sent
is counted. Needs root and iproute2 (skipped otherwise); the benchmark's larger runs are
benchmarks/hosts_bench.py's."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2")


def test_publication_reaches_every_host_whole(tmp_path):
    out = tmp_path / "hosts.json"
    # 3 hosts (a publisher, 2 subscribers), 4 MiB at 200 Mbit/s: each version ~0.17 s a send.
    # hosts_bench's ranks check each pulled version's values and fail otherwise.
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hosts_bench.py"),
                          "--hosts", "3", "--mib", "4", "--rate", "200mbit", "--versions", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads(out.read_text())
    print(run.stdout)
    # Paced: no faster than one send of the bytes; every byte left through the paced interface
    # (the star sends one copy per subscriber).
    assert r["ratio"] >= 0.9, r
    # Hosts see none of each other's processes: no shared memory between them.
    assert all(t.startswith("socket") for t in r["transports"]), r
    assert 0.95 * r["subscribers"] <= r["tx_ratio"] <= 1.2 * r["subscribers"], r
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "td-h" not in listed and "td-br" not in listed, listed
