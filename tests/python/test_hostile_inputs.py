"""Hostile inputs and honest large ones (docs/reliability.md): lying gather_and_stack headers, a
pickle longer than announced, over-budget metadata drained, lazy stacks of 100,000 members over
Gloo and the pipe, memmap folders holding links, FIFOs and oversized meta.json, shared levels.

Each case runs in fresh processes (real Gloo on 127.0.0.1 where a peer is involved). Memory is
the growth of the process's peak RSS over its RSS just before the case: an upper bound of what
the case made it commit."""
import concurrent.futures
import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import tensordict as ref
from tensordict_cpp import TensorDict, TensorDictPipe, lazy_stack
from tensordict_cpp.distributed import run

RUN = dict(timeout=240, group_timeout=60)
MB = 1 << 20


def rss_mb():
    """The resident memory now; also restarts the peak that peak_mb() reads (VmHWM, reset
    through /proc/self/clear_refs: ru_maxrss would keep a forking parent's peak)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def peak_mb():
    return _status_mb("VmHWM")


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def in_fresh_process(code, timeout=120):
    """Runs `code` in a new interpreter (a clean RSS, and a hang ends in a timeout); returns
    its stdout."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# ---- gather_and_stack: headers that lie --------------------------------------------------------
KIND_STORAGE = 2


