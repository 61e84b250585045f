"""TensorDictPipe / TensorDictServer over real UCX on loopback (the reference's protocol,
round-trip and server cases, its closed-pipe, same-schema and pipe/group-peer errors;
docs/pipe.md, docs/wire-format.md §6):
one-task listen/connect/exchange, the reference's framing, steady state without allocation,
sync calls inside a running loop, async iteration that ends only on a clean close, a killed
peer, malformed frames, 8 concurrent clients and a server that closes without leaks."""
import os

# Before anything creates a UCX context: UCX reads these when a pipe creates its context.
os.environ["UCX_TLS"] = "tcp"
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"

import asyncio  # noqa: E402
import builtins  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import conftest  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tensordict_cpp import TensorDict, TensorDictPipe, TensorDictServer, errors  # noqa: E402

OPTS = dict(timeout=5.0)
HOST = "127.0.0.1"


watchdog = conftest.watchdog(40)


def run(coro, budget=20.0):
    return asyncio.run(asyncio.wait_for(coro, budget))


def sample(fill=1.0):
    td = TensorDict(x=torch.full((10,), fill), y=torch.full((5, 3), fill), batch_size=[])
    td["info", "reward"] = torch.full((2,), fill, dtype=torch.float64)
    return td


def assert_same(a, b):
    ka = sorted(a.keys(include_nested=True, leaves_only=True), key=str)
    kb = sorted(b.keys(include_nested=True, leaves_only=True), key=str)
    assert ka == kb
    for k in ka:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def pair(**opts):
    server = TensorDictPipe.listen_sync(0, HOST, **{**OPTS, **opts})
    client = TensorDictPipe.connect_sync(HOST, server.port, **{**OPTS, **opts})
    return server, client


# ---- exchanges ------------------------------------------------------------------------------
@pytest.mark.parametrize("tls", ["tcp", "tcp,sm,self"])
def test_one_task_listens_connects_and_exchanges(tls, monkeypatch):
    monkeypatch.setenv("UCX_TLS", tls)  # read by each new UCX context

    async def main():
        server = await TensorDictPipe.listen(0, HOST, **OPTS)  # returns before any client
        assert server.port > 0
        async with await TensorDictPipe.connect(HOST, server.port, **OPTS) as client:
            async with server:
                await client.asend(sample(3.0))
                got = await server.arecv()
                assert_same(got, sample(3.0))
                await server.asend(sample(4.0))  # and back
                assert_same(await client.arecv(), sample(4.0))
        assert server.closed and client.closed

    run(main())


def test_uncollated_mode_roundtrip():
    server, client = pair(consolidated=False)
    with server, client:
        client.send(sample(2.0))
        a = server.recv()
        assert_same(a, sample(2.0))
        client.send(sample(5.0))
        b = server.recv()
        assert b is not a  # a new TensorDict each time in this mode
        assert_same(b, sample(5.0))


def test_framing_is_the_references():
    """43-45: first send 0x00 + u64 LE length + JSON with _total_bytes + storage; the same
    schema again: 0x01 + storage only (one joined message between peers of ours, for a small
    storage: docs/wire-format.md §6.8); a new schema: 0x00 and the metadata again."""
    server, client = pair()
    with server, client:
        td = sample(1.0).consolidate()
        total = td._cpp.consolidated_storage().numel()
        client.send(td)
        raw = server._cpp
        assert raw._recv_raw(1) == b"\x00"
        (n,) = struct.unpack("<Q", raw._recv_raw(8))
        assert n > 0
        meta = json.loads(raw._recv_raw(n))
        assert meta["_total_bytes"] == total and meta["_device"] == "cpu"
        assert len(raw._recv_raw(total)) == total
        client.send(td)
        joined = raw._recv_raw(1 + total)
        storage = td._cpp.consolidated_storage().numpy().tobytes()
        assert joined[:1] == b"\x01" and joined[1:] == storage
        other = TensorDict(z=torch.zeros(3), batch_size=[]).consolidate()
        client.send(other)
        assert raw._recv_raw(1) == b"\x00"
        assert client.stats()["schema_sends"] == 2 and client.stats()["sends"] == 3


