"""Our pipe against the reference's (tensordict._ucxx over ucxx, the same UCX 1.21 from the
libucx-cu12 wheel), each end a process of its own (tests/python/pipe_peers.py): the matrix of
ours/reference x listener/connector x sender/receiver over the first message with its schema,
the same-schema steady state (received in place on both sides), a schema change, the clean close
and a killed peer; the uncollated mode; and a TensorDictServer of ours with 8 clients mixing
ours and the reference (docs/pipe.md, docs/wire-format.md §6). The reference is 0.15.3 and, for
the matrix, the uncollated mode, the non-tensor entries and the server, 0.14.3 too
(reference_peer.py), whose pipe writes the 0.14 forms (§6.1 key order, §6.2 short header)."""
import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from reference_peer import CURRENT, REFERENCES, reference_env

pytest.importorskip("ucxx", reason="the reference pipe needs ucxx (scripts/setup installs it)")

PEER = pathlib.Path(__file__).with_name("pipe_peers.py")
ENV = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n",
       "OMP_NUM_THREADS": "1"}
BUDGET = 90.0  # per process pair: two Python processes importing torch (and ucxx)

# The 4 TensorDicts of the "schemas" scenario: (k, keys, received in place).
SCHEMA_A = ["('info', 'step')", "obs", "reward"]
SCHEMA_B = sorted(SCHEMA_A + ["done"])
EXPECTED = [(1, SCHEMA_A, False), (2, SCHEMA_A, True), (3, SCHEMA_B, False), (4, SCHEMA_A, False)]


class Peer:
    """A pipe_peers.py process whose JSON lines are collected by a thread."""

    def __init__(self, impl, role, direction, mode="consolidated", port=0, scenario="schemas",
                 reference=CURRENT):
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), impl, role, direction, mode, str(port), scenario],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=reference_env(reference, ENV) if impl == "ref" else ENV)
        self.lines = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                item = json.loads(line)
            except ValueError:
                continue  # not ours (a library's print)
            with self.cond:
                self.lines.append(item)
                self.cond.notify_all()

    def wait_for(self, pred, timeout=BUDGET):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for item in self.lines:
                    if pred(item):
                        return item
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reader.is_alive()):
                    raise AssertionError(f"no such line; got {self.lines}; stderr: "
                                         f"{self.stderr()}")
                self.cond.wait(min(left, 0.5))

    def received(self):
        with self.cond:
            return [item for item in self.lines if "k" in item]

    def end(self, timeout=BUDGET):
        return self.wait_for(lambda item: "end" in item, timeout)["end"]

    def stderr(self):
        if self.proc.poll() is None:
            return "<running>"
        return self.proc.stderr.read()[-3000:]

    def finish(self, timeout=30):
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_pair(sender, receiver, listener, mode="consolidated", scenario="schemas",
               reference=CURRENT):
    """Starts the listening end, then the other one on its port: (sender, receiver) Peers. The
    reference's end imports tensordict ``reference`` and says so first."""
    first_impl, first_dir = (sender, "send") if listener == "sender" else (receiver, "recv")
    second_impl, second_dir = (receiver, "recv") if listener == "sender" else (sender, "send")
    first = Peer(first_impl, "listen", first_dir, mode, 0, scenario, reference)
    try:
        port = first.wait_for(lambda item: "port" in item)["port"]
        second = Peer(second_impl, "connect", second_dir, mode, port, scenario, reference)
    except BaseException:
        first.kill()
        raise
    ref = first if first_impl == "ref" else second if second_impl == "ref" else None
    if ref is not None:
        assert ref.wait_for(lambda item: "reference" in item)["reference"] == reference
    return (first, second) if listener == "sender" else (second, first)


