"""Publisher and Subscriber over the pipe (docs/publication.md), each subscriber a process of its
own (tests/python/pipe_publication_peers.py): a TensorDictServer's Publisher serving a new
TensorDict then in place, a live module's TensorDictParams, polls, and a tensorclass with a
lazy stack and non-tensor entries; timeouts that return None and keep the pipe; the publisher's
close; apull from an event loop that a stopped publisher never holds, cancelled without
touching its TensorDict; ``async for`` over the updates; and the reference's pipe on either
side, named."""
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

import conftest

PEERS = pathlib.Path(__file__).with_name("pipe_publication_peers.py")
ENV = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n",
       "OMP_NUM_THREADS": "1"}
os.environ.update({k: ENV[k] for k in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_WARN_UNUSED_ENV_VARS")})
sys.path.insert(0, str(PEERS.parent))

watchdog = conftest.watchdog(240)


class Peer:
    """A peers process, its JSON lines read as they come."""

    def __init__(self, role, port=0, arg=None):
        args = [sys.executable, str(PEERS), role, str(port)] + ([] if arg is None else [str(arg)])
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=ENV, text=True)

    def line(self, timeout=90.0):
        """The next JSON line (UCX's own warnings, on stdout too, are skipped)."""
        import select
        end = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], end - time.monotonic())
            assert ready, f"no line from the peer in {timeout} s"
            text = self.proc.stdout.readline()
            assert text, f"the peer ended: {self.proc.stderr.read()[-3000:]}"
            if text.startswith("{"):
                return json.loads(text)

    def finish(self, timeout=60.0):
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, err[-3000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def weights(v):
    from tensordict_cpp import TensorDict
    td = TensorDict(bias=torch.full((3,), float(v)), steps=torch.full((2,), v), batch_size=[])
    td["layer", "w"] = torch.full((8, 3), float(v), dtype=torch.float64)
    return td


def test_versions_to_four_subscriber_processes():
    import pipe_publication_peers as peers
    import tensordict_cpp as tdc
    from tensordict_cpp import Publisher, TensorDict, TensorDictServer

    last = 25
    with TensorDictServer(0, timeout=30.0) as server:
        # Publications of two structures need two servers: one of plain weights, one of a
        # policy's parameters, one of tensorclasses.
        with TensorDictServer(0, timeout=30.0) as params_server, \
                TensorDictServer(0, timeout=30.0) as classes_server:
            pub = Publisher(server, max_slots=2)
            params = Publisher(params_server)
            classes = Publisher(classes_server)
            assert len({pub.epoch, params.epoch, classes.epoch}) == 3 and pub.version == 0
            subs = [Peer("sub-new", server.port, last), Peer("sub-poll", server.port, last),
                    Peer("sub-params", params_server.port, last),
                    Peer("sub-classes", classes_server.port, last)]
            pub.wait_for_subscribers(60, count=2)
            params.wait_for_subscribers(60, count=1)
            classes.wait_for_subscribers(60, count=1)
            net = peers.policy(0)
            for v in range(1, last + 1):
                with torch.no_grad():
                    for p, q in zip(net.parameters(), peers.policy(v).parameters()):
                        p.copy_(q)
                assert params.publish(TensorDict.from_module(net)) == v
                assert pub.publish(weights(v)) == v
                assert classes.publish(peers.classes_version(tdc, v)) == v
                time.sleep(0.01)
            reports = [s.line() for s in subs]
            for report in reports:
                assert report["seen"][-1] == last and report["seen"] == sorted(report["seen"])
                assert report["none"] and report["waited"] < 3, report
            stats = pub.stats() + params.stats() + classes.stats()
            assert len(stats) == 4
            for s in stats:  # acknowledged, with no extra message
                assert s["version"] == last and not s["lost"] and s["error"] is None, s
                assert s["rank"] is None and s["peer"].startswith("127.0.0.1:"), s
            for p in (pub, params, classes):
                p.close()
            for s in subs:
                assert s.line() == {"end": "closed"}
                s.finish()


def test_arguments_and_a_pipe_that_carries_a_publication():
    from tensordict_cpp import Publisher, Subscriber, TensorDictPipe, TensorDictServer, errors
    with TensorDictServer(0, timeout=10.0) as server:
        with pytest.raises(ValueError, match="server.s publisher takes no channel"):
            Publisher(server, channel=3)
        pub = Publisher(server=server)
        with pytest.raises(ValueError, match="needs count="):
            pub.wait_for_subscribers(1)
        with pytest.raises(errors.TimeoutError, match="never connected"):
            pub.wait_for_subscribers(0.2, count=1)
        pub.publish(weights(1))
        pipe = TensorDictPipe.connect_sync("127.0.0.1", server.port, timeout=10.0)
        with pytest.raises(ValueError, match="pipe.s subscriber takes no channel"):
            Subscriber(pipe, channel=1)
        sub = Subscriber(pipe=pipe)
        td = sub.pull(timeout=10)
        assert sub.version == 1 and bool((td["bias"] == 1).all())
        with pytest.raises(RuntimeError, match="carries a publication"):
            pipe.send(weights(2))
        with pytest.raises(RuntimeError, match="carries a publication"):
            pipe.recv()
        assert sub.pull(td, timeout=0) is None  # the pipe still pulls
        pub.publish(weights(2))
        assert sub.pull(td, timeout=10) == 2 and bool((td["bias"] == 2).all())
        pipe.close()


def test_apull_never_holds_the_loop_and_a_cancelled_one_leaves_its_tensordict():
    # The publisher is a process of its own, publishing 64 MiB versions; this process pulls
    # from an event loop whose ticker must never stall, and the publisher is stopped (SIGSTOP)
    # in the middle of it all.
    from tensordict_cpp import Subscriber, TensorDictPipe
    publisher = Peer("publisher", 0, 64)
    try:
        port = publisher.line()["port"]

        async def main():
            gaps, stop = [], asyncio.Event()

            async def ticker():
                last = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(0.005)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.ensure_future(ticker())
            pipe = await TensorDictPipe.connect("127.0.0.1", port, timeout=20.0)
            sub = Subscriber(pipe)
            td = await sub.apull(timeout=20)
            versions = [sub.version]
            for _ in range(5):
                v = await sub.apull(td, timeout=20)
                assert v is not None and v > versions[-1]
                assert float(td["x"][0]) == v and float(td["x"][-1]) == v  # whole
                versions.append(v)
            # A stopped publisher: the pull times out, the loop goes on, td unchanged.
            os.kill(publisher.proc.pid, signal.SIGSTOP)
            await asyncio.sleep(0.2)  # whatever it was sending has landed or stays stuck
            t0 = time.monotonic()
            held = td["x"].clone()
            got = await sub.apull(td, timeout=0.5)
            if got is not None:  # a version that was under way when it stopped
                held = td["x"].clone()
                got = await sub.apull(td, timeout=0.5)
            assert got is None and time.monotonic() - t0 < 3
            assert torch.equal(td["x"], held)
            # Cancelled while it waits: CancelledError within a slice, td never written.
            task = asyncio.ensure_future(sub.apull(td))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - t0 < 1.0
            os.kill(publisher.proc.pid, signal.SIGCONT)
            await asyncio.sleep(0.3)
            assert torch.equal(td["x"], held)
            v = await sub.apull(td, timeout=20)  # the next pull is whole
            assert v is not None and float(td["x"][0]) == v and float(td["x"][-1]) == v
            stop.set()
            await tick
            pipe.close()
            return max(gaps)

        worst = asyncio.run(asyncio.wait_for(main(), 120))
        assert worst < 0.25, f"the event loop stalled {worst * 1000:.0f} ms"
    finally:
        os.kill(publisher.proc.pid, signal.SIGCONT)
        publisher.kill()


def test_async_for_updates_ends_when_the_publisher_closes():
    from tensordict_cpp import Publisher, Subscriber, TensorDictPipe, TensorDictServer

    async def main():
        server = TensorDictServer(0, timeout=20.0)
        pub = Publisher(server)
        pub.publish(weights(1))
        pipe = await TensorDictPipe.connect("127.0.0.1", server.port, timeout=20.0)
        sub = Subscriber(pipe)
        td = await sub.apull(timeout=10)

        async def trainer():
            for v in range(2, 6):
                await asyncio.sleep(0.05)
                await asyncio.to_thread(pub.publish, weights(v))
            while pub.stats()[0]["version"] != 5:
                await asyncio.sleep(0.01)
            pub.close()

        training = asyncio.ensure_future(trainer())
        seen = [v async for v in sub.updates(td)]
        await training
        assert seen == sorted(seen) and seen[-1] == 5 and bool((td["bias"] == 5).all())
        assert sub.publisher_closed
        pipe.close()
        server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_references_pipe_on_either_side_is_named():
    pytest.importorskip("ucxx", reason="the reference pipe needs ucxx (scripts/setup installs it)")
    from tensordict_cpp import Publisher, Subscriber, TensorDictPipe, TensorDictServer
    from tensordict_cpp.errors import NoPublisherError
    # A reference client of our publishing server: recorded as lost, by name; its pipe closed.
    with TensorDictServer(0, timeout=20.0) as server:
        pub = Publisher(server)
        pub.publish(weights(1))
        client = Peer("ref-client", server.port)
        assert client.line() == {"connected": True}
        end = client.line()["end"]
        assert "received" not in end, end
        client.finish()
        (s,) = pub.stats()
        assert s["lost"] and "not a tensordict_cpp peer" in s["error"], s
        # A subscriber of ours is served all the same.
        sub = Subscriber(TensorDictPipe.connect_sync("127.0.0.1", server.port, timeout=20.0))
        assert sub.pull(timeout=10) is not None
    # Our subscriber facing the reference's pipe: named at once.
    listener = Peer("ref-listener")
    try:
        port = listener.line()["port"]
        pipe = TensorDictPipe.connect_sync("127.0.0.1", port, timeout=20.0)
        with pytest.raises(NoPublisherError, match="not a tensordict_cpp peer"):
            Subscriber(pipe)
        pipe.close()
    finally:
        listener.kill()