def test_steady_state_same_object_same_storage():
    """47, 52: a same-schema receive returns the very same TensorDict, its storage reused."""
    server, client = pair()
    with server, client:
        src = sample(1.0).consolidate()
        client.send(src)
        first = server.recv()
        ptr = first._cpp.consolidated_storage().data_ptr()
        for v in (7.0, 42.0, 99.0):
            for leaf in src.values(include_nested=True, leaves_only=True):
                leaf.fill_(v)  # the leaves view the storage: refilled in place, sent as is
            client.send(src)
            again = server.recv()
            assert again is first
            assert again._cpp.consolidated_storage().data_ptr() == ptr
            assert_same(again, sample(v))
        stats = server.stats()
        assert stats["schema_recvs"] == 1 and stats["recvs"] == 4
        # A consolidated target of the same layout is filled and returned.
        target = sample(0.0).consolidate()
        client.send(sample(8.0).consolidate())
        assert server.recv(target) is target
        assert_same(target, sample(8.0))


def test_td_send_recv_asend_arecv_go_through_the_pipe():
    """49, 50, 54: td.send(pipe) / td.recv(pipe) RETURNS the received TensorDict."""
    server, client = pair()
    with server, client:
        sample(6.0).send(client)
        dest = TensorDict(x=torch.zeros(10), batch_size=[])  # not consolidated: not filled
        got = dest.recv(server)
        assert got is not dest
        assert_same(got, sample(6.0))
        assert (dest["x"] == 0).all()
        sample(9.0).send(dst=client)
        assert_same(TensorDict().recv(src=server), sample(9.0))

        async def main():
            await sample(11.0).asend(client)
            return await TensorDict({}, []).arecv(server)

        assert_same(run(main()), sample(11.0))


def test_group_peer_with_a_pipe_is_a_value_error():
    """The reference's error texts (docs/pipe.md)."""
    server, client = pair()
    with server, client:
        with pytest.raises(ValueError, match=r"^`group_dst` cannot be used when `dst` is a "
                                             r"TensorDictPipe\.$"):
            sample().send(dst=client, group_dst=1)
        with pytest.raises(ValueError, match=r"^`group_src` cannot be used when `src` is a "
                                             r"TensorDictPipe\.$"):
            sample().recv(src=server, group_src=0)
        with pytest.raises(TypeError, match="TensorDictPipe"):
            run(sample().asend(3))


# ---- event loops ----------------------------------------------------------------------------
def test_sync_calls_inside_a_running_loop_do_not_deadlock():
    """The reference deadlocks here (run_coroutine_threadsafe(...).result() on its own loop):
    ours block the loop's thread for the call, and complete."""
    async def main():
        server = TensorDictPipe.listen_sync(0, HOST, **OPTS)
        client = TensorDictPipe.connect_sync(HOST, server.port, **OPTS)
        client.send(sample(2.0))  # sync, in the loop's thread
        got = server.recv()
        assert_same(got, sample(2.0))
        await client.asend(sample(3.0))  # mixing with the coroutines is fine
        assert server.recv() is got
        client.close()
        server.close()

    run(main())


def test_sync_calls_without_a_loop_from_two_threads():
    server, client = pair()
    with server, client:
        got = []
        t = threading.Thread(target=lambda: got.append(server.recv().clone()))
        t.start()
        time.sleep(0.2)  # the receive is waiting
        client.send(sample(4.0))
        t.join(10)
        assert not t.is_alive()
        assert_same(got[0], sample(4.0))


def test_cancelled_arecv_loses_no_message():
    async def main():
        server, client = pair()
        async with server, client:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(server.arecv(), 0.3)  # nothing sent yet
            await client.asend(sample(1.0))
            assert_same(await server.arecv(), sample(1.0))  # the cancelled call's message
            await client.asend(sample(2.0))
            assert_same(await server.arecv(), sample(2.0))

    run(main())


def test_cancelled_waits_leave_the_pipe_usable_and_in_order():
    """Cancelled while waiting for a first message, arecv has received nothing: every later
    message arrives, in order, at the calls that follow."""
    async def main():
        server, client = pair()
        async with server, client:
            for _ in range(5):
                waiting = asyncio.ensure_future(server.arecv())
                await asyncio.sleep(0.02)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
            for k in range(3):
                await client.asend(sample(float(k)))
            for k in range(3):
                assert_same(await server.arecv(), sample(float(k)))

    run(main())


def test_small_asend_and_arecv_run_on_the_loop_thread():
    """Past the schema message, a stream of small TensorDicts takes no thread of the pipe's:
    asend goes out at once and arecv receives on the loop (docs/pipe.md, "From an event
    loop")."""
    async def main():
        server, client = pair()
        async with server, client:
            td = sample(0.0).consolidate()
            client.send(td)  # the schema, sent by the caller's thread
            server.recv()
            for k in range(200):
                td["x"].fill_(k)
                await client.asend(td)
                got = await server.arecv()
                assert got["x"][0].item() == k
            assert client._send_ex is None and server._recv_ex is None  # no thread made
            assert client.stats()["sends"] == 201 and server.stats()["recvs"] == 201

    run(main())


