import os
import pathlib

import pytest
import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD_DIR = pathlib.Path(os.environ.get("TENSORDICT_BUILD_DIR", ROOT / "build"))


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    return BUILD_DIR


def watchdog(seconds: int):
    """An autouse fixture for a test file: a test that hangs past ``seconds`` fails instead of
    stalling the run (every C++ wait is bounded too). ``watchdog = conftest.watchdog(40)``."""
    import signal

    @pytest.fixture(autouse=True)
    def fixture():
        def expired(*_):
            raise TimeoutError(f"test exceeded its {seconds} s budget")

        old = signal.signal(signal.SIGALRM, expired)
        signal.alarm(seconds)
        yield
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)

    return fixture


def built(name: str) -> pathlib.Path:
    """Path of a program built by CMake; fails clearly when it is missing."""
    path = BUILD_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/setup first")
    return path


def to_reference(td):
    """Our TensorDict as the reference's: the same entries in the same order, nested levels
    converted, non-tensor entries as the reference's NonTensorData."""
    import tensordict
    from tensordict_cpp import NonTensorData, TensorDict

    out = tensordict.TensorDict({}, batch_size=td.batch_size, device=td.device)
    for key, value in td.items():
        if isinstance(value, NonTensorData):
            value = tensordict.NonTensorData(value.data, batch_size=value.batch_size,
                                             device=value.device)
        elif isinstance(value, TensorDict):
            value = to_reference(value)
        out.set(key, value)
    return out


def from_reference(td):
    """The reference's TensorDict as ours (the inverse of to_reference)."""
    import tensordict
    from tensordict_cpp import NonTensorData, TensorDict

    out = TensorDict({}, batch_size=td.batch_size, device=td.device)
    for key, value in td.items():
        if tensordict.is_non_tensor(value):
            value = NonTensorData(value.data, batch_size=value.batch_size, device=value.device)
        elif isinstance(value, tensordict.TensorDict):
            value = from_reference(value)
        out.set(key, value)
    return out


def describe(td):
    """Either implementation's TensorDict as plain data, to compare the two: entries in
    insertion order, each ("tensor", dtype, shape, values), ("non_tensor", data, batch size)
    or ("td", batch size, entries)."""
    import tensordict
    import torch
    from tensordict_cpp import NonTensorData

    out = []
    for key, value in td.items():
        if isinstance(value, NonTensorData) or tensordict.is_non_tensor(value):
            out.append((key, "non_tensor", value.data, list(value.batch_size)))
        elif isinstance(value, torch.Tensor):
            out.append((key, "tensor", str(value.dtype), list(value.shape), value.tolist()))
        else:
            out.append((key, "td", list(value.batch_size), describe(value)))
    return out


# A rank tells another that it is ready (a message on a tag of its own), for the tests whose
# ranks run publication beside plain sends: test_publication.py, test_publication_shm.py,
# test_timeouts.py.
READY = 9000


def ready(dst):
    dist.send(torch.ones(1), dst=dst, tag=READY)


def await_ready(src):
    dist.recv(torch.zeros(1), src=src, tag=READY)
