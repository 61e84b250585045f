"""A real torchrl 0.14.1 collector synchronised by tensordict_cpp.torchrl's
TensorDictCppWeightSyncScheme, run by tests/python/test_torchrl.py as a process of its own on
the peer stack (PYTHONPATH: .peers/td014, where `import tensordict` is the 0.14.3 that torchrl
runs on, then our build/python). It prints one JSON line per step and {"ok": true} last; any
failed check raises (exit code 1). A watchdog ends it (exit 3) if it hangs.

    python torchrl_peers.py [sync|async|stall]

sync: MultiSyncCollector, 2 spawned workers, ContinuousActionVecMockEnv, a deterministic policy
(Linear(7, 7) on "observation" -> "action"), track_policy_version=True. Each batch's actions are
compared with the trainer's policy applied to the batch's observations:
  1. the first batch: the trainer's initial weights (version 1, published by connect());
  2. the trainer's weights changed IN PLACE without update_policy_weights_(): the workers stay
     stale (no shared memory between the trainer and the workers hides a broken update; the
     trainer's parameters are not in shared memory either), then update -> the new weights;
  3. the trainer's storages REPLACED (p.data = ...) without update: stale, then update -> new;
  4. update_policy_weights_(policy) with the policy passed explicitly;
  5. versions: the trainer scheme's == the number of publishes, each worker's scheme (read in
     the worker through get_distant_attr) == the same, each worker acknowledged it, and the
     workers' "policy_version" went up by one per update, through increment_version() alone
     (the worker's collector copies no policy onto itself); the workers pull zero-copy exactly
     when the build's Subscriber.pull takes zero_copy.
async: MultiAsyncCollector, the same policy: after an update (sync=True), every batch the
trainer takes next that was collected after it carries the new weights.
stall: MultiSyncCollector, 2 workers, the scheme's timeout 2 s: with worker 1 SIGSTOPped,
update_policy_weights_() raises TimeoutError after that timeout, naming worker 1 and its
version, while worker 0 applied the update; after SIGCONT, worker 1 applies it and the next
update reaches both.
"""
import json
import os
import sys
import threading
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else "sync"
TIMEOUT = float(os.environ.get("TORCHRL_PEER_TIMEOUT", "150"))


def report(**fields):
    print(json.dumps(fields), flush=True)


def make_policy(seed):
    import torch
    from tensordict.nn import TensorDictModule
    from torch import nn

    torch.manual_seed(seed)
    return TensorDictModule(nn.Linear(7, 7), in_keys=["observation"], out_keys=["action"])


def action_error(policy, batch):
    import torch

    with torch.no_grad():
        expected = policy.module(batch["observation"])
    return (batch["action"] - expected).abs().max().item()


def zero_copy_available():
    """Whether this build's Subscriber.pull takes zero_copy (shared-memory publication)."""
    import inspect

    from tensordict_cpp import Subscriber

    return "zero_copy" in inspect.signature(Subscriber.pull).parameters


def versions_in(batch):
    return sorted(set(batch["next", "policy_version"].flatten().tolist()))


