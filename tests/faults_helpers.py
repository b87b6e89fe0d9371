"""Helpers for the fault tests and benchmarks/faults.py: signal a process at a given step, log steps."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl


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