def test_large_arecv_goes_to_the_receive_thread_and_stays_in_order():
    """Past 1 MiB arecv receives on the pipe's thread (the loop keeps running); small and large
    TensorDicts interleaved still arrive in order and intact."""
    async def main():
        server, client = pair()
        async with server, client:
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.001)
                    ticks += 1

            tick = asyncio.ensure_future(ticker())
            sizes = [4 << 20, 16, 4 << 20, 4 << 20, 16]
            sending = asyncio.ensure_future(asyncio.gather(*(
                client.asend(TensorDict(x=torch.full((n,), float(k), dtype=torch.uint8)))
                for k, n in enumerate(sizes))))
            for k, n in enumerate(sizes):
                got = await server.arecv()
                assert got["x"].numel() == n and bool((got["x"] == k).all())
            await sending
            assert server._recv_ex is not None  # the large ones went to the thread
            tick.cancel()
            assert ticks > 0

    run(main())


def test_two_pipes_on_one_loop():
    """Two pairs exchange concurrently on one event loop, each in order."""
    async def main():
        pairs = [pair(), pair()]

        async def exchange(server, client, base):
            async def produce():
                for k in range(100):
                    await client.asend(TensorDict(v=torch.tensor([base + k])))

            async def consume():
                return [int((await server.arecv())["v"]) for _ in range(100)]

            _, got = await asyncio.gather(produce(), consume())
            assert got == [base + k for k in range(100)]

        await asyncio.gather(*(exchange(s, c, 1000 * i) for i, (s, c) in enumerate(pairs)))
        for s, c in pairs:
            await s.aclose()
            await c.aclose()

    run(main())


def test_a_pipe_awaited_from_a_thread_other_than_its_maker_s():
    """A pipe made in one thread is awaited on a loop running in another thread, then on a
    second loop in turn, while its peer sends from the main thread."""
    server, client = pair()
    got = []

    def consumer():
        async def take(n):
            return [int((await server.arecv())["v"]) for _ in range(n)]
        got.extend(asyncio.run(take(3)))
        got.extend(asyncio.run(take(3)))  # another loop, same pipe

    with server, client:
        t = threading.Thread(target=consumer)
        t.start()
        for k in range(6):
            time.sleep(0.01)
            client.send(TensorDict(v=torch.tensor([k])))
        t.join(20)
        assert not t.is_alive()
    assert got == list(range(6))


def test_arecv_timeout_receives_nothing_and_leaves_the_pipe_usable():
    async def main():
        server, client = pair(timeout=0.5)
        async with server, client:
            start = time.monotonic()
            with pytest.raises(errors.TimeoutError, match="nothing was received"):
                await server.arecv()
            assert 0.4 < time.monotonic() - start < 3.0
            await client.asend(sample(7.0))
            assert_same(await server.arecv(), sample(7.0))

    run(main())


def test_close_wakes_a_waiting_arecv():
    async def main():
        server, client = pair(timeout=10.0)
        async with client:
            waiting = asyncio.ensure_future(server.arecv())
            await asyncio.sleep(0.1)
            start = time.monotonic()
            await server.aclose()
            with pytest.raises(errors.PipeClosedError):
                await waiting
            assert time.monotonic() - start < 2.0

    run(main())


def test_a_received_tensordict_is_echoed_and_forwarded_without_a_copy():
    """A TensorDict received from a pipe is consolidated in the pipe's storage: sending it back,
    or on to another pipe, copies nothing (the process's peak memory does not grow by its
    64 MiB; a consolidation would add them)."""
    from test_hostile_inputs import peak_mb, rss_mb

    async def main():
        (a_srv, a_cli), (b_srv, b_cli) = pair(), pair()
        async with a_srv, a_cli, b_srv, b_cli:
            td = TensorDict(x=torch.ones(64 << 20, dtype=torch.uint8)).consolidate()
            _, got = await asyncio.gather(a_cli.asend(td), a_srv.arecv())
            assert got.is_consolidated()
            # Each receiver gets the schema once (allocating its storage), then the measured
            # transfers land in storage they have.
            await asyncio.gather(a_srv.asend(got), a_cli.arecv())
            await asyncio.gather(b_cli.asend(got), b_srv.arecv())
            base = rss_mb()
            _, echo = await asyncio.gather(a_srv.asend(got), a_cli.arecv())
            _, forwarded = await asyncio.gather(b_cli.asend(got), b_srv.arecv())
            grown = peak_mb() - base
            assert grown < 16, f"sending a received TensorDict on grew the peak by {grown:.0f} MB"
            assert bool((echo["x"] == 1).all()) and bool((forwarded["x"] == 1).all())

    run(main())