PAIRS = [("ours", "ref"), ("ref", "ours")]


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("listener", ["sender", "receiver"])
@pytest.mark.parametrize("sender, receiver", PAIRS, ids=["ours-to-ref", "ref-to-ours"])
def test_schemas_steady_state_and_clean_close(sender, receiver, listener, reference):
    # 0.14.3 sends the schema JSON sorted, 0.15.3 in insertion order (§6.1): ours reads both.
    tx, rx = start_pair(sender, receiver, listener, reference=reference)
    try:
        assert tx.end() == "closed", tx.stderr()
        end = rx.end()
        got = [(item["k"], item["keys"], item["same"]) for item in rx.received()]
        assert got == EXPECTED, (got, rx.stderr())
        assert all(item["batch"] == [4] for item in rx.received())
        if receiver == "ours":
            # The reference has no close marker: its disconnect after the last message is its
            # clean close, and ours knows its peer is not one of ours.
            assert end == "closed"
            assert rx.wait_for(lambda item: "peer_is_ours" in item)["peer_is_ours"] is False
        else:
            # The reference's arecv raises a ucxx error when the peer has left.
            assert end.startswith("UCX"), end
            assert tx.wait_for(lambda item: "peer_is_ours" in item)["peer_is_ours"] is False
        assert tx.finish() == 0 and rx.finish() == 0
    finally:
        tx.kill()
        rx.kill()


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("sender, receiver", PAIRS, ids=["ours-to-ref", "ref-to-ours"])
def test_uncollated_mode(sender, receiver, reference):
    # The 0.14 header (§6.2): a 0.14.3 sender sends the root's tensors only (the nested
    # ('info', 'step') stays behind), and a 0.14.3 receiver reads ours, the 0.15.3 form, when
    # every key is a str (a nested key, a list there, is its TypeError, as from 0.15.3).
    old = reference != CURRENT
    scenario = "flat" if old and receiver == "ref" else "schemas"
    tx, rx = start_pair(sender, receiver, "receiver", mode="uncollated", scenario=scenario,
                        reference=reference)
    try:
        assert tx.end() == "closed", tx.stderr()
        rx.end()
        got = [(item["k"], item["keys"], item["same"]) for item in rx.received()]
        nested = "('info', 'step')"
        want = [(k, [key for key in keys if not (old and key == nested)], False)
                for k, keys, _ in EXPECTED]
        assert got == want, (got, rx.stderr())
    finally:
        tx.kill()
        rx.kill()


@pytest.mark.parametrize("victim", ["sender", "receiver"])
@pytest.mark.parametrize("sender, receiver", PAIRS, ids=["ours-to-ref", "ref-to-ours"])
def test_a_killed_peer_ends_the_other_side_promptly(sender, receiver, victim):
    tx, rx = start_pair(sender, receiver, "receiver", scenario="forever")
    try:
        rx.wait_for(lambda item: item.get("k") == 5)
        (tx if victim == "sender" else rx).proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = rx if victim == "sender" else tx
        end = survivor.end(timeout=30)
        took = time.monotonic() - killed
        print(f"{sender} -> {receiver}, {victim} killed: the survivor ended after {took:.2f} s "
              f"with: {end}")
        assert took < 25  # the pipe timeout is 20 s; UCX's peer error handling is faster
        if victim == "sender":
            # Every message that arrived is whole, in order.
            ks = [item["k"] for item in rx.received()]
            assert ks == list(range(1, len(ks) + 1))
            if receiver == "ours":
                # A reference peer's disconnect between messages reads as its close; inside a
                # message it is an error. Either way the pipe ends at once, never with bad data.
                assert end == "closed" or "PeerLostError" in end or "MalformedPeerData" in end
        else:
            assert end != "closed"  # the sender saw its receiver die
        assert survivor.finish() == 0
    finally:
        tx.kill()
        rx.kill()


@pytest.mark.parametrize("sender, receiver", [("ref", "ours-on-ucxx"), ("ours-on-ucxx", "ours"),
                                              ("ours", "ours-on-ucxx")])
def test_our_pipe_over_a_ucxx_endpoint(sender, receiver):
    # TensorDictPipe(endpoint), as the reference's constructor: our framing and validation on a
    # connection ucxx made, against the reference and against ours.
    tx, rx = start_pair(sender, receiver, "receiver")
    try:
        assert tx.end() == "closed", tx.stderr()
        rx.end()
        got = [(item["k"], item["keys"], item["same"]) for item in rx.received()]
        assert got == EXPECTED, (got, rx.stderr())
    finally:
        tx.kill()
        rx.kill()


# ---- a server of ours, clients of both kinds -----------------------------------------------------
SERVER_CLIENTS = 8
ROUNDS = 20


async def reference_client(port, cid):
    import tensordict
    from tensordict._ucxx import TensorDictPipe
    print("reference", tensordict.__version__, flush=True)
    return await client_rounds(await TensorDictPipe.connect("127.0.0.1", port), tensordict, cid)


async def our_client(port, cid):
    import tensordict_cpp
    from tensordict_cpp import TensorDictPipe
    return await client_rounds(await TensorDictPipe.connect("127.0.0.1", port, timeout=20.0),
                               tensordict_cpp, cid)


