"""Test helpers for the fault tests: a callback that signals its own process at a given step."""
from __future__ import annotations

import os
import signal

import lightning.pytorch as pl


class SignalAtStep(pl.Callback):
    """Send ``signum`` to this process on rank ``rank`` when optimizer step ``step`` starts.

    The signal lands in the middle of that step (before its forward pass), as a preemption
    notice would; the step itself must still complete.
    """

    def __init__(self, step: int, rank: int = 0, signum: str = "SIGTERM") -> None:
        self.step = step
        self.rank = rank
        self.signum = signal.Signals[signum]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)