def test_async_for_ends_on_a_clean_close_after_the_last_message():
    """The producer sends and closes at once: nothing is lost (the messages outlive the
    connection at the consumer) and the consumer's loop simply ends at the close marker."""
    async def main():
        server, client = pair()

        async def producer():
            for i in range(5):
                await client.asend(sample(float(i)))
            await client.aclose()

        task = asyncio.ensure_future(producer())
        await asyncio.sleep(0.3)  # the producer is closing before anything is read
        seen = [td["x"][0].item() async for td in server]
        await task
        assert seen == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert server.peer_closed and not server.closed
        with pytest.raises(RuntimeError, match="the peer closed the pipe"):
            server.recv()
        server.close()

    run(main())


def test_async_for_raises_real_errors():
    server, client = pair()
    with server, client:
        client._cpp._send_raw(b"\x07")  # not a flag of the protocol

        async def consume():
            async for _ in server:
                pass

        with pytest.raises(RuntimeError, match="Unknown TensorDictPipe protocol flag: 0x07"):
            run(consume())


KILLED_PRODUCER = textwrap.dedent("""
    import sys, torch
    from tensordict_cpp import TensorDict, TensorDictPipe
    pipe = TensorDictPipe.connect_sync("127.0.0.1", int(sys.argv[1]), timeout=5.0)
    td = TensorDict(x=torch.zeros(1 << 20), batch_size=[]).consolidate()
    while True:
        pipe.send(td)
""")


def test_killed_peer_fails_within_the_timeout():
    async def main():
        # The timeout covers the child's start (importing torch); the loss itself is reported
        # by UCX's peer error handling, well within it.
        timeout = 15.0
        server = TensorDictPipe.listen_sync(0, HOST, timeout=timeout)
        child = subprocess.Popen([sys.executable, "-c", KILLED_PRODUCER, str(server.port)],
                                 env=os.environ.copy())
        try:
            received = 0
            with pytest.raises(RuntimeError) as info:
                async for _ in server:
                    received += 1
                    if received == 3:
                        child.send_signal(signal.SIGKILL)  # mid-stream
                        killed_at = time.monotonic()
            assert received >= 3
            assert time.monotonic() - killed_at < timeout
            assert not server.peer_closed
            print("killed peer:", info.value)
        finally:
            child.kill()
            child.wait(10)
            server.close()

    run(main(), budget=35.0)


# ---- malformed frames and closed pipes --------------------------------------------------------
@pytest.mark.parametrize("frames, error, match", [
    ([b"\x00", struct.pack("<Q", 1 << 40)], RuntimeError, "over the limit"),
    ([b"\x00", struct.pack("<Q", 5), b"{nope"], ValueError, "invalid metadata"),
    ([b"\x01"], RuntimeError, "Received same-schema flag but no consolidated TensorDict is "
                              "available for in-place receive"),
    ([b"\x00", struct.pack("<Q", 2), b"{}"], ValueError, "invalid metadata"),
], ids=["oversized-length", "bad-json", "same-schema-first", "no-total-bytes"])
def test_malformed_frames_are_refused(frames, error, match):
    server, client = pair()
    with server, client:
        for f in frames:
            client._cpp._send_raw(f)
        with pytest.raises(error, match=match):
            server.recv()
        with pytest.raises(RuntimeError, match="broken"):  # no out-of-step reads afterwards
            server.recv()


def test_oversized_storage_is_refused_before_allocating():
    server = TensorDictPipe.listen_sync(0, HOST, max_storage_bytes=1024, **OPTS)
    client = TensorDictPipe.connect_sync(HOST, server.port, **OPTS)
    with server, client:
        client.send(TensorDict(x=torch.zeros(1024), batch_size=[]))
        with pytest.raises(RuntimeError, match="max_storage_bytes"):
            server.recv()


