"""Preemption: on SIGTERM or SLURM's pre-timeout signal, finish the step, checkpoint once, exit.

The handler only records the signal; at the end of an optimizer step all ranks agree (one
all-reduce) whether any got one, then one checkpoint is written, the SLURM job is requeued
and the run exits with ``exit_code`` (75). Why Lightning's own handling falls short, and the
papers (fast.ai 2018, Tencent Cloud 2020): ``docs/faults.md`` ("What it does").

Functional core: `parse_signals`, `slurm_job_id`. Lightning adapter:
[`PreemptionCheckpoint`][lightning_fastscale.faults.PreemptionCheckpoint].
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.exit_codes import ExitCode, end_agreed
from lightning_fastscale.lightning_internals import cluster_environment

log = logging.getLogger(__name__)

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def parse_signals(signals: Sequence[str | int]) -> list[signal.Signals]:
    """``["SIGTERM", "USR1", 12]`` -> signal numbers; unknown or uncatchable ones are refused."""
    if isinstance(signals, (str, int)):
        signals = [signals]
    out: list[signal.Signals] = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            raise ValueError(
                f"PreemptionCheckpoint.signals: {item!r} is not a signal on this system; use names "
                "such as SIGTERM, SIGUSR1, SIGUSR2 (SLURM: the one given to #SBATCH --signal)"
            ) from None
        if sig in _UNCATCHABLE:
            raise ValueError(f"PreemptionCheckpoint.signals: {sig.name} cannot be caught; remove it")
        if sig not in out:
            out.append(sig)
    if not out:
        raise ValueError("PreemptionCheckpoint.signals is empty; give e.g. [SIGTERM, SIGUSR1]")
    return out


def slurm_job_id(environ: dict[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` needs: ``ARRAYJOB_TASK`` for array jobs, else the job id."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


class PreemptionCheckpoint(Checkpoint):
    """Stop cleanly on a preemption signal: finish the step, write one checkpoint, exit.

    Args:
        signals: the signals that mean "you are being stopped". SIGTERM (spot notice,
            ``torchrun`` / Kubernetes shutdown) and SIGUSR1 (Lightning's and many sites'
            choice for ``#SBATCH --signal``) by default.
        dirpath: where the checkpoint goes; default: the first ``ModelCheckpoint``'s folder,
            else ``<default_root_dir>/checkpoints``, so ``resume=auto`` finds it.
        filename: file name; ``{epoch}`` and ``{step}`` are filled in. An existing file is
            never overwritten (a ``-v1``, ``-v2`` ... suffix is added).
        requeue: requeue the SLURM job (``scontrol requeue``) after the checkpoint is written.
            ``None``: when running under SLURM with Lightning's ``auto_requeue`` on.
        exit_code: the status the processes exit with after the checkpoint: 75
            (``ExitCode.PREEMPTED``, retryable), so ``torchrun --max-restarts`` on the nodes
            that remain restarts their workers and they resume; 0 would tell it the run finished.
            The ranks Lightning's own launcher started exit 0 and leave the status to their rank 0
            (`lightning_fastscale.exit_codes.launcher_reports_for`).
        check_every_n_steps: agree on a stop every this many optimizer steps (the agreement is
            one tiny all-reduce and, on GPUs, a device sync; raise it when steps are very short).

    List it after ``ModelCheckpoint``; when a signal is acted on: ``docs/faults.md`` ("What it does", "Limits").

    Examples:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> trainer = pl.Trainer(callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True),
        ...                                 PreemptionCheckpoint()])  # doctest: +SKIP
        >>> trainer.fit(model)  # SIGTERM: "preempted-epoch0-step41.ckpt" in ckpts/, exit 75  # doctest: +SKIP
        >>> trainer.fit(model, ckpt_path="ckpts/preempted-epoch0-step41.ckpt")  # doctest: +SKIP
    """

    def __init__(
        self,
        signals: Sequence[str | int] = ("SIGTERM", "SIGUSR1"),
        dirpath: str | None = None,
        filename: str = "preempted-epoch{epoch}-step{step}.ckpt",
        requeue: bool | None = None,
        exit_code: int = ExitCode.PREEMPTED,
        check_every_n_steps: int = 1,
    ) -> None:
        self.signals = parse_signals(signals)
        positive_int("PreemptionCheckpoint.check_every_n_steps", check_every_n_steps)
        if not filename.endswith(".ckpt"):
            raise ValueError(f"PreemptionCheckpoint.filename={filename!r} must end in .ckpt (resume=auto looks for *.ckpt)")
        self.dirpath = dirpath
        self.filename = filename
        self.requeue = requeue
        self.exit_code = int(exit_code)
        self.check_every_n_steps = check_every_n_steps
        self.received: signal.Signals | None = None
        self.saved_path: Path | None = None
        self._previous_handlers: dict[signal.Signals, Any] = {}
        self._deferred = False

    # -- signal handling: the handler only records the signal -----------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def _install(self) -> None:
        """Take the signals over from Lightning's handlers (installed just before training)."""
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("PreemptionCheckpoint: not on the main thread, signals cannot be caught; preemption is not handled")
            return
        for sig in self.signals:
            if signal.getsignal(sig) == self._handle:
                continue
            self._previous_handlers.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)

    def _restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.received, self.saved_path, self._deferred = None, None, False
        checkpoints = trainer.checkpoint_callbacks
        if checkpoints and checkpoints[0] is self and any(isinstance(c, ModelCheckpoint) for c in checkpoints):
            rank_zero_warn(
                "PreemptionCheckpoint is listed before ModelCheckpoint, so trainer.checkpoint_callback "
                "(used by ckpt_path='best') is the PreemptionCheckpoint; list it after ModelCheckpoint"
            )

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.received is not None and self.saved_path is None:
            log.info("PreemptionCheckpoint: %s arrived after the last step; the run finished normally", self.received.name)
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    # -- the stop, at a step boundary on every rank ---------------------------------------
    def _any_rank_received(self, trainer: pl.Trainer) -> bool:
        flag = torch.tensor([0 if self.received is None else int(self.received)], device=trainer.strategy.root_device)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        if value and self.received is None:
            self.received = signal.Signals(value)  # another rank's signal
        return value != 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last_batch = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if not last_batch and (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # mid-accumulation: the gradients so far are not in any checkpoint
        if not self._deferred and trainer.global_step % self.check_every_n_steps:
            return
        if not self._any_rank_received(trainer):
            return
        if last_batch:
            # the epoch's end (validation, epoch-end callbacks) belongs to this epoch's state:
            # let it run and stop at the next step instead
            self._deferred = True
            return
        self._stop(trainer)

    def _checkpoint_path(self, trainer: pl.Trainer) -> Path:
        folder = self.dirpath
        if folder is None:
            model_checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
            folder = model_checkpoints[0].dirpath if model_checkpoints else os.path.join(trainer.default_root_dir, "checkpoints")
        name = self.filename.format(epoch=trainer.current_epoch, step=trainer.global_step)
        path = Path(folder) / name
        version = 0
        while path.exists():  # never overwrite: another run's preemption at the same step
            version += 1
            path = Path(folder) / f"{name[:-len('.ckpt')]}-v{version}.ckpt"
        return path

    def _stop(self, trainer: pl.Trainer) -> None:
        assert self.received is not None
        path = self._checkpoint_path(trainer)
        # every rank names the same file: rank 0's choice is broadcast so a file that appears
        # between the ranks' checks cannot split them
        path = Path(trainer.strategy.broadcast(str(path)))
        trainer.save_checkpoint(path)
        self.saved_path = path
        if trainer.is_global_zero:
            log.warning(
                "PreemptionCheckpoint: %s received; stopped after step %d (epoch %d), checkpoint %s",
                self.received.name, trainer.global_step, trainer.current_epoch, path,
            )
            environment = cluster_environment(trainer)
            slurm = isinstance(environment, SLURMEnvironment) and environment.auto_requeue and SLURMEnvironment.detect()
            if self.requeue or (self.requeue is None and slurm):
                self._requeue_slurm_job()
        end_agreed(trainer, SIGTERMException(self.exit_code))

    @staticmethod
    def _requeue_slurm_job() -> None:
        job_id = slurm_job_id()
        if job_id is None:
            log.warning("PreemptionCheckpoint: requeue asked for, but SLURM_JOB_ID is not set; not requeued")
            return
        try:
            result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            log.warning("PreemptionCheckpoint: scontrol requeue %s failed: %s", job_id, err)
            return
        if result.returncode == 0:
            log.warning("PreemptionCheckpoint: requeued SLURM job %s", job_id)
        else:
            log.warning("PreemptionCheckpoint: scontrol requeue %s exited %d: %s", job_id, result.returncode, result.stderr.strip())
