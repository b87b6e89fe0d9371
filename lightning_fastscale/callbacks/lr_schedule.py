"""Linear LR scaling and gradual warmup (Goyal et al. 2017), then MLPerf's poly or cosine decay.

Method card: ``docs/methods/lr_scaling_warmup.md``.
"""
from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.callbacks._schedule import loader_batch_size
from lightning_fastscale.callbacks.batch_size_ramp import BatchSizeRamp

DECAYS = ("poly", "cosine", "none")
# The schedule position, saved whole so resuming is exact: progress_before_epoch + applied_in_epoch
# / steps_in_epoch, folded once per epoch so that whole epochs add up exactly.
_FRESH_STATE = {
    "base_lrs": None, "progress_before_epoch": 0.0, "applied_in_epoch": 0, "steps_in_epoch": 1, "skipped_steps": 0,
}


def lr_at(
    progress: float,
    peak_lr: float,
    *,
    warmup_epochs: float,
    total_epochs: float,
    warmup_start_factor: float = 0.0,
    decay: str = "poly",
    power: float = 2.0,
    end_lr: float = 0.0,
) -> float:
    """Learning rate after ``progress`` epochs (fractional) of applied optimizer steps.

    Warmup (Goyal et al. 2017): ``peak * (f + (1 - f) * progress / warmup_epochs)``. Then, with
    ``p = (progress - warmup) / (total - warmup)`` in [0, 1], ``poly`` gives
    ``end + (peak - end) * (1 - p) ** power`` (MLPerf LARS), ``cosine``
    ``end + (peak - end) * (1 + cos(pi p)) / 2``, ``none`` keeps ``peak``.
    """
    if progress < warmup_epochs:
        f = warmup_start_factor
        return peak_lr * (f + (1.0 - f) * progress / warmup_epochs)
    if decay == "none":
        return peak_lr
    p = min(1.0, (progress - warmup_epochs) / (total_epochs - warmup_epochs))
    if decay == "poly":
        shape = (1.0 - p) ** power
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * p))
    else:
        raise ValueError(f"decay={decay!r}; choose one of {DECAYS}")
    return end_lr + (peak_lr - end_lr) * shape


def current_global_batch(trainer: pl.Trainer) -> int:
    """Samples per optimizer step right now: per-device batch x world size x accumulation."""
    per_device = loader_batch_size(trainer)
    if per_device is None:
        per_device = getattr(trainer.datamodule, "train_batch_size", None)
    if not isinstance(per_device, int):
        raise ValueError(
            "WarmupDecayLR.reference_batch is set (linear scaling), but the per-device batch "
            "size is unknown: the train dataloader has no integer batch_size and the "
            "datamodule no train_batch_size; use DataLoader(batch_size=...) or a datamodule "
            "implementing BatchSizeControllable, or set reference_batch=null"
        )
    return per_device * trainer.world_size * trainer.accumulate_grad_batches


