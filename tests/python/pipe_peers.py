"""One end of a pipe for tests/python/test_pipe_interop.py, as a process of its own: ours
(tensordict_cpp) or the reference's (tensordict._ucxx over ucxx), listening or connecting,
sending or receiving one scenario. It prints JSON lines on stdout, flushed: {"port": n} when it
listens, one {"k": ..., ...} per received TensorDict, and {"end": ...} last.

    python pipe_peers.py IMPL ROLE DIRECTION MODE PORT SCENARIO
    IMPL: ours | ref | ours-on-ucxx (ours over a ucxx endpoint: TensorDictPipe(endpoint))
    ROLE: listen | connect      DIRECTION: send | recv
    MODE: consolidated | uncollated     PORT: the listener's (connect) or 0 (listen)
    SCENARIO: schemas (4 TensorDicts: A, A again, B, A, then a clean close) | flat (the same
              without the nested leaf, which a 0.14 receiver of the uncollated header cannot
              read) | forever (the same schema until killed) | classes (2 TensorDicts with
              NonTensorStacks) | unbatched (2 TensorDicts with an UnbatchedTensor; uncollated)
"""
import asyncio
import json
import os
import sys

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# ucxx's own peer-info exchange gives up after 5 s by default, which a loaded 2-core CI machine
# once exceeded between two ucxx endpoints; the peers' own TIMEOUT below is 20 s.
os.environ.setdefault("UCXPY_CONNECT_TIMEOUT", "20")

import torch  # noqa: E402

IMPL, ROLE, DIRECTION, MODE, PORT, SCENARIO = sys.argv[1:7]
PORT = int(PORT)
CONSOLIDATED = MODE == "consolidated"
TIMEOUT = 20.0


def say(**fields):
    print(json.dumps(fields), flush=True)


def message(lib, schema, k):
    """Schema A: obs float32 [4, 3], reward float64 [4], info.step int64 [4]; B adds done.
    Scenario classes: A with a NonTensorStack of texts (and one of 2-D) and a str label."""
    if SCENARIO == "classes":
        td = lib.TensorDict({"obs": torch.full((4, 3), float(k))}, batch_size=[4])
        td["text"] = lib.NonTensorStack(*[f"t{k}.{i}" for i in range(4)])
        td["info", "grid"] = lib.NonTensorStack(*[lib.NonTensorStack(f"{i}a", f"{i}b") for i in range(4)])
        td["label"] = f"label{k}"
        return td.consolidate() if CONSOLIDATED else td
    if SCENARIO == "unbatched":
        return lib.TensorDict({"obs": torch.full((4, 3), float(k)),
                               "u": lib.UnbatchedTensor(torch.full((2, 5), float(k)))}, batch_size=[4])
    td = lib.TensorDict({"obs": torch.full((4, 3), float(k)),
                         "reward": torch.full((4,), float(k), dtype=torch.float64)},
                        batch_size=[4])
    if SCENARIO != "flat":
        td["info", "step"] = torch.full((4,), k, dtype=torch.int64)
    if schema == "B":
        td["done"] = torch.full((4,), k, dtype=torch.int32)
    return td.consolidate() if CONSOLIDATED else td


def sequence():
    if SCENARIO in ("classes", "unbatched"):
        yield from [("A", 1), ("A", 2)]
        return
    if SCENARIO in ("schemas", "flat"):
        yield from [("A", 1), ("A", 2), ("B", 3), ("A", 4)]
    else:
        k = 0
        while True:
            k += 1
            yield ("A", k)


def describe(td, previous):
    keys = sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))
    values = {float(v.double().min()) for v in td.values(include_nested=True, leaves_only=True)}
    values |= {float(v.double().max()) for v in td.values(include_nested=True, leaves_only=True)}
    k = values.pop() if len(values) == 1 else None  # every element of every leaf is k
    out = dict(k=k, keys=keys, same=td is previous,
               batch=list(td.batch_size) if CONSOLIDATED else None)
    if SCENARIO == "classes":
        # None for an entry that did not arrive (a 0.14 uncollated end drops non-tensors).
        present = set(td.keys(include_nested=True))
        out["non_tensors"] = {str(key): [type(td.get(key)).__name__, list(td.get(key).tolist())
                                         if hasattr(td.get(key), "tolist") else td[key]]
                              if key in present else None
                              for key in ("text", ("info", "grid"), "label")}
    if SCENARIO == "unbatched":
        out["unbatched"] = [type(td.get("u")).__name__, list(td.get("u").shape)]
    return out


