"""Helpers for ``faults.py`` and the fault tests: launch a 2-rank run, signal a process
at a given step, log steps and the batches they saw."""
from __future__ import annotations

import hashlib
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch

# A 2-rank fastscale-train job with the large-batch recipe, small enough for a test (CPU, gloo):
RECIPE_RUN = [
    "data.train_size=256", "data.val_size=32", "data.batch_size=32", "data.resolution=16",
    "model.model_kwargs.widths=[8,8,8]", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1", "experiment=large_batch", "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.batch_size_ramp.lr_milestones=[1]",
    "callbacks.progressive_resizing.size_increment=2", "trainer.devices=2",
    "trainer.accelerator=cpu", "strategy=ddp", "logger=csv",
]

REPO = Path(__file__).resolve().parents[1]


def start(run_dir: Path, *extra: str, run: Sequence[str] = RECIPE_RUN, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Launch ``fastscale-train *run *extra`` in ``run_dir``, in a new process group (``env``: extra variables)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("WANDB_API_KEY", None)
    return popen_group([sys.executable, "-m", "lightning_fastscale.train", *run, f"hydra.run.dir={run_dir}", *extra],
                       cwd=run_dir.parent, env=env)


def popen_group(command: Sequence[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``command`` in a new process group, output piped, ready for :func:`finish`: its Python
    processes print every thread's stack on SIGABRT (what :func:`kill_group` sends first) and write
    no core file."""
    return subprocess.Popen(
        list(command), cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
    )


def finish(proc: subprocess.Popen, timeout: float = 420) -> tuple[int, str]:
    """Wait for a run from :func:`start`; past ``timeout`` kill its process group and fail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"run did not finish in {timeout} s:\n{stacks(kill_group(proc))}") from None
    except BaseException:  # pytest-timeout's failure or Ctrl-C: what the run printed, stacks included
        print(stacks(kill_group(proc)), file=sys.stderr)
        raise
    return proc.returncode, out


def stacks(output: str, limit: int = 60000) -> str:
    """The end of a killed run's output without faulthandler's lists of extension modules, which
    fill a short tail and hide the stacks printed before them (a list another process's output
    interrupts is kept)."""
    return re.sub(r"Extension modules:[\w., \n]*\(total: \d+\)", "", output)[-limit:]


def finish_all(*procs: subprocess.Popen, timeout: float = 420) -> list[str]:
    """Each run's output once all have exited 0, or 75 after a preemption checkpoint (retryable:
    "not finished"); on the first failure every run is killed."""
    outputs = []
    try:
        for proc in procs:
            code, out = finish(proc, timeout)
            assert code == 0 or (code == 75 and "PreemptionCheckpoint: SIG" in out), out[-3000:]
            outputs.append(out)
    finally:  # a failure leaves no run behind
        for proc in procs:
            kill_group(proc)
    return outputs


def kill_group(proc: subprocess.Popen) -> str:
    """End the process group of a run from :func:`start` (the run and the ranks it started, nothing
    else): SIGABRT, so each process prints its stacks, then SIGKILL; return what it printed. A
    no-op for a run already waited for."""
    if proc.returncode is not None:
        return ""  # reaped: its pid, hence the group id, is no longer ours to signal
    out = ""
    for signum, wait in ((signal.SIGABRT, 10.0), (signal.SIGKILL, None)):  # stacks first, then the end
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:  # a process of the group still holds the output open
            continue
    return out or ""


class SignalAtStep(pl.Callback):
    """Send ``signum`` on rank ``rank`` when optimizer step ``step`` starts.

    The signal lands in the middle of that step (before its forward pass), as a preemption
    notice would; the step itself must still complete. ``target="parent"`` signals the
    parent process instead (``torchrun``, which then shuts its workers down). With ``stamp``
    the wall-clock time of the signal is written there.
    """

    def __init__(self, step: int, rank: int = 0, signum: str = "SIGTERM", target: str = "self",
                 stamp: str | None = None) -> None:
        if target not in ("self", "parent"):
            raise ValueError(f"target={target!r} must be 'self' or 'parent'")
        self.step = step
        self.rank = rank
        self.signum = signal.Signals[signum]
        self.target = target
        self.stamp = stamp

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if self.stamp:
                Path(self.stamp).write_text(repr(time.time()))
            os.kill(os.getppid() if self.target == "parent" else os.getpid(), self.signum)


class StepLog(pl.Callback):
    """Append ``<global_step>`` to ``<folder>/rank<r>.steps`` after every optimizer step."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{trainer.global_rank}.steps", "a") as f:
            f.write(f"{trainer.global_step}\n")


class BatchLog(pl.Callback):
    """Append ``<global_step> <shape> <labels> <sha1 of the images> <draw>`` to ``<folder>/rank<r>.batches``.

    One line per optimizer step, written after the step, so two runs can be compared batch by
    batch: which samples each rank trained on at each step, their pixels bit for bit, and the
    next number of the global torch generator (``<draw>``, as dropout would draw it), which
    tells whether a resume put the generator back where the run was.
    """

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        images, labels = batch
        digest = hashlib.sha1(images.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank{trainer.global_rank}.batches", "a") as f:
            draw = torch.rand((), dtype=torch.float64).item().hex()
            f.write(f"{trainer.global_step} {tuple(images.shape)} {','.join(map(str, labels.tolist()))} {digest} {draw}\n")


def read_batch_log(folder: Path, rank: int) -> dict[int, str]:
    """``{global_step: "<shape> <labels> <sha1>"}`` from a :class:`BatchLog` file; a step logged twice fails."""
    steps: dict[int, str] = {}
    for line in (folder / f"rank{rank}.batches").read_text().splitlines():
        step, rest = line.split(" ", 1)
        assert int(step) not in steps, f"step {step} ran twice on rank {rank}"
        steps[int(step)] = rest
    return steps


class KillDuringSave(pl.Callback):
    """Kill this process in the middle of writing the first checkpoint saved at or after ``step``.

    Caps the size of any file the process writes (``RLIMIT_FSIZE``) at ``max_bytes`` just
    before the checkpoint is written: the write that crosses it is killed by ``SIGXFSZ``, as a
    node failure or the OOM killer would kill it, with part of the file on disk. Logs stay
    below the cap. No core file is written.
    """

    def __init__(self, step: int, max_bytes: int = 20_000, rank: int = 0) -> None:
        self.step, self.max_bytes, self.rank = step, max_bytes, rank

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.global_step >= self.step and trainer.global_rank == self.rank:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: the write would only fail
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_bytes, self.max_bytes))


class FillDiskAtStep(pl.Callback):
    """Fill the filesystem of ``path`` (leaving ``leave_bytes``) before the first checkpoint
    saved at or after ``step``, so that checkpoint's write runs out of space."""

    def __init__(self, step: int, path: str, leave_bytes: int = 16_384) -> None:
        self.step, self.path, self.leave_bytes = step, Path(path), leave_bytes
        self.done = False

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.done or trainer.global_step < self.step or trainer.global_rank != 0:
            return
        self.done = True
        stat = os.statvfs(self.path.parent)
        free = stat.f_bavail * stat.f_frsize
        with open(self.path, "wb") as f:
            f.write(b"\0" * max(0, free - self.leave_bytes))


class FinalCheckpoint(pl.Callback):
    """Write the run's final state to ``path`` when training ends (all ranks take part, as in any
    ``Trainer.save_checkpoint``), outside the checkpoint folder ``resume=auto`` reads: a run to
    compare, whatever ``ModelCheckpoint`` decided to keep."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)
