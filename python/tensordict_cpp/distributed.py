"""Run a function on several local ranks, each with a default process group.

>>> from tensordict_cpp.distributed import run
>>> run(fn)   # calls fn(rank, world_size) in 2 spawned processes
"""
from __future__ import annotations

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
    re-imports the main module in each process, a script may call ``run`` at top level without
    an ``if __name__ == "__main__"`` guard: inside a starting rank, that call returns at once.
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
        ValueError: for a bad ``world_size``, or a ``WORLD_SIZE`` that differs under torchrun.
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return  # the main module being re-imported by a rank that starts
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    group_td = datetime.timedelta(seconds=group_timeout)
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(f"run(world_size={world_size}) under a launcher with "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']}")
        rank = int(os.environ["RANK"])
        _run_rank(fn, rank, world_size, backend, "env://", group_td)
        return
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