# ---- ours ---------------------------------------------------------------------------------------
def run_ours():
    import tensordict_cpp
    from tensordict_cpp import TensorDictPipe
    from tensordict_cpp.errors import PeerClosedError

    opts = dict(consolidated=CONSOLIDATED, timeout=TIMEOUT)
    if DIRECTION == "send":
        # A ucxx listener reads our peer info in a Python coroutine; a close that overtakes it
        # loses the connection (docs/pipe.md, "Closing"): wait for the peer to start reading.
        opts["linger"] = TIMEOUT
    if ROLE == "listen":
        pipe = TensorDictPipe.listen_sync(0, "127.0.0.1", **opts)
        say(port=pipe.port)
        pipe.accept()
    else:
        pipe = TensorDictPipe.connect_sync("127.0.0.1", PORT, **opts)
    say(peer_is_ours=pipe._cpp.peer_is_tensordict_cpp, transports=pipe._cpp.transports)
    if DIRECTION == "send":
        try:
            for schema, k in sequence():
                pipe.send(message(tensordict_cpp, schema, k))
            pipe.close()
            say(end="closed")
        except Exception as e:  # noqa: BLE001 - reported to the test
            say(end=f"{type(e).__name__}: {e}")
        return
    previous = None
    try:
        while True:
            td = pipe.recv()
            say(**describe(td, previous))
            previous = td
    except PeerClosedError:
        say(end="closed", peer_closed=pipe.peer_closed)
    except Exception as e:  # noqa: BLE001
        say(end=f"{type(e).__name__}: {e}")
    pipe.close()


# ---- the reference, and ours over a ucxx endpoint ----------------------------------------------
async def run_on_ucxx():
    """The reference's pipe on ucxx, or (IMPL ours-on-ucxx) ours over the same ucxx endpoint."""
    import ucxx
    if IMPL == "ref":
        import tensordict as lib
        from tensordict._ucxx import TensorDictPipe
        say(reference=lib.__version__)  # 0.15.3, or 0.14.3 from .peers/td014 on PYTHONPATH
    else:
        import tensordict_cpp as lib
        from tensordict_cpp import TensorDictPipe

    if ROLE == "listen":
        connected = asyncio.get_running_loop().create_future()

        async def on_connect(ep):
            if not connected.done():
                connected.set_result(ep)

        listener = ucxx.create_listener(on_connect, port=0)
        say(port=listener.port)
        ep = await asyncio.wait_for(connected, TIMEOUT)
        pipe = TensorDictPipe(ep, consolidated=CONSOLIDATED, listener=listener)
    elif IMPL == "ref":
        pipe = await asyncio.wait_for(
            TensorDictPipe.connect("127.0.0.1", PORT, consolidated=CONSOLIDATED), TIMEOUT)
    else:
        ep = await asyncio.wait_for(ucxx.create_endpoint("127.0.0.1", PORT), TIMEOUT)
        pipe = TensorDictPipe(ep, consolidated=CONSOLIDATED)
    if DIRECTION == "send":
        try:
            for schema, k in sequence():
                await asyncio.wait_for(pipe.asend(message(lib, schema, k)), TIMEOUT)
            await pipe.aclose()
            say(end="closed")
        except Exception as e:  # noqa: BLE001
            say(end=f"{type(e).__name__}: {e}")
        return
    previous = None
    try:
        while True:
            td = await asyncio.wait_for(pipe.arecv(), TIMEOUT)
            say(**describe(td, previous))
            previous = td
    except Exception as e:  # noqa: BLE001 - the reference has no clean-close signal
        say(end=f"{type(e).__name__}: {e}")
    await pipe.aclose()


if __name__ == "__main__":
    if IMPL == "ours":
        run_ours()
    else:
        asyncio.run(run_on_ucxx())