def test_closed_pipe_errors_and_context_managers():
    server, client = pair()
    with client:
        pass
    assert client.closed
    with pytest.raises(RuntimeError, match=r"^Cannot send on a closed pipe\.$"):
        client.send(sample())
    with pytest.raises(RuntimeError, match=r"^Cannot recv on a closed pipe\.$"):
        client.recv()
    with pytest.raises(RuntimeError, match=r"^Cannot recv on a closed pipe\.$"):
        run(client.arecv())
    client.close()  # idempotent
    server.close()


def test_a_closed_pipe_raises_pipe_closed_error():
    server, client = pair()
    client.close()
    for call in (lambda: client.send(sample()), client.recv, lambda: run(client.arecv()),
                 lambda: run(client.asend(sample()))):
        with pytest.raises(errors.PipeClosedError,
                           match=r"^Cannot (send|recv) on a closed pipe\.$"):
            call()
    server.close()


def test_the_peer_s_close_raises_peer_closed_error():
    server, client = pair()

    def produce():
        client.send(sample())
        client.close()  # at once: the message and the close marker stay readable

    producer = threading.Thread(target=produce)
    producer.start()
    assert_same(server.recv(), sample())
    first = r"^recv: the peer 127\.0\.0\.1:\d+ closed the pipe$"  # then "recv: the peer closed ..."
    with pytest.raises(errors.PeerClosedError, match=first):
        server.recv()
    producer.join(10)
    assert not producer.is_alive()
    with pytest.raises(errors.PeerClosedError, match="the peer closed the pipe"):
        server.send(sample())
    assert server.peer_closed
    server.close()


def test_a_pipe_timeout_raises_timeout_error():
    server, client = pair(timeout=0.5)
    with server, client:
        start = time.monotonic()
        with pytest.raises(errors.TimeoutError, match="timed out") as info:
            client.recv()  # the server sends nothing
        assert isinstance(info.value, builtins.TimeoutError)
        assert isinstance(info.value, RuntimeError)  # as before the typed errors
        assert time.monotonic() - start < 3.0


# ---- server -----------------------------------------------------------------------------------
def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_server_eight_concurrent_clients_and_a_clean_shutdown():
    async def echo(pipe):
        async for td in pipe:  # ends when the client closes
            await pipe.asend(TensorDict(id=td["id"] + 1000, payload=td["payload"], batch_size=[]))

    async def client(port, cid, rounds):
        async with await TensorDictPipe.connect(HOST, port, **OPTS) as pipe:
            ok = 0
            for r in range(rounds):
                payload = torch.full((64, 16), float(cid * 100 + r))
                await pipe.asend(TensorDict(id=torch.tensor(cid), payload=payload, batch_size=[]))
                reply = await pipe.arecv()
                ok += reply["id"].item() == cid + 1000 and torch.equal(reply["payload"], payload)
            return ok

    async def main(n_clients, rounds):
        server = TensorDictServer(0, HOST, **OPTS)
        serving = asyncio.ensure_future(server.serve(echo))
        oks = await asyncio.gather(*(client(server.port, i, rounds) for i in range(n_clients)))
        await server.aclose()
        await serving  # returns once closed, every handler done
        return server, sum(oks)

    run(main(1, 1))  # warm-up: UCX's process-wide state (its async thread) is made once
    gc.collect()
    threads, fds = threading.active_count(), open_fds()
    server, ok = run(main(8, 5))
    gc.collect()  # a pipe's progress thread ends with its last handle
    assert ok == 8 * 5
    assert server.clients == 8
    assert server.handler_errors == []  # clients closing cleanly are not errors
    assert threading.active_count() == threads
    assert open_fds() == fds


def test_server_async_iteration_and_close_unblocks_handlers():
    async def main():
        server = TensorDictServer(0, HOST, **OPTS)
        clients = [await TensorDictPipe.connect(HOST, server.port, **OPTS) for _ in range(2)]
        pipes = []
        async for pipe in server:
            pipes.append(pipe)
            if len(pipes) == 2:
                break
        waiting = asyncio.ensure_future(pipes[0].arecv())  # its client never sends
        await asyncio.sleep(0.2)
        start = time.monotonic()
        await server.aclose()
        with pytest.raises(RuntimeError):
            await waiting
        assert time.monotonic() - start < 4.0
        assert all(p.closed for p in pipes)
        for c in clients:
            await c.aclose()

    run(main())


