"""benchmarks/run --quick: one small case end to end. Checks the structure of the report and
that every arm's received data verified; never the speed (that is the full run's job)."""
import json
import os
import subprocess

from conftest import BUILD_DIR, ROOT, built


def test_quick_run_reports_every_arm_and_verifies(tmp_path):
    built("transfer_bench"), built("micro_bench")
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [str(ROOT / "benchmarks" / "run"), "--quick", "--no-write", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TENSORDICT_BUILD_DIR=str(BUILD_DIR)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data verification: passed" in proc.stdout

    result = json.loads(out.read_text())
    assert result["verified"] is True
    # The receive with a timeout beside one without, and the memcpy it may add.
    timed = result["timeouts"]
    assert {"plain", "timeout"} <= timed["cases"]["1 KB, per leaf"].keys()
    assert timed["memcpy_s"] > 0 and "with one (µs)" in proc.stdout
    [case] = result["cases"]
    assert case["name"] == "1x1KB"
    arms = case["arms"]
    expected = {"floor.raw_one", "floor.memcpy", "floor.py_raw_one", "cpp.per_leaf",
                "cpp.consolidated", "ref.per_leaf", "ref.consolidated", "ref.init_remote",
                "py.per_leaf", "py.consolidated"}
    assert expected <= arms.keys()
    for arm_id, arm in arms.items():
        if arm_id == "floor.ucx":
            continue  # ucx_perftest reports a median only
        assert arm["verified"] is True, arm_id
        assert arm["n"] >= 5 and arm["p25_us"] <= arm["median_us"], arm_id

    # The printed tables: one transfer row per arm, and the micro-benchmarks.
    lines = proc.stdout.splitlines()
    rows = [l for l in lines if l.startswith("| 1x1KB |")]
    assert len(rows) == len(arms)
    assert any("reference: td.send (per leaf)" in r for r in rows)
    for label in ("pseudo_rand tag", "sort 1000 keys", "consolidate 1000 x 64 B",
                  "metadata -> JSON", "JSON -> metadata", "restricted pickle read",
                  "from_remote_init of the reference's init_remote", "from_consolidated of the"):
        assert any(l.startswith(f"| {label}") for l in lines), label
    assert result["stack_receive"]["verified"] is True
    # Publication: every pull whole, and the section printed.
    torn = result["publication"]["torn"]
    assert torn["pulls"] > 0 and torn["torn"] == 0 and torn["not_increasing"] == 0
    assert "## Publication" in proc.stdout
    # torchrl collectors (on the peer stack, when installed): every case acted with the
    # trainer's weights after each update.
    collectors = result["torchrl_collectors"]
    assert "## torchrl collectors" in proc.stdout
    if collectors["status"] == "ok":
        assert {c["scheme"] for c in collectors["cases"]} == {"default", "tensordict_cpp"}
        assert all(c.get("verified") for c in collectors["cases"]), collectors["cases"]
    # --no-write leaves the published report alone.
    assert "wrote docs/benchmarks.md" not in proc.stdout


def route_model(*args):
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "benchmarks" / "route_model.py"),
         "--alpha-us", "30", "--json", "-", *args],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_route_model_closed_forms_match_its_simulator_and_hosts_shorten_the_chain():
    result = route_model("--n", "64", "--check-n", "4", "8")
    # The discrete-event simulator reproduces every closed form at small N.
    assert len(result["checks"]) == 8
    for c in result["checks"]:
        assert abs(c["rel_err"]) < 1e-9, c
    rows = {r["route"]: r for r in result["rows"]}
    assert rows["star"]["ratio"] == 64
    # Pieces within the implementation's bounds; 8 subscribers a host make the chain 8 long.
    lo, hi = result["clamp"]
    for r in rows.values():
        if r["route"] != "star":
            assert lo <= r["piece"] <= hi, r
    assert rows["hosts"]["ratio"] < rows["chain"]["ratio"]
    assert rows["dbt_hosts"]["ratio"] < rows["dbt"]["ratio"] < rows["chain"]["ratio"]
    # One subscriber a host is the plain chain, and the plain double binary tree.
    one_a_host = route_model("--n", "64", "--check-n", "--per-host", "1")["rows"]
    alone = {r["route"]: r for r in one_a_host}
    assert alone["hosts"]["ms"] == alone["chain"]["ms"]
    assert alone["dbt_hosts"]["ms"] == alone["dbt"]["ms"]


def test_piece_cost_relays_through_a_chain_of_two_and_reports_a_cost_per_piece(tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "benchmarks" / "piece_cost.py"),
         "--mib", "8", "--rounds", "3", "--warmup", "1", "--no-raw", "--json", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    e = json.loads(out.read_text())["engine"]
    # Relayed: one subscriber took the pieces from the publisher (-1), the other from it.
    assert e["relayed_from"][0] == -1 and e["relayed_from"][1] >= 1, e
    assert all(t > 0 for t in e["median_ms"].values()) and "engine, one piece:" in proc.stdout
