"""tensordict_cpp.torchrl's TensorDictCppWeightSyncScheme in a real torchrl 0.14.1 collector
(MultiSyncCollector and MultiAsyncCollector, 2 spawned workers each): the workers act with the
trainer's weights after update_policy_weights_() and only then (in-place changes and storage
swaps without an update leave them stale: no shared memory stands in for the scheme), versions
readable on both sides, workers' policy_version bumped once per update, clean exits.

torchrl runs on tensordict 0.14.3 while this process has the .venv's 0.15.3: each scenario runs
tests/python/torchrl_peers.py as a process of its own on the peer stack that scripts/peers
installs into .peers/td014 (first on its PYTHONPATH), our module after it."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers" / "td014"
PEER_SCRIPT = pathlib.Path(__file__).with_name("torchrl_peers.py")
TIMEOUT = 180

pytestmark = pytest.mark.skipif(
    not (PEERS / "torchrl").is_dir(),
    reason=f"the torchrl 0.14.1 / tensordict 0.14.3 peer stack is not installed in {PEERS} "
           f"(run scripts/peers)")


def run_peer(mode: str) -> list[dict]:
    import tensordict_cpp  # the module under test: where this process imports it from

    # The package's directory, not resolved: in a development tree its .py files are links
    # into python/tensordict_cpp, beside the built _C.
    ours = pathlib.Path(os.path.abspath(tensordict_cpp.__path__[0])).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PEERS), str(ours)]),
               TORCHRL_PEER_TIMEOUT=str(TIMEOUT - 20))
    try:
        done = subprocess.run([sys.executable, str(PEER_SCRIPT), mode], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{PEER_SCRIPT.name} {mode} ran past {TIMEOUT} s\nstdout:\n{e.stdout}\n"
                    f"stderr:\n{e.stderr}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines and lines[-1].get("ok"), (
        f"{PEER_SCRIPT.name} {mode} exited {done.returncode}\nstdout:\n{done.stdout}\n"
        f"stderr:\n{done.stderr[-8000:]}")
    return lines


def test_multi_sync_collector_follows_the_trainer_through_the_scheme():
    steps = {line.get("step"): line for line in run_peer("sync")}
    assert steps["imports"]["tensordict"].startswith(str(PEERS))
    checks = steps["checks"]
    assert checks["trainer_version"] == 4 and checks["worker_scheme_versions"] == [4, 4]
    assert checks["worker_policy_versions"] == [3, 3]
    assert checks["worker_cascade_route"] == ["increment_version"] * 2
    assert checks["batch_policy_versions"] == [[0], [0], [1], [1], [2], [3]]
    assert checks["errors"]["inplace_no_update"] > 1e-2  # stale until the update
    assert steps["shutdown"]["exitcodes"] == [0, 0]


def test_multi_async_collector_takes_each_update():
    steps = {line.get("step"): line for line in run_peer("async")}
    assert steps["async"]["trainer_version"] == 4
    assert steps["async"]["worker_versions"] == {"0": 4, "1": 4}


def test_a_stopped_worker_is_named_after_the_timeout_and_catches_up():
    steps = {line.get("step"): line for line in run_peer("stall")}
    stall = steps["stall"]
    assert "workers [1]" in stall["message"] and 2 <= stall["waited_s"] < 4
    assert stall["applied"] == {"0": 3, "1": 2} and stall["after"] == {"0": 4, "1": 4}