def test_serve_runs_handlers_concurrently():
    """56: two clients, each sends one TensorDict; both are received."""
    async def main():
        got = []

        async def handler(pipe):
            got.append((await pipe.arecv())["a"].item())

        async with TensorDictServer(0, HOST, **OPTS) as server:
            serving = asyncio.ensure_future(server.serve(handler))
            for v in (1.0, 2.0):
                async with await TensorDictPipe.connect(HOST, server.port, **OPTS) as c:
                    await c.asend(TensorDict(a=torch.tensor([v]), batch_size=[]))
            while len(got) < 2:
                await asyncio.sleep(0.05)
        await serving
        assert sorted(got) == [1.0, 2.0]

    run(main())


# ---- TensorDictPipe(endpoint): any object with the endpoint methods the reference's pipe calls --

class StandInEndpoint:
    """One end of an in-process connection: a message is a bytes copy in the peer's queue, as
    the reference's own tests wrap a stand-in endpoint. Only send, recv and close exist."""

    def __init__(self):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.peer: "StandInEndpoint | None" = None
        self.closed = False
        self.buffer_types: set = set()

    async def send(self, buffer):
        self.buffer_types.add(type(buffer).__name__)
        await self.peer.inbox.put(bytes(memoryview(buffer).cast("B")))

    async def recv(self, buffer):
        data = await self.inbox.get()
        view = memoryview(buffer).cast("B")
        assert len(data) == view.nbytes, (len(data), view.nbytes)
        view[:] = data

    def close(self):  # not a coroutine: both forms are taken
        self.closed = True


def stand_in_pair():
    a, b = StandInEndpoint(), StandInEndpoint()
    a.peer, b.peer = b, a
    return a, b


def batch(lib, k):
    td = lib.TensorDict(obs=torch.full((4, 3), float(k)), info={"step": torch.full((4,), k)},
                        batch_size=[4])
    td["text"] = f"t{k}"
    return td


@pytest.mark.parametrize("consolidated", [True, False])
@pytest.mark.parametrize("peer", ["ours", "ref"])
def test_a_pipe_over_any_endpoint_object(consolidated, peer):
    """Ours on a stand-in endpoint, made outside any loop (bound by its first await), against
    ours or the reference's pipe on the other end, in both directions."""
    import tensordict
    from tensordict._ucxx import TensorDictPipe as RefPipe

    import tensordict_cpp

    a, b = stand_in_pair()
    ours = TensorDictPipe(a, consolidated=consolidated, timeout=10)  # no running loop yet

    async def main():
        other = (TensorDictPipe(b, consolidated=consolidated, timeout=10) if peer == "ours"
                 else RefPipe(b, consolidated=consolidated))
        lib = tensordict_cpp if peer == "ours" else tensordict
        for k in (1, 2, 3):
            await ours.asend(batch(tensordict_cpp, k))
            got = await other.arecv()
            assert got["obs"].eq(k).all() and got["info", "step"].eq(k).all()
            assert got["text"] == f"t{k}"
            await other.asend(batch(lib, 10 + k))
            back = await ours.arecv()
            assert back["obs"].eq(10 + k).all() and back["text"] == f"t{10 + k}"
        # The plain methods work from another thread, on the endpoint's loop.
        sent = asyncio.create_task(other.arecv())
        await asyncio.to_thread(ours.send, batch(tensordict_cpp, 7))
        assert (await sent)["obs"].eq(7).all()
        await ours.aclose()
        if peer == "ours":
            await other.aclose()

    run(main())
    assert a.closed and a.buffer_types == {"ndarray"}


def test_an_object_without_the_endpoint_methods_is_a_type_error():
    class NoRecv:
        async def send(self, buffer):
            pass

        def close(self):
            pass

    with pytest.raises(TypeError, match="NoRecv has no recv"):
        TensorDictPipe(NoRecv())


def test_plain_calls_and_one_loop_per_call_as_the_reference():
    """Without a running loop each plain call runs the endpoint in a loop of its own, and each
    asyncio.run may be a new loop (the reference's own tests drive a pipe that way)."""
    import tensordict_cpp

    a, b = stand_in_pair()
    ours, other = TensorDictPipe(a, timeout=5), TensorDictPipe(b, timeout=5)
    for k in (1, 2):
        asyncio.run(ours.asend(batch(tensordict_cpp, k)))
        assert asyncio.run(other.arecv())["obs"].eq(k).all()
    ours.send(batch(tensordict_cpp, 3))  # no loop at all
    assert other.recv()["obs"].eq(3).all()
    batch(tensordict_cpp, 4).send(ours)  # TensorDict.send / recv through the pipe
    assert tensordict_cpp.TensorDict().recv(other)["obs"].eq(4).all()
    ours.close()
    other.close()
    assert a.closed and b.closed
