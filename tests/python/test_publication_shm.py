"""Publication over shared memory from Python (docs/publication.md "Shared memory"): over a
TensorDictServer's pipes to subscriber processes (tests/python/shm_publication_peers.py) by copy
and zero-copy into a live module, mixed with one forced onto its socket and one that cannot map
(and says why); a write into a zero-copy view kills only its writer; and over Gloo, ranks
pulling by copy and zero-copy while the publisher publishes back to back, never torn."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import conftest
from tensordict_cpp.distributed import run

PEERS = pathlib.Path(__file__).with_name("shm_publication_peers.py")
ENV = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n",
       "OMP_NUM_THREADS": "1"}
os.environ.update({k: ENV[k] for k in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_WARN_UNUSED_ENV_VARS")})

watchdog = conftest.watchdog(240)


def version(v):
    from tensordict_cpp import TensorDict
    net = torch.nn.Linear(64, 64)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float(v))
    return TensorDict.from_module(net)


class Peer:
    def __init__(self, role, port, last, transport="auto", env=None):
        self.proc = subprocess.Popen(
            [sys.executable, str(PEERS), role, str(port), str(last), transport],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})

    def lines(self, timeout=90.0):
        out, err = self.proc.communicate(timeout=timeout)
        return [json.loads(t) for t in out.splitlines() if t.startswith("{")], err


def test_pipe_subscribers_by_copy_zero_copy_socket_and_unmappable():
    from tensordict_cpp import Publisher, TensorDictServer
    last = 3000
    with TensorDictServer(0, timeout=30.0) as server:
        pub = Publisher(server, max_slots=4)
        pub.publish(version(1))
        peers = [Peer("copy", server.port, last), Peer("zero", server.port, last),
                 Peer("copy", server.port, last, transport="socket"),
                 Peer("copy", server.port, last,
                      env={"TENSORDICT_TEST_SHM_UNMAPPABLE": "1"})]
        pub.wait_for_subscribers(60, count=4)
        for v in range(2, last + 1):  # back to back
            pub.publish(version(v), timeout=10)
        results = [p.lines() for p in peers]
        for lines, err in results:
            assert lines, err[-3000:]
        said = [lines[-1] for lines, _ in results]
        assert [s["torn"] for s in said] == [0, 0, 0, 0], said
        assert all(s["version"] == last for s in said), said
        assert [s["transport"] for s in said] == [
            "shm", "shm", "socket",
            "socket (shared memory refused: TENSORDICT_TEST_SHM_UNMAPPABLE is set (a test hook))"]
        transports = sorted(s["transport"] for s in pub.stats())
        assert transports == sorted([
            "shm", "shm", "socket",
            "socket (shared memory refused: the subscriber could not open or map the segments)"])
        print(f"\n[shm] pulls by copy / zero-copy / socket / unmappable: "
              f"{[s['pulls'] for s in said]} of {last} versions, 0 torn")
        pub.close()


def test_a_write_into_a_zero_copy_view_kills_only_the_writer():
    from tensordict_cpp import Publisher, TensorDictServer
    with TensorDictServer(0, timeout=30.0) as server:
        pub = Publisher(server, max_slots=2)
        pub.publish(version(1))
        writer = Peer("write", server.port, 1)
        lines, err = writer.lines()
        assert writer.proc.returncode == -signal.SIGSEGV, (writer.proc.returncode, err[-2000:])
        assert lines == [{"pulled": 1, "transport": "shm"}], lines  # never "wrote"
        # What it viewed is what everyone reads, untouched: a reader takes version 1 whole.
        reader = Peer("copy", server.port, 2)
        time.sleep(0.5)
        pub.publish(version(2))
        lines, err = reader.lines()
        assert lines and lines[-1] == {"transport": "shm", "pulls": 2, "torn": 0, "version": 2} \
            or (lines and lines[-1]["torn"] == 0 and lines[-1]["version"] == 2), err[-2000:]
        pub.close()


def test_stopped_and_killed_pipe_subscribers_cost_only_their_slots():
    from tensordict_cpp import Publisher, TensorDictServer
    shm_before = {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")}
    with TensorDictServer(0, timeout=30.0) as server:
        pub = Publisher(server, max_slots=3)
        pub.publish(version(1))
        peers = []
        for _ in range(2):  # one after the other: stats() lists them in that order
            peers.append(Peer("hold", server.port, 1))
            line = json.loads(peers[-1].proc.stdout.readline())
            assert line == {"pulled": 1, "transport": "shm"}, line
        stopped, killed = peers
        pinned = lambda: [s["pinned"] for s in pub.stats()]  # noqa: E731
        assert pinned() == [1, 1]
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        os.kill(killed.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while pinned()[1] is not None:
            assert time.monotonic() - t0 < 5, pub.stats()
            time.sleep(0.0005)
        freed_ms = (time.monotonic() - t0) * 1000
        # Version 1's slot pinned by the stopped one: publish goes on in the other two.
        times = []
        for v in range(2, 50):
            t = time.monotonic()
            pub.publish(version(v), timeout=5)
            times.append(time.monotonic() - t)
        stats = pub.stats()
        assert stats[0]["pinned"] == 1 and stats[1]["lost"], stats
        print(f"\n[shm] over the pipe: a killed subscriber's pin freed after {freed_ms:.1f} ms; "
              f"publish max {max(times) * 1000:.2f} ms with one stopped")
        assert freed_ms < 250  # the goal 100 ms, measured ~30; slack for a loaded machine
        os.kill(stopped.proc.pid, signal.SIGKILL)
        stopped.proc.wait(10)
        killed.proc.wait(10)
        pub.close()
    assert {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")} == shm_before


def test_transport_arguments_are_checked():
    from tensordict_cpp import Publisher, Subscriber, TensorDictPipe, TensorDictServer
    with TensorDictServer(0, timeout=10.0) as server:
        with pytest.raises(ValueError, match="transport must be"):
            Publisher(server, transport="tcp")
        pub = Publisher(server)
        pipe = TensorDictPipe.connect_sync("127.0.0.1", server.port, timeout=10)
        with pytest.raises(ValueError, match="transport must be"):
            Subscriber(pipe, transport="udp")
        sub = Subscriber(pipe)  # the refused one left the pipe as it was
        assert sub.transport == "socket"  # until its first pull asks
        pub.publish(version(1))
        assert sub.pull(timeout=10) is not None and sub.transport == "shm"
        pub.close()




ready, await_ready = conftest.ready, conftest.await_ready


def back_to_back(rank, world_size):
    torch.set_num_threads(1)
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    last = 5000
    if rank == 0:
        pub = Publisher(max_slots=4)
        for v in range(1, last + 1):
            pub.publish(version(v), timeout=10)
        for r in (1, 2, 3):
            await_ready(r)
        # The socket one's version is the publisher's view: its serving thread may see the last
        # send complete a moment after the subscriber's pull returned (docs/publication.md).
        end = time.monotonic() + 10
        while any(s["version"] != last for s in pub.stats()) and time.monotonic() < end:
            time.sleep(0.005)
        stats = pub.stats()
        assert [s["transport"] for s in stats] == ["shm", "shm", "socket"], stats
        assert all(s["version"] == last and not s["lost"] for s in stats), stats
        pub.close()
        for r in (1, 2, 3):
            ready(r)
        return
    sub = Subscriber(src=0, transport="socket" if rank == 3 else "auto")
    net = torch.nn.Linear(64, 64)
    params = TensorDict.from_module(net, as_module=True)
    pulls = torn = 0
    while sub.version < last:
        v = sub.pull(params, timeout=30, zero_copy=rank == 2)
        assert v is not None
        torn += not all(bool((p == v).all()) for p in net.parameters())
        pulls += 1
    assert torn == 0, torn
    assert sub.transport == ("socket" if rank == 3 else "shm")
    print(f"[shm] rank {rank} ({sub.transport}{', zero-copy' if rank == 2 else ''}): "
          f"{pulls} pulls, 0 torn", flush=True)
    ready(0)
    await_ready(0)


def test_gloo_ranks_by_copy_and_zero_copy_never_torn():
    run(back_to_back, world_size=4, timeout=180, group_timeout=60)
