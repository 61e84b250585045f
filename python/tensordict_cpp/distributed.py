"""Run a function on several local ranks, each with a default process group.

>>> from tensordict_cpp.distributed import run
>>> run(fn)   # calls fn(rank, world_size) in 2 spawned processes
"""
from __future__ import annotations

import ast
import datetime
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as tmp

__all__ = ["run"]


def run(fn: Callable[[int, int], object], world_size: int = 2, backend: str = "gloo", *,
        timeout: float | None = 600.0, group_timeout: float = 60.0) -> None:
    """Calls ``fn(rank, world_size)`` in ``world_size`` new processes and waits for all of them.

    Each process is started with the ``spawn`` method and gets a default process group
    (``torch.distributed.init_process_group``) over a file store in a temporary directory,
    with Gloo on the loopback interface, destroyed when ``fn`` returns. Because ``spawn``
    re-imports the main script in each process, a script calls ``run`` under
    ``if __name__ == "__main__":`` (or from a function called there): a call at its top level
    raises RuntimeError instead of letting every rank run the script's top-level code again.
    ``fn`` must be picklable (a module-level function).

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set),
    no process is started: the default group is initialised with ``env://`` and ``fn`` runs in
    this process.

    Args:
        fn (callable): the function every rank runs, as ``fn(rank, world_size)``.
        world_size (int, optional): the number of ranks. Defaults to ``2``.
        backend (str, optional): the ``torch.distributed`` backend. Defaults to ``"gloo"``.

    Keyword Args:
        timeout (float, optional): seconds after which the ranks still running are killed and
            ``TimeoutError`` is raised; ``None`` waits forever. Defaults to ``600``.
        group_timeout (float, optional): the timeout, in seconds, of each rank's default group:
            its blocking calls fail after it. Defaults to ``60``.

    Raises:
        torch.multiprocessing.ProcessRaisedException: as soon as a rank raises; its message
            carries that rank's traceback, and the other ranks are terminated.
        torch.multiprocessing.ProcessExitedException: if a rank dies without raising.
        TimeoutError: if ``timeout`` passes.
        ValueError: for a bad ``world_size``, a ``WORLD_SIZE`` that differs under torchrun, or
            only some of the four env:// variables set.
        RuntimeError: when called at the top level of the main script outside the
            ``__main__`` guard.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return  # the main module being re-imported by a rank that starts (see _check_guard)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    group_td = datetime.timedelta(seconds=group_timeout)
    launcher = [v for v in _ENV_VARS if v in os.environ]
    if launcher and len(launcher) < len(_ENV_VARS):
        missing = ", ".join(v for v in _ENV_VARS if v not in os.environ)
        raise ValueError(f"run: the env:// variables are set only in part: {missing} missing. "
                         "A launcher sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; unset "
                         "them all to let run() start its own ranks")
    if launcher:
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(f"run(world_size={world_size}) under a launcher with "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']}")
        rank = int(os.environ["RANK"])
        _run_rank(fn, rank, world_size, backend, "env://", group_td)
        return
    _check_guard(sys._getframe(1))
    with tempfile.TemporaryDirectory(prefix="tensordict_cpp_run_") as scratch:
        init_method = "file://" + os.path.join(scratch, "store")
        ctx = tmp.start_processes(_spawned_rank, args=(fn, world_size, backend, init_method,
                                                       group_td),
                                  nprocs=world_size, join=False, start_method="spawn")
        deadline = None if timeout is None else time.monotonic() + timeout
        # join() raises as soon as one rank fails, after terminating the others.
        while not ctx.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                raise TimeoutError(f"run: ranks still running after {timeout} s were killed")


_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_guard(caller) -> None:
    """Refuses a call from the top level of the main script outside ``if __name__ ==
    "__main__":``: each rank is a spawned process that imports the script again, and would run
    every top-level statement of it once more (prints, data loading, ...)."""
    if caller.f_code.co_name != "<module>" or caller.f_globals.get("__name__") != "__main__":
        return  # called from a function (its caller may be guarded) or from an imported module
    path = caller.f_globals.get("__file__")
    if not path or not os.path.isfile(path):
        return  # python -c or an interactive session: spawn does not import it again
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)

    def is_main_test(node) -> bool:
        return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__"
                        for c in node.test.comparators))

    line = caller.f_lineno
    for node in ast.walk(tree):
        if is_main_test(node) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return
    raise RuntimeError(
        f"run() is called at the top level of {path} (line {line}) outside "
        "`if __name__ == \"__main__\":`. Each rank is a new process that imports the script "
        "again (the spawn start method) and would run its top-level code once more. Put the "
        "call under that guard.")


def _spawned_rank(rank: int, fn, world_size: int, backend: str, init_method: str,
                  group_timeout: datetime.timedelta) -> None:
    # Loopback only: Gloo otherwise binds to the address the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _run_rank(fn, rank, world_size, backend, init_method, group_timeout)
    # fn and the group's teardown succeeded: leave now. Interpreter shutdown would run the
    # destructors of torch's and Gloo's threads, which can abort a rank that has succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_rank(fn, rank, world_size, backend, init_method, group_timeout) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=group_timeout)
    try:
        fn(rank, world_size)
    finally:
        dist.destroy_process_group()
