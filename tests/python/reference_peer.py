"""Which reference tensordict the rank (or process) on the other side of an interop test runs:
0.15.3, the .venv's, or 0.14.3, the one torchrl 0.14.1 requires, installed by scripts/peers
into .peers/td014 (scripts/setup runs it) beside torchrl.

    @pytest.mark.parametrize("reference", REFERENCES)
    def test_x(reference):
        run(on_reference(reference, ranks), world_size=2)       # run()'s ranks
        subprocess.Popen([...], env=reference_env(reference))   # a process of its own

Every rank of a run() sees the same reference: the ranks of ours do not import it (only the
conversions of reference objects look it up, where a test made one). This module imports no
tensordict, so that a rank can put 0.14.3 first on its path before anything imports one.
"""
from __future__ import annotations

import functools
import importlib
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CURRENT = "0.15.3"  # requirements-dev.txt's, in the .venv
PEER_DIRS = {"0.14.3": ROOT / ".peers" / "td014"}
REFERENCES = [CURRENT, *PEER_DIRS]


def peer_dir(version: str) -> pathlib.Path | None:
    """The directory to put first on the path for ``version`` (None: the .venv's); fails the
    test, naming what installs it, when it is missing."""
    if version == CURRENT:
        return None
    path = PEER_DIRS[version]
    if not (path / "tensordict" / "__init__.py").exists():
        import pytest

        pytest.fail(f"tensordict {version} is not in {path}: run scripts/peers (scripts/setup "
                    f"does)")
    return path


def on_reference(version: str, fn):
    """``fn`` (a module-level function or a functools.partial of one) as a rank function for
    run() whose ranks import the reference ``version``."""
    path = peer_dir(version)
    if path is None:
        return fn
    args, kwargs = (), {}
    if isinstance(fn, functools.partial):
        fn, args, kwargs = fn.func, fn.args, fn.keywords
    return functools.partial(_rank, str(path), version, fn.__module__, fn.__qualname__, args,
                             kwargs)


def _rank(path, version, module, qualname, args, kwargs, rank, world_size):
    # The test's module is imported here, after the path: its `import tensordict` finds 0.14.3.
    sys.path.insert(0, path)
    import tensordict

    if tensordict.__version__ != version or not tensordict.__file__.startswith(path):
        raise RuntimeError(f"rank {rank}: expected tensordict {version} from {path}, got "
                           f"{tensordict.__version__} from {tensordict.__file__}")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn(*args, rank, world_size, **kwargs)


def reference_env(version: str, env=None) -> dict:
    """The environment of a process of its own that imports the reference ``version``."""
    env = dict(os.environ if env is None else env)
    path = peer_dir(version)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return env


def is_014() -> bool:
    """In a rank or peer process: whether the reference it imports is 0.14.x."""
    import tensordict

    return tensordict.__version__.startswith("0.14.")

