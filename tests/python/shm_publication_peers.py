"""One subscriber process of tests/python/test_publication_shm.py, over a pipe to the test's
TensorDictServer on the same host. It prints JSON lines on stdout, flushed.

    python shm_publication_peers.py ROLE PORT LAST [TRANSPORT]
    ROLE: copy     pull by copy until version LAST, checking every element of every pull
          zero     pull zero-copy into a live module's TensorDictParams until version LAST
          write    pull once zero-copy, then write into a leaf (the slot is read-only: the
                   process is killed by SIGSEGV before it says "wrote")
          hold     pull once zero-copy (pinning the slot), say so, then sleep until killed
"""
import json
import os
import sys

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import torch  # noqa: E402

TIMEOUT = 30.0


def say(**fields):
    print(json.dumps(fields), flush=True)


def whole(td, v):
    return all(bool((leaf == v).all()) for leaf in td.values(include_nested=True, leaves_only=True))


def main():
    from tensordict_cpp import Subscriber, TensorDict, TensorDictPipe
    role, port, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    transport = sys.argv[4] if len(sys.argv) > 4 else "auto"
    torch.set_num_threads(1)
    pipe = TensorDictPipe.connect_sync("127.0.0.1", port, timeout=TIMEOUT)
    sub = Subscriber(pipe, transport=transport)
    pulls = torn = 0
    if role == "copy":
        td = sub.pull(timeout=TIMEOUT)
        while True:
            torn += not whole(td, sub.version)
            pulls += 1
            if sub.version >= last:
                break
            assert sub.pull(td, timeout=TIMEOUT) is not None
    elif role == "zero":
        net = torch.nn.Linear(64, 64)
        params = TensorDict.from_module(net, as_module=True)
        ids = [id(p) for p in net.parameters()]
        while sub.version < last:
            v = sub.pull(params, timeout=TIMEOUT, zero_copy=True)
            assert v is not None
            torn += not all(bool((p == v).all()) for p in net.parameters())
            pulls += 1
        assert [id(p) for p in net.parameters()] == ids  # the same Parameters, viewing the slot
        out = net(torch.ones(1, 64))
        assert bool((out == last * 64 + last).all()), out
    elif role == "hold":
        sub.pull(timeout=TIMEOUT, zero_copy=True)
        say(pulled=sub.version, transport=sub.transport)
        import time
        time.sleep(600)
        return
    elif role == "write":
        td = sub.pull(timeout=TIMEOUT, zero_copy=True)
        say(pulled=sub.version, transport=sub.transport)
        leaf = next(iter(td.values(include_nested=True, leaves_only=True)))
        leaf.fill_(-1.0)
        say(wrote=True)
        return
    say(transport=sub.transport, pulls=pulls, torn=torn, version=sub.version)
    sub.release()
    pipe.close()


if __name__ == "__main__":
    main()