def lying_header(rank, world_size, announced, budget, expect):
    torch.set_num_threads(1)
    if rank == 0:  # the destination: ours
        td = TensorDict(a=torch.zeros(1, 4), batch_size=[1])
        before = rss_mb()
        kwargs = {} if budget is None else {"max_total_bytes": budget}
        error = dist.DistBackendError if expect == "timeout" else ValueError
        with pytest.raises(error, match=expect if expect != "timeout" else "timed out") as info:
            td.gather_and_stack(0, timeout=4.0, **kwargs)
        growth = peak_mb() - before
        print(f"gather_and_stack, header announcing {announced} bytes, budget {budget}: "
              f"{info.value!s:.160} -- peak RSS growth {growth:.1f} MB", flush=True)
        assert growth < 100
    else:  # a raw torch.distributed rank speaking the header step only
        header = torch.tensor([KIND_STORAGE, announced, announced + 64])
        headers = [torch.empty(3, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(headers, header)
        if expect == "timeout":
            time.sleep(6)  # never sends its buffer: the destination's timeout ends the wait


class _bind:
    """A picklable fn(rank, world_size) with more arguments bound."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self, rank, world_size):
        return self.fn(rank, world_size, *self.args)


@pytest.mark.parametrize("announced,budget,expect", [
    # within the per-rank bound, over the call's: 2 ranks x 2 copies x 100 MiB > 256 MiB
    (100 * MB, 256 * MB, "above this call's budget of max_total_bytes"),
    # beyond the default budget (half this machine's memory)
    (64 << 30, None, "max_total_bytes"),
    # admitted, then never sent: only the destination's own part of the buffer lands
    (32 * MB, None, "timeout"),
])
def test_a_lying_gather_header_costs_no_memory(announced, budget, expect):
    run(_bind(lying_header, announced, budget, expect), 2, **RUN)


# ---- init_remote framing: a pickle longer than announced, over-budget metadata drained ---------
def overrun_and_drain(rank, world_size):
    torch.set_num_threads(1)
    if rank == 0:
        # Announces 180 bytes, sends 4096: Gloo takes a message shorter than the posted buffer,
        # so the receiver posts room for any pickle and names the lie.
        dist.send(torch.tensor([180]), dst=1)
        dist.send(torch.zeros(4096, dtype=torch.uint8), dst=1)
        # Metadata over the reader's budget (a million Nones), "_total_bytes" last as the
        # reference writes it, then the storage: the receiver refuses the metadata, drains
        # the storage, and this send finishes instead of waiting for the group's timeout.
        blob = pickle.dumps({"x": [None] * 1_000_000, "_total_bytes": 4096})
        start = time.monotonic()
        dist.send(torch.tensor([len(blob)]), dst=1)
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=1)
        dist.send(torch.ones(4096, dtype=torch.uint8), dst=1)
        assert time.monotonic() - start < 20
    else:
        with pytest.raises(ValueError, match="announced a metadata pickle of 180 bytes and "
                                             "sent more"):
            TensorDict.from_remote_init(src=0)
        with pytest.raises(ValueError, match="the values read would take more than"):
            TensorDict.from_remote_init(src=0)
    dist.barrier()


def test_a_longer_pickle_is_named_and_a_refused_storage_is_drained():
    run(overrun_and_drain, 2, **RUN)


# ---- honest lazy stacks of 100,000 members --------------------------------------------------
N_MEMBERS = 100_000


def members(lib, n):
    return lib.lazy_stack([lib.TensorDict({"a": torch.full((3,), float(i))}, []) for i in range(n)])


def large_lazy_stacks(rank, world_size):
    torch.set_num_threads(1)
    for lib in (ref, None):  # the reference's init_remote, then ours
        if rank == 0:
            members(lib or sys.modules["tensordict_cpp"], N_MEMBERS).init_remote(dst=1)
        else:
            before = rss_mb()
            got = TensorDict.from_remote_init(src=0)
            growth = peak_mb() - before
            print(f"from_remote_init of {N_MEMBERS} members "
                  f"({'reference' if lib else 'ours'}): peak RSS growth {growth:.0f} MB",
                  flush=True)
            assert len(got.tensordicts) == N_MEMBERS
            for i in (0, 1, N_MEMBERS - 1):
                assert torch.equal(got.tensordicts[i]["a"], torch.full((3,), float(i)))
        dist.barrier()


def test_lazy_stacks_of_100000_members_travel_over_gloo():
    run(large_lazy_stacks, 2, **RUN)


def test_lazy_stacks_of_100000_members_travel_over_the_pipe():
    server = TensorDictPipe.listen_sync(0, "127.0.0.1", timeout=60.0)
    client = TensorDictPipe.connect_sync("127.0.0.1", server.port, timeout=60.0)
    td = members(sys.modules["tensordict_cpp"], N_MEMBERS)
    with server, client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(server.recv)  # a large message waits for its receiver
        client.send(td)
        got = receiving.result(timeout=120)
    assert len(got.tensordicts) == N_MEMBERS
    assert torch.equal(got.tensordicts[N_MEMBERS - 1]["a"], torch.full((3,), N_MEMBERS - 1.0))


# ---- shared levels: walks are linear in the distinct levels -------------------------------------
def test_deeply_shared_levels_build_and_print_fast():
    start = time.monotonic()
    td = TensorDict(a=torch.zeros(2), batch_size=[])
    for _ in range(60):  # 2**60 paths through 61 distinct levels
        td = lazy_stack([TensorDict(x=td, batch_size=td.batch_size),
                         TensorDict(x=td, batch_size=td.batch_size)])
    text = repr(td)
    assert "LazyStackedTensorDict" in text
    # stacks of stacks of one shared member, and of two members sharing theirs: 2**60 paths
    same = TensorDict(a=torch.zeros(2), batch_size=[])
    pair = (TensorDict(a=torch.zeros(2), batch_size=[]), TensorDict(a=torch.ones(2), batch_size=[]))
    for _ in range(60):
        same = lazy_stack([same, same])
        pair = (lazy_stack(list(pair)), lazy_stack(list(pair)))
    for deep in (same, pair[0]):
        assert "a: f32[2]" in repr(deep) and "[" + "2," * 59 + "2]" in repr(deep)
        assert "a" in deep.keys() and ("a",) in deep
    chain = TensorDict(a=torch.zeros(1), batch_size=[])
    for _ in range(1000):
        chain = lazy_stack([chain])
    repr(chain)
    assert time.monotonic() - start < 30


# ---- memmap folders: links, FIFOs, oversized meta.json -----------------------------------------
def saved(tmp_path):
    src = ref.TensorDict(a=torch.arange(4.0), n=ref.TensorDict(b=torch.ones(4, 2), batch_size=[4]),
                         s=ref.NonTensorData("hello"), batch_size=[4])
    src.memmap(tmp_path / "td")
    return tmp_path / "td"


def test_load_memmap_follows_no_link(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(range(16)))
    cases = {
        "a.memmap": lambda d: os.symlink(outside, d / "a.memmap"),
        "n": lambda d: (os.rename(d / "n", tmp_path / "n_elsewhere"),
                        os.symlink(tmp_path / "n_elsewhere", d / "n")),
        "meta.json": lambda d: (os.rename(d / "meta.json", tmp_path / "m.json"),
                                os.symlink(tmp_path / "m.json", d / "meta.json")),
        "s/meta.json": lambda d: (os.rename(d / "s" / "meta.json", tmp_path / "s.json"),
                                  os.symlink(tmp_path / "s.json", d / "s" / "meta.json")),
    }
    for name, plant in cases.items():
        case = tmp_path / name.replace("/", "_")
        case.mkdir()
        d = saved(case)
        if name == "a.memmap":
            os.remove(d / "a.memmap")
        plant(d)
        with pytest.raises(RuntimeError, match=f"{d / name} is a symbolic link"):
            TensorDict.load_memmap(d)
    assert outside.read_bytes() == bytes(range(16))


def test_load_memmap_never_blocks_on_a_fifo(tmp_path):
    for name in ("meta.json", "a.memmap", "n/meta.json"):
        case = tmp_path / name.replace("/", "_")
        case.mkdir()
        d = saved(case)
        os.remove(d / name)
        os.mkfifo(d / name)
        out = in_fresh_process(f"""
            import pytest
            from tensordict_cpp import TensorDict
            with pytest.raises(RuntimeError, match="is not a regular file") as info:
                TensorDict.load_memmap({str(d)!r})
            print(info.value)
        """, timeout=60)
        assert str(d / name) in out


def test_meta_json_memory_is_bounded(tmp_path):
    # 60 MB of small integers (13 bytes of memory per byte of text as JSON values): refused
    # before one value is built.
    big = tmp_path / "big"
    ref.TensorDict(v=ref.NonTensorData([1]), batch_size=[]).memmap(big)
    meta = big / "v" / "meta.json"
    text = meta.read_text()
    meta.write_text(text.replace("[1]", "[" + ", ".join(["1"] * 20_000_000) + "]"))
    out = in_fresh_process(f"""
        import pytest
        from tensordict_cpp import TensorDict
        from test_hostile_inputs import peak_mb, rss_mb
        before = rss_mb()
        with pytest.raises(ValueError, match="would take more than") as info:
            TensorDict.load_memmap({str(big)!r})
        print(peak_mb() - before)
        print(info.value)
    """)
    growth = float(out.splitlines()[0])
    assert growth < 100, out
    assert "bytes per byte of meta.json read" in out

    # Honest values load: a 20 MB string, and lists within the allowance, at three levels.
    ok = tmp_path / "ok"
    inner = ref.TensorDict(v=ref.NonTensorData(list(range(1000))), batch_size=[])
    ref.TensorDict(s=ref.NonTensorData("x" * (20 << 20)), v=ref.NonTensorData(list(range(1000))),
                   n=ref.TensorDict(i=inner, v=ref.NonTensorData([0.5] * 1000), batch_size=[]),
                   batch_size=[]).memmap(ok)
    back = TensorDict.load_memmap(ok)
    assert back["s"] == "x" * (20 << 20) and back["n", "i", "v"] == list(range(1000))
