"""Run a function on W CPU ranks (gloo), fail with the failing rank's traceback, never hang.

Ranks are forked from a forkserver that has imported torch and dmuon_fsdp once (``PRELOAD``);
each rank starts without a process group or CUDA, as if spawned, but with the environment the
forkserver had when it started (the first run in this process): pass settings as arguments,
not through os.environ."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmuon_fsdp._step import comm


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple, pg_timeout: float
) -> None:
    faulthandler.enable()  # a native abort prints every thread's Python stack to the test log
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # Rank 0 hosts the job's store: none may leave while another still needs it (a rank
        # that ends early, e.g. on an expected error, would reset the others' connections). A
        # settled collective (see dmuon_fsdp._step.comm.settle) leaves nothing to release at exit; a
        # group the test left broken on purpose (a timed-out collective) fails it, which is fine.
        with contextlib.suppress(RuntimeError):
            comm.all_max(torch.zeros(1), None)
    finally:
        dist.destroy_process_group()
    # and a normal interpreter exit: a rank that aborts there fails the test


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, pg_timeout: float = 60.0
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` new processes; return each result.

    ``fn`` must be a module-level function. An exception in any rank re-raises here with that
    rank's traceback; ranks still running after ``timeout`` seconds are killed and the test fails.
    ``pg_timeout`` is the process group's own timeout for a collective. A port taken by another
    test between choosing it and binding it is retried with a new port (twice at most).
    """
    for _ in range(2):
        try:
            return _run_once(fn, world_size, args, timeout, pg_timeout)
        except mp.ProcessRaisedException as e:
            if "address already in use" not in str(e).lower():
                raise
    return _run_once(fn, world_size, args, timeout, pg_timeout)


# Ranks fork from a server that has imported these once, instead of each importing them anew
# (about 4 s of CPU per rank here: most of a short test).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo", "dmuon_fsdp"]


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, pg_timeout: float
) -> list[Any]:
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank_main,
            args=(fn, world_size, free_port(), out_dir, args, pg_timeout),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        join(context, timeout, f"{fn.__name__} on {world_size} ranks")
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)
        ]


def join(context: Any, timeout: float, label: str) -> None:
    """Wait for the processes ``torch.multiprocessing.start_processes`` started (a process's
    exception re-raises here), killing them after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{label} did not finish in {timeout:.0f}s")


def _sampled_main(
    index: int, fn: Callable, world_size: int, ranks: list[int], out_dir: str, args: tuple
) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    rank = ranks[index]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_sampled(
    fn: Callable[..., Any], world_size: int, ranks: list[int], *args: Any, timeout: float = 180.0
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` for each of ``ranks`` of a ``world_size``-rank job, a
    process each standing for its rank under torch's fake process group (collectives do
    nothing: what ``fn`` records of them is what the rank would send); return each result."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _sampled_main,
            args=(fn, world_size, ranks, out_dir, args),
            nprocs=len(ranks),
            join=False,
            start_method="forkserver",
        )
        join(context, timeout, f"{fn.__name__} as ranks {ranks} of {world_size}")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in ranks]


def cpu_mesh():
    """A 1-D CPU mesh over the whole job. Pass it to ``fully_shard``: without one, FSDP2 picks the
    machine's accelerator even when the process group is gloo."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))
