"""``NonFiniteGuard``: stop a run whose optimizer steps fail on non-finite numbers.

More in ``docs/faults.md`` ("The non-finite guard").
"""
from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.exit_codes import end_agreed


class NonFiniteStepsError(RuntimeError):
    """More than the allowed number of consecutive optimizer steps were non-finite."""


def first_nonfinite_gradient(module: torch.nn.Module) -> str | None:
    """Name of the first parameter (in ``named_parameters`` order) whose gradient has an inf or NaN."""
    return next((name for name, p in module.named_parameters()
                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())), None)


def first_nonfinite_tensor(module: torch.nn.Module) -> str | None:
    """Name of the first floating-point entry of ``module.state_dict()`` with an inf or NaN."""
    return next((name for name, t in module.state_dict().items()
                 if isinstance(t, Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())), None)


class NonFiniteGuard(Callback):
    """Stop training on non-finite steps: at once without a loss scaler, after a budget with one.

    Args:
        max_consecutive: consecutive steps a loss scaler (fp16) may skip; one more raises `NonFiniteStepsError`.

    Examples:
        >>> import lightning.pytorch as pl
        >>> from lightning_fastscale.precision import LARSMixedPrecision
        >>> trainer = pl.Trainer(
        ...     plugins=[LARSMixedPrecision("bf16-mixed", device="cpu")],
        ...     callbacks=[NonFiniteGuard(max_consecutive=100)], accelerator="cpu", logger=False)
    """

    def __init__(self, max_consecutive: int = 100) -> None:
        hint = "0: stop at the first non-finite step; 100 is the default"
        self.max_consecutive = positive_int("NonFiniteGuard.max_consecutive", max_consecutive, minimum=0, hint=hint)
        self.consecutive = 0
        self._losses: list[Tensor] = []
        self._stepped = False
        self._scale_before: float | None = None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        # kept as a device tensor: read once per optimizer step, only where it decides
        self._losses.append(torch.isfinite(loss.detach()).all())

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._stepped = True
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scale_before = float(scaler.get_scale()) if scaler is not None else None
        if scaler is not None:
            return
        # no scaler: a non-finite loss is decided here, before the optimizer step uses its gradients
        bad = bool(self._losses) and not bool(torch.stack(self._losses).all())
        if trainer.world_size > 1:
            # each rank has its own loss: stop on all of them at the same step, or the ranks
            # still running would wait in the next collective
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad:
            self.consecutive = 1
            end_agreed(trainer, NonFiniteStepsError(self._message(trainer, pl_module, None, step=trainer.global_step + 1)))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._stepped:  # gradient accumulation: no optimizer step in this batch
            return
        self._stepped = False
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else None
        self._losses = []  # decided before the step (no scaler); a scaler reports through the scale
        if hasattr(plugin, "consecutive_skipped_steps"):
            self.consecutive = int(plugin.consecutive_skipped_steps)
        elif scaler is not None:
            bad = self._scale_before is not None and scale is not None and scale < self._scale_before
            self.consecutive = self.consecutive + 1 if bad else 0
        budget = self.max_consecutive if scaler is not None else 0
        if self.consecutive > budget:
            raise NonFiniteStepsError(self._message(trainer, pl_module, scale))

    def _check_monitors(self, trainer: pl.Trainer) -> None:
        # ModelCheckpoint ranks a NaN as the worst value, but keeps it as the best when it is the
        # first; Lightning runs checkpoint callbacks after the others, so this comes first
        for callback in trainer.checkpoint_callbacks:
            monitor = getattr(callback, "monitor", None)
            value = trainer.callback_metrics.get(monitor) if monitor else None
            if isinstance(value, Tensor) and bool(torch.isnan(value).any()):
                raise NonFiniteStepsError(
                    f"NonFiniteGuard: the monitored metric {monitor} is NaN at trainer.global_step="
                    f"{trainer.global_step} (epoch {trainer.current_epoch}); the run diverged, and no checkpoint "
                    "is kept as the best by a NaN. Lower the learning rate or lengthen the warmup"
                )

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._check_monitors(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_monitors(trainer)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Refuse to write a checkpoint whose weights or buffers hold an inf or NaN."""
        name = first_nonfinite_tensor(pl_module)
        if name is not None:
            raise NonFiniteStepsError(
                f"NonFiniteGuard: not writing a checkpoint at trainer.global_step={trainer.global_step}: {name} "
                "holds inf/NaN values (the run diverged). Lower the learning rate or lengthen the warmup, and "
                "resume from an earlier checkpoint or start over"
            )

    def _message(self, trainer: pl.Trainer, pl_module: pl.LightningModule, scale: float | None, step: int | None = None) -> str:
        plugin = trainer.precision_plugin
        name = first_nonfinite_gradient(pl_module)
        fix = ("The run diverged or a layer produces inf/NaN: lower the learning rate or lengthen the warmup, "
               "check the data and that layer")
        if getattr(plugin, "scaler", None) is None:
            last = step if step is not None else trainer.global_step
            what = "had a non-finite loss" if step is not None else "was skipped for non-finite gradients"
            return (
                f"NonFiniteGuard: optimizer step {last} (counted from 1) {what}; no loss scaler (fp32/bf16), so "
                "nothing recovers it and the run stops before the weights take it; "
                f"first parameter with a non-finite gradient: {name or 'none found on this rank'}. {fix} "
                "(max_consecutive is the skip budget of fp16 loss scaling only)"
            )
        assert scale is not None
        scale_text = f"loss scale {scale:g}" + (" (underflowed to 0)" if scale == 0 or not math.isfinite(scale) else "")
        last = trainer.global_step  # optimizer steps taken, so the last one's number counted from 1
        return (
            f"NonFiniteGuard: {self.consecutive} consecutive optimizer steps skipped for non-finite gradients: "
            f"optimizer steps {last - self.consecutive + 1} to {last} (trainer.global_step={last}), more than "
            f"max_consecutive={self.max_consecutive}; {scale_text}; "
            f"first parameter with a non-finite gradient: {name or 'none found on this rank'}. {fix}, "
            "or raise NonFiniteGuard(max_consecutive=...)"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """The running count, so a resumed run keeps counting where it stopped."""
        return {"consecutive": self.consecutive}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` saved."""
        self.consecutive = int(state_dict.get("consecutive", 0))