def check_sync():
    import torch
    from torchrl.collectors import MultiSyncCollector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from tensordict_cpp.torchrl import TensorDictCppWeightSyncScheme

    policy = make_policy(0)
    scheme = TensorDictCppWeightSyncScheme(timeout=30, connect_timeout=90)
    t0 = time.perf_counter()
    collector = MultiSyncCollector(
        [ContinuousActionVecMockEnv] * 2, policy, frames_per_batch=20, total_frames=-1,
        weight_sync_schemes={"policy": scheme}, cat_results="stack", track_policy_version=True)
    report(step="collector", seconds=round(time.perf_counter() - t0, 2))
    try:
        assert collector.policy is policy
        assert not any(p.is_shared() for p in policy.parameters()), \
            "the trainer's parameters were moved to shared memory"
        assert scheme.version == 1, scheme.version  # connect() published the initial weights
        # send() reads the trainer's policy with ours (torchrl's extraction would return just
        # TensorDict.from_module of it), with no reference TensorDict to convert.
        assert scheme._model_to_read(None) is policy
        assert scheme._model_to_read(policy) is policy
        it = iter(collector)
        versions = []

        def batch():
            b = next(it)
            versions.append(versions_in(b))
            return b

        e0 = action_error(policy, batch())
        assert e0 < 1e-5, f"first batch: not the trainer's initial weights ({e0})"

        # In place, no update: a worker that saw this would share the trainer's memory.
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p))
        e_inplace = action_error(policy, batch())
        assert e_inplace > 1e-2, f"in-place change reached the workers without an update " \
                                 f"({e_inplace}): they share the trainer's memory"
        t1 = time.perf_counter()
        collector.update_policy_weights_()
        update_ms = (time.perf_counter() - t1) * 1e3
        assert scheme.version == 2 and scheme.worker_versions() == {0: 2, 1: 2}, \
            (scheme.version, scheme.worker_versions())
        e_update = action_error(policy, batch())
        assert e_update < 1e-5, f"after update_policy_weights_(): {e_update}"

        # Storages replaced, no update: stale; then the update.
        with torch.no_grad():
            for p in policy.parameters():
                p.data = torch.randn_like(p)
        e_swap = action_error(policy, batch())
        assert e_swap > 1e-2, f"a storage swap reached the workers without an update ({e_swap})"
        collector.update_policy_weights_()
        e_swap_update = action_error(policy, batch())
        assert e_swap_update < 1e-5, f"after the storage swap and update: {e_swap_update}"

        with torch.no_grad():
            for p in policy.parameters():
                p.data = torch.randn_like(p)
        collector.update_policy_weights_(policy)
        e_explicit = action_error(policy, batch())
        assert e_explicit < 1e-5, f"after update_policy_weights_(policy): {e_explicit}"

        assert not any(p.is_shared() for p in policy.parameters())
        worker_side = collector.get_distant_attr("_receiver_schemes['policy'].version")
        direct = collector.get_distant_attr("_receiver_schemes['policy']._direct")
        route = collector.get_distant_attr("_receiver_schemes['policy']._cascade_route")
        zero_copy = collector.get_distant_attr("_receiver_schemes['policy']._zero_copy")
        worker_policy_versions = collector.get_distant_attr("policy_version")
        report(step="checks", errors=dict(initial=e0, inplace_no_update=e_inplace,
                                          after_update=e_update, swap_no_update=e_swap,
                                          after_swap_update=e_swap_update,
                                          explicit=e_explicit),
               update_ms=round(update_ms, 2), trainer_version=scheme.version,
               worker_versions=scheme.worker_versions(), worker_scheme_versions=worker_side,
               worker_direct=direct, worker_cascade_route=route, worker_zero_copy=zero_copy,
               zero_copy_available=zero_copy_available(),
               worker_policy_versions=worker_policy_versions,
               batch_policy_versions=versions, stats=scheme.stats())
        assert scheme.version == 4, scheme.version  # initial + 3 updates
        assert worker_side == [4, 4], worker_side
        assert scheme.worker_versions() == {0: 4, 1: 4}, scheme.worker_versions()
        assert direct == [True, True], direct  # pulls land in the live Parameters
        # The worker's collector only bumps its policy_version: no copy of the policy onto
        # itself after each pull.
        assert route == ["increment_version"] * 2, route
        # Zero-copy pulls where the build has them (the workers share this host), else copies.
        assert zero_copy == [zero_copy_available()] * 2, zero_copy
        assert worker_policy_versions == [3, 3], worker_policy_versions
        assert versions == [[0], [0], [1], [1], [2], [3]], versions
        assert all(s["version"] == 4 and not s["lost"] for s in scheme.stats()), scheme.stats()
    finally:
        collector.shutdown()
        scheme.shutdown()
    # The workers stop their receiver threads at exit (no C++ wait outlives the interpreter).
    exitcodes = [p.exitcode for p in collector.procs]
    report(step="shutdown", exitcodes=exitcodes, version_after=scheme.version)
    assert exitcodes == [0, 0], exitcodes
    assert scheme.version == 4  # still readable after shutdown