class WarmupDecayLR(Callback):
    """Linear warmup then polynomial/cosine decay, with optional linear scaling by batch.

    Args:
        warmup_epochs: length of the linear warmup in epochs; 0 disables it.
        decay: ``"poly"`` (MLPerf LARS), ``"cosine"`` or ``"none"`` (constant after warmup).
        power: exponent of the ``poly`` decay.
        end_lr: absolute LR at the end of the decay.
        warmup_start_factor: warmup starts at this fraction of the peak LR.
        total_epochs: where decay ends; default ``Trainer(max_epochs)``.
        reference_batch: when set, each group's peak LR is its configured LR x
            ``current_global_batch / reference_batch``, read every step (follows a batch ramp).

    It owns the LR: refused beside a scheduler from ``configure_optimizers`` or
    ``BatchSizeRamp(scale_lr=True)``. Hyper-parameters: ``docs/methods/lr_scaling_warmup.md``.

    Examples:
        Goyal et al.'s rule (0.1 per 256 images, 5 warmup epochs) with MLPerf's poly-2 decay:

        >>> schedule = WarmupDecayLR(warmup_epochs=5, decay="poly", power=2, end_lr=1e-4,
        ...                          reference_batch=256)
        >>> round(lr_at(2.5, 0.1 * 8192 / 256, warmup_epochs=5, total_epochs=90), 4)
        1.6
    """

    def __init__(
        self,
        warmup_epochs: float = 5.0,
        decay: str = "poly",
        power: float = 2.0,
        end_lr: float = 0.0,
        warmup_start_factor: float = 0.0,
        total_epochs: float | None = None,
        reference_batch: int | None = None,
    ) -> None:
        if decay not in DECAYS:
            raise ValueError(f"WarmupDecayLR.decay={decay!r}; choose one of {DECAYS}")
        if warmup_epochs < 0:
            raise ValueError(f"WarmupDecayLR.warmup_epochs={warmup_epochs} must be >= 0")
        if not 0.0 <= warmup_start_factor <= 1.0:
            raise ValueError(f"WarmupDecayLR.warmup_start_factor={warmup_start_factor} must be in [0, 1]")
        if power <= 0:
            raise ValueError(f"WarmupDecayLR.power={power} must be positive")
        if end_lr < 0:
            raise ValueError(f"WarmupDecayLR.end_lr={end_lr} must be >= 0")
        if reference_batch is not None:
            hint = "the batch the base LR was tuned for (e.g. 256), or null to turn scaling off"
            positive_int("WarmupDecayLR.reference_batch", reference_batch, hint=hint)
        self.warmup_epochs = float(warmup_epochs)
        self.decay = decay
        self.power = power
        self.end_lr = end_lr
        self.warmup_start_factor = warmup_start_factor
        self.total_epochs = total_epochs
        self.reference_batch = reference_batch
        self._total = 0.0
        self.load_state_dict(_FRESH_STATE)
        self._scale_before: float | None = None
        self._step_pending = False
        self._step_ran = False
        self._hook_handle: Any = None

    @property
    def progress(self) -> float:
        """Epochs of applied optimizer steps so far (fractional)."""
        return self._progress_before_epoch + self._applied_in_epoch / self._steps_in_epoch

    def check_trainer(self, trainer: pl.Trainer) -> float:
        """The schedule's length in epochs on ``trainer`` (``ValueError`` if no room or two LR owners); no fit needed."""
        total = self.total_epochs if self.total_epochs is not None else trainer.max_epochs
        length = "total_epochs" if self.total_epochs is not None else "max_epochs"
        if total is None or total <= 0:
            raise ValueError(
                "WarmupDecayLR needs the length of training: set WarmupDecayLR.total_epochs or "
                f"Trainer(max_epochs=...) (max_epochs is {trainer.max_epochs})"
            )
        if self.decay != "none" and total <= self.warmup_epochs:
            raise ValueError(
                f"WarmupDecayLR.warmup_epochs={self.warmup_epochs} leaves no room for decay before "
                f"{length}={total}; lower warmup_epochs, raise {length}, or use decay='none'"
            )
        if any(isinstance(cb, BatchSizeRamp) and cb.scale_lr for cb in trainer.callbacks):
            raise ValueError(
                "BatchSizeRamp(scale_lr=True) and WarmupDecayLR both set the learning rate; "
                "set BatchSizeRamp.scale_lr=false and WarmupDecayLR.reference_batch=<batch the "
                "base LR was tuned for>: WarmupDecayLR then scales by the current global batch"
            )
        return float(total)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the schedule length and refuse a second owner of the LR."""
        if stage != "fit":
            return
        self._total = self.check_trainer(trainer)
        self.load_state_dict(_FRESH_STATE)  # a new fit, unless a checkpoint is restored after this hook

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Capture the configured LRs as base LRs (unless restored from a checkpoint)."""
        if trainer.lr_scheduler_configs:
            raise ValueError(
                "WarmupDecayLR owns the learning rate, but configure_optimizers also returned an "
                "LR scheduler; remove it (scheduler=none in the Hydra config) or drop WarmupDecayLR"
            )
        if len(trainer.optimizers) != 1:
            raise ValueError(f"WarmupDecayLR drives one optimizer; configure_optimizers returned {len(trainer.optimizers)}")
        if self._base_lrs is None:
            self._base_lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
        self._hook_handle = trainer.optimizers[0].register_step_post_hook(self._on_optimizer_step)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_ran = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the optimizer hook."""
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Fail before the first step if linear scaling cannot read the global batch; set step 0's LR."""
        if self.reference_batch is not None:
            current_global_batch(trainer)
        if math.isinf(trainer.num_training_batches):
            raise ValueError(
                "WarmupDecayLR schedules by fractional epochs and needs a training dataloader "
                "with a length (an IterableDataset without __len__ has none)"
            )
        self._apply(trainer, recount=False)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Fold the finished epoch into the position; set the LR of the epoch's first step."""
        self._progress_before_epoch += self._applied_in_epoch / self._steps_in_epoch
        self._applied_in_epoch = 0
        self._apply(trainer)

    def lr_now(self, trainer: pl.Trainer) -> list[float]:
        """The LR of each parameter group for the next optimizer step."""
        assert self._base_lrs is not None
        scale = 1.0 if self.reference_batch is None else current_global_batch(trainer) / self.reference_batch
        return [
            lr_at(
                self.progress, base * scale, warmup_epochs=self.warmup_epochs,
                total_epochs=self._total, warmup_start_factor=self.warmup_start_factor,
                decay=self.decay, power=self.power, end_lr=self.end_lr,
            )
            for base in self._base_lrs
        ]

    def _apply(self, trainer: pl.Trainer, recount: bool = True) -> None:
        """Write the next step's LR into the optimizer as soon as the position is known (LearningRateMonitor reads it).

        ``recount=False`` keeps the epoch's step count (a run resumed at an epoch's end holds the next loader).
        """
        if recount:  # steps per epoch can change at epoch boundaries (BatchSizeRamp, resizing)
            self._steps_in_epoch = max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))
        for group, lr in zip(trainer.optimizers[0].param_groups, self.lr_now(trainer)):
            group["lr"] = lr

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Set the LR for the step about to run; remember the loss scale to detect a skip."""
        self._apply(trainer)  # unchanged unless a callback changed the loader since the batch began
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scale_before = scaler.get_scale() if scaler is not None else None
        self._step_ran = False
        self._step_pending = True

    def _last_step_skipped(self, trainer: pl.Trainer) -> bool:
        plugin = trainer.precision_plugin
        if hasattr(plugin, "last_step_skipped"):
            return bool(plugin.last_step_skipped)
        if not self._step_ran:
            return True
        scaler = getattr(plugin, "scaler", None)
        return scaler is not None and self._scale_before is not None and scaler.get_scale() < self._scale_before

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Advance the position by one step unless the loss scaler skipped it; log the LR."""
        if not self._step_pending:
            return
        self._step_pending = False
        applied = trainer.optimizers[0].param_groups[0]["lr"]
        if self._last_step_skipped(trainer):
            self._skipped_steps += 1
        else:
            self._applied_in_epoch += 1
        pl_module.log_dict(
            {
                "lr_schedule/lr": applied,
                "lr_schedule/epoch_progress": self.progress,
                "lr_schedule/skipped_steps": float(self._skipped_steps),
            },
            on_step=True, on_epoch=False,
        )
        self._apply(trainer, recount=False)  # the next step's LR, for whoever reads it before that step

    @override
    def state_dict(self) -> dict[str, Any]:
        """Base LRs and schedule position."""
        return {key: getattr(self, f"_{key}") for key in _FRESH_STATE}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore base LRs and schedule position."""
        for key in _FRESH_STATE:
            setattr(self, f"_{key}", state_dict[key])
