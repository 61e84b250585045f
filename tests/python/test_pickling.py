"""Pickling ours as the reference pickles its own: pickle, torch.save / torch.load (with
weights_only=True for everything but tensorclasses), and multiprocessing queues (shared memory),
for TensorDicts, consolidated ones, lazy stacks, non-tensor entries, UnbatchedTensor,
tensorclasses and TensorDictParams."""
import io
import pickle

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import tensordict_cpp
from tensordict_cpp import (MetaData, NonTensorStack, TensorDict, TensorDictParams,
                            UnbatchedTensor, tensorclass)


@tensorclass
class Sample:
    obs: torch.Tensor
    label: str


def cases():
    td = TensorDict(a=torch.arange(12.0).reshape(4, 3), b={"c": torch.arange(4)},
                    batch_size=[4])
    td["text"] = NonTensorStack(*[f"t{i}" for i in range(4)])
    td["cfg"] = MetaData("config", batch_size=[4])
    td["s"] = "same"
    td["u"] = UnbatchedTensor(torch.ones(2, 5))
    plain = TensorDict(a=torch.zeros(2, 2), n={"x": torch.ones(2, 3, dtype=torch.int8)},
                       batch_size=[2], device="cpu")
    return {
        "rich": td,
        "locked": plain.clone().lock_(),
        "consolidated": plain.consolidate(),
        "lazy": tensordict_cpp.lazy_stack([TensorDict(a=torch.zeros(3)), TensorDict(a=torch.ones(4))]),
        "empty": TensorDict(batch_size=[3]),
    }


def same(a, b, lock=True):
    assert type(a) is type(b)
    assert a.batch_size == b.batch_size and a.device == b.device
    assert not lock or a.is_locked == b.is_locked
    assert repr(a) == repr(b)
    if isinstance(a, tensordict_cpp.LazyStackedTensorDict):
        assert a.stack_dim == b.stack_dim and len(a.tensordicts) == len(b.tensordicts)
        for x, y in zip(a.tensordicts, b.tensordicts):
            same(x, y, lock)
        return
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        assert type(x) is type(y), key
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert x.tolist() == y.tolist() if hasattr(x, "tolist") else x.data == y.data, key


@pytest.mark.parametrize("case", ["rich", "locked", "consolidated", "lazy", "empty"])
def test_pickle_and_torch_save_round_trip(case):
    td = cases()[case]
    # A consolidated TensorDict comes back unlocked, as the reference's (its metadata's lock).
    lock = case != "consolidated"
    same(pickle.loads(pickle.dumps(td)), td, lock)
    buffer = io.BytesIO()
    torch.save(td, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=True)  # every global allowlisted
    same(back, td, lock)
    if case == "consolidated":
        assert back.is_consolidated() and not back.is_locked


def test_tensorclasses_and_params_round_trip():
    sample = Sample(obs=torch.ones(3, 2), label="x", batch_size=[3])
    back = pickle.loads(pickle.dumps(sample))
    assert type(back) is Sample and torch.equal(back.obs, sample.obs) and back.label == "x"
    buffer = io.BytesIO()
    torch.save(sample, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):  # the user's class: not allowlisted
        torch.load(buffer, weights_only=True)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False).label == "x"

    module = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    params = TensorDictParams(TensorDict.from_module(module))
    back = pickle.loads(pickle.dumps(params))
    assert type(back) is TensorDictParams
    assert [n for n, _ in back.named_parameters()] == [n for n, _ in params.named_parameters()]
    assert [n for n, _ in back.named_buffers()] == [n for n, _ in params.named_buffers()]
    assert isinstance(back["0", "weight"], nn.Parameter)
    assert torch.equal(back["0", "weight"], module[0].weight)


def consumer(queue, results):
    td = queue.get()
    results.put((td["a"].sum().item(), td.get("text").tolist(), td["u"].shape,
                 td["a"].is_shared()))
    td["a"].add_(1)  # shared memory: the producer sees it
    results.put("done")


def test_a_multiprocessing_queue_shares_the_leaves():
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    td = cases()["rich"]
    td.share_memory_()
    proc = ctx.Process(target=consumer, args=(queue, results))
    proc.start()
    try:
        queue.put(td)
        total, text, ushape, shared = results.get(timeout=60)
        assert results.get(timeout=60) == "done"
        assert total == 66.0 and text == ["t0", "t1", "t2", "t3"] and shared
        assert ushape == torch.Size([2, 5])
        assert td["a"].sum().item() == 66.0 + 12  # written by the consumer
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