def check_async():
    import torch
    from torchrl.collectors import MultiAsyncCollector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from tensordict_cpp.torchrl import TensorDictCppWeightSyncScheme

    policy = make_policy(0)
    scheme = TensorDictCppWeightSyncScheme(timeout=30, connect_timeout=90)
    collector = MultiAsyncCollector(
        [ContinuousActionVecMockEnv] * 2, policy, frames_per_batch=10, total_frames=-1,
        weight_sync_schemes={"policy": scheme}, track_policy_version=True)
    try:
        it = iter(collector)
        b = next(it)
        assert action_error(policy, b) < 1e-5
        skipped = []  # per update: batches collected (partly) before it
        for update in range(1, 4):
            with torch.no_grad():
                for p in policy.parameters():
                    p.data = torch.randn_like(p)
            collector.update_policy_weights_()
            assert scheme.worker_versions() == {0: update + 1, 1: update + 1}
            # Batches in flight were collected (at least partly) before the update, and the
            # first step a worker takes after it may have computed its action just before
            # the version bump: in the next batches that carry the new policy_version at every
            # step, every step but the first holds the new weights.
            fresh = stale = 0
            deadline = time.monotonic() + 30
            while fresh < 2:
                assert time.monotonic() < deadline, "no batch collected after the update"
                b = next(it)
                if versions_in(b) == [update]:
                    err = action_error(policy, b[1:])
                    assert err < 1e-5, f"update {update}: a fresh batch with old weights ({err})"
                    fresh += 1
                else:
                    stale += 1
            skipped.append(stale)
        report(step="async", trainer_version=scheme.version,
               worker_versions=scheme.worker_versions(), batch_shape=list(b.shape),
               skipped=skipped)
        assert scheme.version == 4
    finally:
        collector.shutdown()
        scheme.shutdown()


def state(pid):
    """The process's state from /proc ("T (stopped)", "S (sleeping)", ...)."""
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("State:"))


def check_stall():
    import signal

    from torchrl.collectors import MultiSyncCollector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from tensordict_cpp import errors
    from tensordict_cpp.torchrl import TensorDictCppWeightSyncScheme

    policy = make_policy(0)
    scheme = TensorDictCppWeightSyncScheme(timeout=2, connect_timeout=90)
    collector = MultiSyncCollector(
        [ContinuousActionVecMockEnv] * 2, policy, frames_per_batch=20, total_frames=-1,
        weight_sync_schemes={"policy": scheme})
    stopped = collector.procs[1].pid
    try:
        it = iter(collector)
        next(it)
        collector.update_policy_weights_()
        assert scheme.worker_versions() == {0: 2, 1: 2}, scheme.worker_versions()
        os.kill(stopped, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not state(stopped).startswith("T"):  # the signal is delivered asynchronously
            assert time.monotonic() < deadline, state(stopped)
            time.sleep(0.001)
        t0 = time.monotonic()
        try:
            collector.update_policy_weights_()
        except errors.TimeoutError as e:
            message = str(e)
        else:
            raise AssertionError(f"update_policy_weights_ returned with worker 1 stopped "
                                 f"({state(stopped)}): {scheme.worker_versions()}")
        waited = time.monotonic() - t0
        applied = scheme.worker_versions()
        os.kill(stopped, signal.SIGCONT)
        t1 = time.monotonic()
        scheme.wait_for_workers(3, timeout=30)
        resumed = time.monotonic() - t1
        collector.update_policy_weights_()
        report(step="stall", message=message, waited_s=round(waited, 3), applied=applied,
               resumed_s=round(resumed, 3), after=scheme.worker_versions())
        assert "workers [1]" in message and "version 3" in message and "{1: 2}" in message, \
            message
        assert 2 <= waited < 4, waited  # the scheme's timeout, not more
        assert applied == {0: 3, 1: 2}, applied  # the running worker took it meanwhile
        assert scheme.worker_versions() == {0: 4, 1: 4}, scheme.worker_versions()
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
        collector.shutdown()
        scheme.shutdown()


def main():
    watchdog = threading.Timer(TIMEOUT, lambda: (report(error="watchdog"), os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    # `import tensordict_cpp` alone must not import torchrl.
    import tensordict_cpp

    assert "torchrl" not in sys.modules, "import tensordict_cpp imported torchrl"
    import tensordict
    import torchrl

    assert tensordict.__version__ == "0.14.3", tensordict.__file__
    assert torchrl.__version__ == "0.14.1", torchrl.__file__
    report(step="imports", tensordict=tensordict.__file__, tensordict_cpp=tensordict_cpp.__file__)
    t0 = time.perf_counter()
    {"sync": check_sync, "async": check_async, "stall": check_stall}[MODE]()
    report(ok=True, mode=MODE, seconds=round(time.perf_counter() - t0, 2))


if __name__ == "__main__":
    main()
