"""A user's program, type-checked by tests/python/test_typing.py with ``mypy --strict``: every
call is the public API, every annotation what it returns. Never run."""
from __future__ import annotations

import torch

import tensordict_cpp
from tensordict_cpp import (MemoryMappedTensor, Publisher, Subscriber, TensorDict,
                            TensorDictPipe, TensorDictServer)


def weights() -> TensorDict:
    td = TensorDict(w=torch.zeros(4, 4), batch_size=[])
    td["b"] = torch.ones(4)
    return td.consolidate()


def trainer(server: TensorDictServer) -> int:
    pub = Publisher(server, max_slots=2)
    version: int = pub.publish(weights(), timeout=1.0)
    stats: list[dict[str, object]] = pub.stats()
    epoch: int = pub.epoch
    pub.close()
    return version + len(stats) + epoch


async def worker(port: int) -> int | None:
    pipe = await TensorDictPipe.connect("127.0.0.1", port, timeout=5.0)
    sub = Subscriber(pipe)
    td = weights()
    version = await sub.apull(td, timeout=2.0)
    async for v in sub.updates(td):
        version = v
    closed: bool = sub.publisher_closed
    return version if not closed else None


def shapes(td: TensorDict) -> tuple[torch.Size, int, list[str]]:
    batch: torch.Size = td.batch_size
    nested = td.unsqueeze(0).squeeze(0)
    return batch, nested.numel(), [str(k) for k in td.keys()]


def memmap(path: str) -> MemoryMappedTensor:
    return MemoryMappedTensor.from_tensor(torch.zeros(3), filename=path)


def transfers(td: TensorDict) -> None:
    td.send(1, timeout=5.0)
    td.recv(0, consolidated=False, late="drop")
    td.init_remote(dst=1)
    tensordict_cpp.set_log_level("info")
