"""Publisher and Subscriber from Python (docs/publication.md), on real processes over Gloo:
versions to several subscribers at once (a new TensorDict, in place, a live module's
TensorDictParams, polls), tensorclasses, lazy stacks and non-tensor entries, timeouts that
return None and keep the group, a subscriber stopped mid-pull that costs the others nothing,
and the reference tensordict on the other rank, named and unharmed. Readiness travels on a tag
of its own, so that no step depends on timing."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import conftest
from tensordict_cpp.distributed import run

READY = conftest.READY


ready, await_ready = conftest.ready, conftest.await_ready


def weights(v):
    from tensordict_cpp import TensorDict
    td = TensorDict(bias=torch.full((3,), float(v)), steps=torch.full((2,), v), batch_size=[])
    td["layer", "w"] = torch.full((8, 3), float(v), dtype=torch.float64)
    return td


def holds(td, v):
    return all((leaf == v).all() for leaf in td.values(include_nested=True, leaves_only=True))


def policy(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def fan_out(rank, world_size):
    # Two publications on one group: a module's parameters on channel 0 (to rank 2), plain
    # weights on channel 1 (to ranks 1 and 3).
    torch.set_num_threads(1)
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    last = 30
    if rank == 0:
        params = Publisher(subscribers=[2], channel=0)
        plain = Publisher(max_slots=2, subscribers=[1, 3], channel=1)
        assert params.epoch != plain.epoch and plain.epoch != 0 and plain.version == 0
        net = policy(0)
        for v in range(1, last + 1):
            with torch.no_grad():  # version v: the weights of policy(v)
                for p, q in zip(net.parameters(), policy(v).parameters()):
                    p.copy_(q)
            assert params.publish(TensorDict.from_module(net)) == v
            assert plain.publish(weights(v)) == v
            time.sleep(0.005)
        for r in (1, 2, 3):
            await_ready(r)
        stats = {s["rank"]: s for pub in (params, plain) for s in pub.stats()}
        assert set(stats) == {1, 2, 3}
        for r, s in stats.items():
            assert s["version"] == last and s["pulls"] >= 1, s
            assert not s["lost"] and s["error"] is None and s["pinned"] is None, s
        params.close()
        plain.close()
        for r in (1, 2, 3):
            ready(r)
    elif rank == 2:  # a live module's parameters, updated in place
        sub = Subscriber(src=0, channel=0)
        net = policy(1000)
        params = TensorDict.from_module(net, as_module=True)
        ids = [id(p) for p in net.parameters()]
        x = torch.randn(5, 4)
        seen = 0
        while seen < last:
            v = sub.pull(params, timeout=20)
            assert v is not None and v > seen
            torch.testing.assert_close(net(x), policy(v)(x))  # one whole version
            seen = v
        assert [id(p) for p in net.parameters()] == ids
        assert sub.pull(params, timeout=0.3) is None
        torch.testing.assert_close(net(x), policy(last)(x))
        ready(0)
        await_ready(0)
    else:
        sub = Subscriber(src=0, channel=1)
        if rank == 1:  # a new TensorDict, then in place
            td = sub.pull(timeout=20)
            assert isinstance(td, TensorDict) and holds(td, sub.version)
            storage = td["layer", "w"].data_ptr()
            while sub.version < last:
                seen = sub.version
                v = sub.pull(td, timeout=20)
                assert v is not None and v > seen and holds(td, v)
            assert td["layer", "w"].data_ptr() == storage
        else:  # polls
            td = None
            while td is None:
                td = sub.pull(timeout=0)
                time.sleep(0.001)
            while sub.version < last:
                v = sub.pull(td, timeout=0)
                if v is None:
                    time.sleep(0.001)
                else:
                    assert holds(td, v)
        # Nothing newer: None after the timeout, td unchanged, the group usable.
        t0 = time.monotonic()
        assert sub.pull(td, timeout=0.3) is None
        assert time.monotonic() - t0 < 3
        assert holds(td, last)
        ready(0)
        await_ready(0)
    t = torch.full((2,), 1.0)
    dist.all_reduce(t)
    assert t.tolist() == [4.0, 4.0]


def test_one_publisher_and_three_subscribers_of_every_kind():
    run(fan_out, world_size=4, timeout=180, group_timeout=30)


def classes(rank, world_size):
    torch.set_num_threads(1)
    import tensordict_cpp as tdc
    from tensordict_cpp import Publisher, Subscriber, TensorDict, tensorclass

    @tensorclass
    class Batch:
        obs: torch.Tensor
        reward: torch.Tensor

    if rank == 0:
        with pytest.raises(ValueError, match="max_slots must be at least 1"):
            Publisher(max_slots=0)
        with pytest.raises(ValueError, match="channel must be in"):
            Publisher(channel=70000)
        with pytest.raises(ValueError, match="this process's own"):
            Subscriber(src=0)
        pub = Publisher()
        with pytest.raises(TypeError, match="publish: expected a TensorDict"):
            pub.publish(5)
        with pytest.raises(TypeError, match="timeout must be a number"):
            pub.publish(weights(0), timeout="soon")
        pub.publish(Batch(obs=torch.full((4, 3), 1.0), reward=torch.full((4,), 1.0),
                          batch_size=[4]))
        await_ready(1)
        pub.publish(Batch(obs=torch.full((4, 3), 2.0), reward=torch.full((4,), 2.0),
                          batch_size=[4]))
        await_ready(1)
        stack = tdc.lazy_stack([weights(3), weights(3)])
        pub.publish(stack)
        await_ready(1)
        td = weights(4)
        td["note"] = "four"
        pub.publish(td)
        await_ready(1)
        pub.close()
    else:
        sub = Subscriber(src=0)
        with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
            sub.pull(timeout=-1)
        b = sub.pull(timeout=20)
        assert type(b).__name__ == "Batch" and (b.obs == 1).all()
        ready(0)
        assert sub.pull(b, timeout=20) == 2
        assert (b.obs == 2).all() and (b.reward == 2).all()
        ready(0)
        s = sub.pull(timeout=20)
        assert isinstance(s, tdc.LazyStackedTensorDict) and holds(s, 3)
        ready(0)
        n = sub.pull(timeout=20)
        assert n["note"] == "four" and holds(n.exclude("note"), 4)
        ready(0)


def test_tensorclasses_lazy_stacks_and_non_tensor_entries():
    run(classes, world_size=2, timeout=120, group_timeout=30)


def until(predicate, seconds=10.0):
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.005)


def stopped(rank, world_size):
    # Rank 2 asks for a version, is stopped (SIGSTOP), and then version 1 (32 MiB) is sent to
    # it: mid-pull, it pins that slot. publish never waits (two slots), rank 1 goes on pulling
    # every version; once rank 2 goes on, its pull completes with one whole version. Over the
    # socket (a stopped subscriber over shared memory: tests/cpp/shm_fault_test.cpp).
    torch.set_num_threads(1)
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    n = 8 << 20
    if rank == 0:
        pub = Publisher(max_slots=2, transport="socket")
        td = TensorDict(a=torch.full((n,), 1.0), batch_size=[])
        pid = torch.zeros(1, dtype=torch.int64)
        dist.recv(pid, src=2, tag=READY + 1)
        stats = lambda: {s["rank"]: s for s in pub.stats()}  # noqa: E731
        until(lambda: stats()[2]["waiting"])
        os.kill(int(pid), signal.SIGSTOP)
        try:
            pub.publish(td)
            until(lambda: stats()[2]["pinned"] == 1)
            times = []
            for v in range(2, 12):
                td["a"].fill_(v)
                t0 = time.monotonic()
                pub.publish(td, timeout=10)
                times.append(time.monotonic() - t0)
                await_ready(1)  # rank 1 pulled version v
            assert max(times) < 2.0, times
            # Rank 1's version is the publisher's view, a moment behind its pull's return.
            until(lambda: stats()[1]["version"] == 11)
            assert stats()[2]["pinned"] == 1
        finally:
            os.kill(int(pid), signal.SIGCONT)
        ready(2)
        await_ready(2)
        until(lambda: stats()[2]["version"] == 11)
        pub.close()
    elif rank == 1:
        sub = Subscriber(src=0)
        td = sub.pull(timeout=30)
        for v in range(2, 12):
            got = sub.pull(td, timeout=30, min_version=v)
            assert got == v and (td["a"] == v).all()
            ready(0)
    else:
        sub = Subscriber(src=0, transport="socket")
        dist.send(torch.tensor([os.getpid()]), dst=0, tag=READY + 1)
        td = sub.pull(timeout=60)  # stopped in here
        assert sub.version == 1 and (td["a"] == 1).all()  # one whole version
        await_ready(0)
        assert sub.pull(td, timeout=30) == 11 and (td["a"] == 11).all()
        ready(0)


def test_a_subscriber_stopped_mid_pull_costs_the_others_nothing():
    run(stopped, world_size=3, timeout=180, group_timeout=60)


REF, OURS = 0, 1


def with_reference(rank, world_size):
    # Rank 0 runs the reference tensordict, which has no Publisher or Subscriber: each side of
    # ours names it within the call's timeout, and the group goes on.
    torch.set_num_threads(1)
    from tensordict_cpp import errors
    if rank == REF:
        from tensordict import TensorDict
        await_ready(OURS)
        td = TensorDict(a=torch.full((3,), 5.0), batch_size=[3])
        td.send(dst=OURS)
        td.recv(src=OURS)
        assert (td["a"] == 6).all()
    else:
        from tensordict_cpp import Publisher, Subscriber, TensorDict
        sub = Subscriber(src=REF)
        mine = TensorDict(a=torch.zeros(3), batch_size=[3])
        t0 = time.monotonic()
        with pytest.raises(errors.NoPublisherError, match="rank 0.*reference tensordict"):
            sub.pull(mine, timeout=0.5)
        assert time.monotonic() - t0 < 3
        assert (mine["a"] == 0).all()
        pub = Publisher(subscribers=[REF])
        with pytest.raises(errors.TimeoutError, match="rank.*0.*reference tensordict"):
            pub.wait_for_subscribers(timeout=0.5)
        # The pipe's arguments too: count= of the subscribers (none needed: at once).
        pub.wait_for_subscribers(0.5, count=0)
        with pytest.raises(ValueError, match="count is 2, above the 1 subscribers"):
            pub.wait_for_subscribers(0.5, count=2)
        assert pub.publish(mine) == 1  # never waits for a subscriber
        assert pub.stats()[0]["version"] is None
        pub.close()
        ready(REF)
        mine.recv(src=REF, timeout=20)
        assert (mine["a"] == 5).all()
        mine["a"] += 1
        mine.send(dst=REF)
    dist.barrier()


def test_a_reference_peer_is_named_and_the_group_lives():
    run(with_reference, world_size=2, timeout=120, group_timeout=20)




def test_the_example_python_trainer_and_cpp_workers():
    # examples/policy_trainer.py publishes its policy; three examples/policy_worker.cpp
    # processes pull each version into their torch::nn::Module and report its output.
    import subprocess
    import sys

    from conftest import ROOT, built
    worker = built("policy_worker")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "policy_trainer.py"),
                           "--worker", str(worker), "--workers", "3"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 workers ran" in proc.stdout and "acknowledged: [20, 20, 20] of 20" in proc.stdout


def groups(rank, world_size):
    # A registered subgroup (ranks 0 and 2: group ranks 0 and 1) and a standalone Gloo group
    # on a store of its own (ranks 1 and 2), each carrying a publication.
    torch.set_num_threads(1)
    from datetime import timedelta

    from tensordict_cpp import Publisher, Subscriber
    sub_group = dist.new_group([0, 2])
    store = dist.TCPStore("127.0.0.1", int(os.environ["TD_TEST_PORT"]), 2, rank == 1,
                          timeout=timedelta(seconds=30)) if rank in (1, 2) else None
    alone = (dist.ProcessGroupGloo(store, rank - 1, 2, timedelta(seconds=30))
             if store is not None else None)
    if rank == 0:
        pub = Publisher(sub_group, subscribers=[2])  # global ranks
        assert [s["rank"] for s in pub.stats()] == [1]  # its rank in the subgroup
        pub.publish(weights(4))
        await_ready(2)
        pub.close()
    elif rank == 1:
        pub = Publisher(alone)  # the standalone group's other rank
        pub.publish(weights(5))
        await_ready(2)
        pub.close()
    else:
        td = Subscriber(src=0, group=sub_group).pull(timeout=20)
        assert holds(td, 4)
        td = Subscriber(src=0, group=alone).pull(timeout=20)  # rank 0 of the standalone group
        assert holds(td, 5)
        ready(0)
        ready(1)
    dist.barrier()


def test_a_registered_subgroup_and_a_standalone_group(monkeypatch):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("TD_TEST_PORT", str(s.getsockname()[1]))
    run(groups, world_size=3, timeout=120, group_timeout=30)
