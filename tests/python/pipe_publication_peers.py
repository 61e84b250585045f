"""One process of tests/python/test_pipe_publication.py: a Publisher on a TensorDictServer, a
Subscriber on a TensorDictPipe, or the reference's pipe (tensordict._ucxx) facing ours. It
prints JSON lines on stdout, flushed: {"port": n} when it listens, then what it saw.

    python pipe_publication_peers.py ROLE PORT [ARG]
    ROLE: sub-new | sub-params | sub-poll | sub-classes      pull from PORT until version ARG,
              then wait for the publisher's close (a new TensorDict then in place; a live
              module's TensorDictParams; polls; a tensorclass with a lazy stack and non-tensors)
          publisher      publish big versions on a server of its own until killed (ARG: MiB)
          ref-client     the reference's pipe connecting to PORT, then receiving
          ref-listener   the reference's pipe listening, accepting one client
"""
import asyncio
import json
import os
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCXPY_CONNECT_TIMEOUT", "20")

import torch  # noqa: E402

from tensordict_cpp import tensorclass  # noqa: E402

TIMEOUT = 20.0
ROLE, PORT, ARG = "", 0, 0  # set by main()


@tensorclass
class Batch:
    """The publisher imports this module for it; a subscriber pulling one imports it too."""
    obs: torch.Tensor
    inner: object
    label: str


def say(**fields):
    print(json.dumps(fields), flush=True)


def weights(lib, v):
    td = lib.TensorDict(bias=torch.full((3,), float(v)), steps=torch.full((2,), v),
                        batch_size=[])
    td["layer", "w"] = torch.full((8, 3), float(v), dtype=torch.float64)
    return td


def holds(td, v):
    return all(bool((leaf == v).all()) for leaf in td.values(True, True))


def policy(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def classes_version(lib, v):
    """A tensorclass holding a lazy stack and non-tensor entries, all of version v."""
    members = [lib.TensorDict(x=torch.full((2,), float(v))) for _ in range(3)]
    inner = lib.lazy_stack(members)
    return Batch(obs=torch.full((3, 2), float(v)), inner=inner, label=f"v{v}", batch_size=[3])


def subscribe():
    import tensordict_cpp
    from tensordict_cpp import Subscriber, TensorDict, TensorDictPipe
    from tensordict_cpp.errors import NoPublisherError

    pipe = TensorDictPipe.connect_sync("127.0.0.1", PORT, timeout=TIMEOUT)
    sub = Subscriber(pipe)
    last, seen = ARG, []
    if ROLE == "sub-params":  # a live module's parameters, in place
        net = policy(1000)
        params = TensorDict.from_module(net, as_module=True)
        ids = [id(p) for p in net.parameters()]
        x = torch.randn(5, 4)
        while sub.version < last:
            v = sub.pull(params, timeout=TIMEOUT)
            assert v is not None and v > (seen[-1] if seen else 0)
            torch.testing.assert_close(net(x), policy(v)(x))  # one whole version
            seen.append(v)
        assert [id(p) for p in net.parameters()] == ids
        td = params
    elif ROLE == "sub-poll":
        td = None
        while td is None:
            td = sub.pull(timeout=0)
            time.sleep(0.001)
        seen.append(sub.version)
        while sub.version < last:
            v = sub.pull(td, timeout=0)
            if v is None:
                time.sleep(0.001)
            else:
                assert holds(td, v)
                seen.append(v)
    else:
        td = sub.pull(timeout=TIMEOUT, allow_import=True)
        if ROLE == "sub-classes":
            assert type(td).__name__ == "Batch", type(td)
        seen.append(sub.version)
        storage = td["obs"].data_ptr() if ROLE == "sub-classes" else td["layer", "w"].data_ptr()
        while sub.version < last:
            v = sub.pull(td, timeout=TIMEOUT)
            assert v is not None and v > seen[-1]
            if ROLE == "sub-classes":
                assert bool((td.obs == v).all()) and td.label == f"v{v}"
                assert all(bool((m["x"] == v).all()) for m in td.inner.tensordicts)
            else:
                assert holds(td, v)
            seen.append(v)
        now = td["obs"].data_ptr() if ROLE == "sub-classes" else td["layer", "w"].data_ptr()
        assert now == storage, "a pull in place moved the storage"
    # Nothing newer: None after the timeout, the pipe usable.
    t0 = time.monotonic()
    none = sub.pull(td, timeout=0.3) is None
    say(seen=seen, none=none, waited=time.monotonic() - t0, transports=pipe._cpp.transports)
    try:
        sub.pull(td, timeout=TIMEOUT)
        say(end="no error")
    except NoPublisherError as e:
        say(end="closed" if sub.publisher_closed else f"NoPublisherError: {e}")
    pipe.close()
    del tensordict_cpp


def publish_forever():
    from tensordict_cpp import Publisher, TensorDict, TensorDictServer
    server = TensorDictServer(0, timeout=TIMEOUT)
    pub = Publisher(server, max_slots=2)
    say(port=server.port)
    td = TensorDict(x=torch.zeros(ARG << 18), batch_size=[])  # ARG MiB of float32
    v = 0
    while True:
        v += 1
        td["x"].fill_(v)
        pub.publish(td)
        time.sleep(0.01)


async def reference(role):
    from tensordict._ucxx import TensorDictPipe
    if role == "ref-listener":  # as TensorDictPipe.listen, which says its port only later
        import ucxx
        connected = asyncio.get_running_loop().create_future()

        async def on_connect(ep):
            if not connected.done():
                connected.set_result(ep)

        listener = ucxx.create_listener(on_connect, port=0)
        say(port=listener.port)
        TensorDictPipe(await asyncio.wait_for(connected, TIMEOUT), listener=listener)
        await asyncio.sleep(TIMEOUT)
        return
    pipe = await TensorDictPipe.connect("127.0.0.1", PORT)
    say(connected=True)
    try:
        await asyncio.wait_for(pipe.arecv(), TIMEOUT)
        say(end="received")
    except Exception as e:  # noqa: BLE001 - reported to the test
        say(end=f"{type(e).__name__}: {e}")


def main():
    global ROLE, PORT, ARG
    ROLE, PORT = sys.argv[1], int(sys.argv[2])
    ARG = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if ROLE.startswith("sub-"):
        subscribe()
    elif ROLE == "publisher":
        publish_forever()
    else:
        asyncio.run(reference(ROLE))


if __name__ == "__main__":
    main()
