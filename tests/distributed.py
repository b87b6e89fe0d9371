"""Run a function on several CPU processes joined by a gloo process group (test helper)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_fastscale.emulation.faults import free_port


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks share two cores: avoid oversubscription
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        queue.put((rank, fn(rank, world_size, *args)))
    finally:
        dist.destroy_process_group()


class ReleaseProcessGroup(pl.Callback):
    """Destroy the process group when a ``ddp_spawn`` Trainer ends, in each worker.

    Lightning leaves it alive and the worker then exits with gloo's threads still running;
    once in a full-suite run (2026-11-30) a worker aborted there ("terminate called without an
    active exception", SIGABRT). ``teardown`` is the Trainer's last hook, after the strategy's.
    """

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (module level) and its return value picklable. A process that
    fails makes this raise; the whole run is bounded by ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _entry, args=(world_size, free_port(), fn, args, queue), nprocs=world_size,
        join=False, start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}

    def drain() -> None:
        # Read while the ranks run: a result larger than the pipe buffer would otherwise
        # block its sender forever.
        while not queue.empty():
            rank, value = queue.get()
            results[rank] = value

    while not procs.join(timeout=0.2):
        drain()
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            raise TimeoutError(f"distributed run of {fn.__name__} exceeded {timeout}s")
    drain()
    return [results[r] for r in range(world_size)]


def run_node_launches(command: str, cwd: Path, env: dict[str, str], nodes: int = 2,
                      timeout: float = 280) -> tuple[list[int | None], str]:
    """``bash -c command`` once per node with ``NODE_RANK`` 0, 1, ... (a launcher per node, as on a
    cluster); their exit codes and output. Past ``timeout`` every launch's process group is killed."""
    procs = [subprocess.Popen(["bash", "-c", command], cwd=cwd, text=True, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**env, "NODE_RANK": str(rank)})
             for rank in range(nodes)]
    deadline, out = time.monotonic() + timeout, ""
    try:
        for proc in procs:
            out += proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [proc.returncode for proc in procs], out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``: how far ``a`` (e.g. final weights) is from the reference ``b``."""
    return ((a - b).norm() / b.norm()).item()


def same_on_all_ranks(t: torch.Tensor) -> bool:
    """Whether every rank of the default group holds exactly ``t`` (collective)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(o, t) for o in out)
