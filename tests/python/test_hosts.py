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
from conftest import built

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2")


def run_bench(tmp_path, *args):
    out = tmp_path / "hosts.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hosts_bench.py"),
                          *args, "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    print(run.stdout)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "td-h" not in listed and "td-br" not in listed, listed
    return json.loads(out.read_text())


def test_publication_reaches_every_host_whole_by_star_and_by_chain(tmp_path):
    # 4 hosts (a publisher, 3 subscribers), 4 MiB at 200 Mbit/s: ~0.17 s a send. hosts_bench's
    # ranks check each pulled version's values and fail otherwise.
    r = run_bench(tmp_path, "--hosts", "4", "--mib", "4", "--rate", "200mbit", "--versions", "3",
                  "--route", "star,chain")
    star, chain = r["routes"]["star"], r["routes"]["chain"]
    # Hosts see none of each other's processes: no shared memory between them.
    for route in (star, chain):
        assert all(t.startswith("socket") for t in route["transports"]), r
    # Paced: no faster than one send; the star sends one copy per subscriber, the chain one.
    assert star["ratio"] >= 0.9 and 2.7 <= star["tx_ratio"] <= 3.6, star
    assert chain["ratio"] >= 0.9 and chain["tx_ratio"] <= 1.3, chain
    assert chain["seconds"] < star["seconds"], r
    # The last version's route: one subscriber from the publisher, each other from another.
    assert sorted(chain["relayed_from"]) == [-1, 1, 2], chain


def test_the_cpp_api_relays_across_hosts_as_python_does(tmp_path):
    # The same run with every rank a C++ program (benchmarks/hosts_rank.cpp, through
    # tensordict/distributed/publication.h), which checks each pulled version's values too.
    built("hosts_rank")
    r = run_bench(tmp_path, "--hosts", "4", "--mib", "4", "--rate", "200mbit", "--versions", "3",
                  "--route", "star,chain,tree", "--lang", "cpp")
    assert r["lang"] == "cpp", r
    star, chain, tree = (r["routes"][k] for k in ("star", "chain", "tree"))
    assert 2.7 <= star["tx_ratio"] <= 3.6 and chain["tx_ratio"] <= 1.3, r
    assert chain["ratio"] >= 0.9 and chain["seconds"] < star["seconds"], r
    assert sorted(chain["relayed_from"]) == [-1, 1, 2], chain
    # Two trees over three: the publisher sends each its root's half, one copy in all.
    assert tree["tx_ratio"] <= 1.3 and tree["seconds"] < star["seconds"], tree
    assert sorted(tree["relayed_from"]).count(-1) == 1, tree


def test_a_relay_killed_mid_version_costs_the_others_little(tmp_path):
    # 3 hosts of 2 subscribers; the chain's first relay (rank 1, on host 1, whose other
    # subscriber, rank 4, reads rank 1's slots from version 3 on) is SIGKILLed 40 % into
    # version 4 of 6.
    r = run_bench(tmp_path, "--hosts", "4", "--per-host", "2", "--mib", "4", "--rate", "200mbit",
                  "--versions", "6", "--route", "chain", "--fault", "kill", "--fault-version", "4")
    chain = r["routes"]["chain"]
    # The others held that version (hosts_bench's ranks check every version they pull) and the
    # two after it, on the same group; within a second of the healthy time.
    assert chain["after_fault_versions"] == 2, chain
    assert chain["fault_version_others"] <= chain["seconds"] + 1.0, chain
    assert chain["routed_around"][0] is not None and "left it" in chain["routed_around"][0], chain
    # The reader of its slots saw its process exit and took the version from the publisher.
    left = chain["subscribers_routed_around"].get("4", [])
    assert any(e.startswith("rank 1 ") and "exited" in e for e in left), chain


def test_a_version_crosses_each_hosts_interface_once(tmp_path):
    # 2 hosts of 2 subscribers each, the subscribers' ranks going round the hosts: the route
    # visits each host once, its first subscriber writing the version into its slots, which the
    # other reads (from version 3: the publisher learns the hosts from version 1, the slots from
    # version 2), so that each host's interface receives it once.
    r = run_bench(tmp_path, "--hosts", "3", "--per-host", "2", "--mib", "4", "--rate", "200mbit",
                  "--versions", "3", "--route", "star,chain")
    star, chain = r["routes"]["star"], r["routes"]["chain"]
    assert 1.8 <= star["rx_ratio"] <= 2.4, star
    assert chain["rx_ratio"] <= 1.3 and chain["tx_ratio"] <= 1.3, chain
    # Ranks 1 and 3 share a host, as do 2 and 4: one of each pair reads the other's slots, and
    # forwards nothing: the other host's first takes the version from this host's first.
    parent = dict(zip([1, 2, 3, 4], chain["relayed_from"]))
    same = {1: 3, 3: 1, 2: 4, 4: 2}
    readers = {x for x in parent if parent[x] == same[x]}
    assert len(readers) == 2, chain
    assert all(parent[x] not in readers for x in parent), chain


def test_two_trees_of_hosts_lose_a_relay_and_keep_each_hosts_copy_once(tmp_path):
    # 3 hosts of 2 subscribers, route "tree": from version 3 the two trees join the hosts'
    # first subscribers and each host's other reads both halves from its first's slots. Rank 1
    # (host 1's first, forwarding in one tree) is SIGKILLed 40 % into version 4 of 6.
    r = run_bench(tmp_path, "--hosts", "4", "--per-host", "2", "--mib", "4", "--rate", "200mbit",
                  "--versions", "6", "--route", "tree", "--fault", "kill", "--fault-version", "4")
    tree = r["routes"]["tree"]
    # Before the kill each host's interface received a version about once, the publisher's
    # sent about one copy; after it, the others held that version within a second of the
    # healthy time, and the two after it (hosts_bench's ranks check every version's values).
    assert tree["rx_ratio"] <= 1.3 and tree["tx_ratio"] <= 1.3, tree
    assert tree["after_fault_versions"] == 2, tree
    assert tree["fault_version_others"] <= tree["seconds"] + 1.0, tree
    # The reader of rank 1's slots saw its process exit and took both halves from the publisher.
    left = tree["subscribers_routed_around"].get("4", [])
    assert any(e.startswith("rank 1 ") and "exited" in e for e in left), tree