async def client_rounds(pipe, lib, cid):
    td = lib.TensorDict(x=torch.zeros(256), cid=torch.tensor([cid]), batch_size=[]).consolidate()
    for r in range(ROUNDS):
        td["x"].fill_(r)
        await pipe.asend(td)
        echo = await pipe.arecv()
        assert int(echo["cid"]) == cid and bool((echo["x"] == r + 1).all()), (cid, r)
    await pipe.aclose()
    return cid


CLIENT = """
import asyncio, os, sys
sys.path.insert(0, os.path.dirname({test!r}))
from test_pipe_interop import our_client, reference_client
kind, port, cid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fn = our_client if kind == "ours" else reference_client
print("done", asyncio.run(asyncio.wait_for(fn(port, cid), 60)), flush=True)
"""


@pytest.mark.parametrize("reference", REFERENCES)
def test_our_server_with_eight_clients_of_both_kinds(reference):
    from tensordict_cpp import TensorDictServer

    async def main():
        handled = []

        async def handler(pipe):  # echo with x + 1, the same TensorDict refilled each round
            async for td in pipe:
                td["x"].add_(1)
                await pipe.asend(td)
            handled.append(pipe.peer_closed)

        async with TensorDictServer(0, timeout=30.0) as server:
            serving = asyncio.ensure_future(server.serve(handler))
            script = CLIENT.format(test=str(pathlib.Path(__file__)))
            procs = [await asyncio.create_subprocess_exec(
                sys.executable, "-c", script, "ours" if cid % 2 else "ref", str(server.port),
                str(cid), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=ENV if cid % 2 else reference_env(reference, ENV))
                for cid in range(SERVER_CLIENTS)]
            outs = [await asyncio.wait_for(p.communicate(), 120) for p in procs]
            for cid, (p, (out, err)) in enumerate(zip(procs, outs)):
                assert p.returncode == 0 and f"done {cid}" in out.decode(), err.decode()[-2000:]
                assert cid % 2 or f"reference {reference}" in out.decode()
            await server.aclose()
            await asyncio.wait_for(serving, 30)
            assert not server.handler_errors, server.handler_errors
        # Every client closed after its last round, and each handler's loop ended cleanly:
        # ours by the marker, the reference's by its disconnect between two messages.
        assert handled == [True] * SERVER_CLIENTS

    asyncio.run(asyncio.wait_for(main(), 240))


def expected_classes(k):
    return {"text": ["NonTensorStack", [f"t{k}.{i}" for i in range(4)]],
            "('info', 'grid')": ["NonTensorStack", [[f"{i}a", f"{i}b"] for i in range(4)]],
            "label": ["NonTensorData", [f"label{k}"] * 4]}


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("mode", ["consolidated", "uncollated"])
@pytest.mark.parametrize("sender, receiver", PAIRS, ids=["ours-to-ref", "ref-to-ours"])
def test_non_tensor_stacks_cross_both_ways(sender, receiver, mode, reference):
    """NonTensorStacks (1-D and 2-D) in the metadata node and in the uncollated header (the
    0.14 header has no non-tensor entries: a 0.14.3 end neither sends nor reads them, §6.2)."""
    tx, rx = start_pair(sender, receiver, "receiver", mode, scenario="classes",
                        reference=reference)
    dropped = reference != CURRENT and mode == "uncollated"
    try:
        assert tx.end() == "closed", tx.stderr()
        rx.end()
        got = rx.received()
        assert [item["k"] for item in got] == [1.0, 2.0], rx.stderr()
        for k, item in zip((1, 2), got):
            want = dict.fromkeys(expected_classes(k)) if dropped else expected_classes(k)
            assert item["non_tensors"] == want, item
    finally:
        tx.kill()
        rx.kill()


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("sender, receiver", PAIRS, ids=["ours-to-ref", "ref-to-ours"])
def test_unbatched_entries_cross_both_ways(sender, receiver, reference):
    """The uncollated header's "unbatched" entries (consolidation refuses UnbatchedTensor); the
    0.14 header has none: the leaf crosses as a plain tensor of a TensorDict with batch size
    [] (§6.2)."""
    tx, rx = start_pair(sender, receiver, "receiver", "uncollated", scenario="unbatched",
                        reference=reference)
    kind = "UnbatchedTensor" if reference == CURRENT else "Tensor"
    try:
        assert tx.end() == "closed", tx.stderr()
        rx.end()
        got = rx.received()
        assert [item["k"] for item in got] == [1.0, 2.0], rx.stderr()
        for item in got:
            assert item["unbatched"] == [kind, [2, 5]], item
    finally:
        tx.kill()
        rx.kill()
