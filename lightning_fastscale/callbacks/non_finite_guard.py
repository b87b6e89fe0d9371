"""``NonFiniteGuard``: stop a run whose optimizer steps keep failing on non-finite numbers.

Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training") skips a step
whose gradients overflowed and halves the scale; a few skips are normal while the scale
settles, but a long run of them means the model itself produces infs or NaNs (a diverged
learning rate, a bad batch, a broken layer), and the run then burns its allocation without
learning. Large-batch runs (Jia et al. 2018: fp16 with LARS at batch 64K) run at learning
rates where this happens. The guard counts consecutive bad optimizer steps and raises
[`NonFiniteStepsError`][lightning_fastscale.callbacks.NonFiniteStepsError] once there are more than ``max_consecutive`` of them, naming the
step, the loss scale and the first parameter with a non-finite gradient.

A step counts as bad:

* with a plugin that skips non-finite steps itself and reports them
  ([`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision], any scaler or none): when the
  plugin skipped it (its own ``consecutive_skipped_steps`` counter);
* with Lightning's ``16-mixed`` (a ``GradScaler``): when the scaler skipped it, seen as a
  lower scale after the step than before (the scaler lowers it only after an overflow);
* without a scaler (Lightning's ``bf16-mixed`` and ``32-true``, which step whatever the
  gradient is): when a loss of the step was non-finite, decided on all ranks together.
"""
from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override


class NonFiniteStepsError(RuntimeError):
    """More than the allowed number of consecutive optimizer steps were non-finite."""


def first_nonfinite_gradient(module: torch.nn.Module) -> str | None:
    """Name of the first parameter (in ``named_parameters`` order) whose gradient has an inf or NaN."""
    for name, p in module.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


class NonFiniteGuard(Callback):
    """Stop training after more than ``max_consecutive`` non-finite optimizer steps in a row.

    Args:
        max_consecutive: how many consecutive bad steps are tolerated; one more raises
            [`NonFiniteStepsError`][lightning_fastscale.callbacks.NonFiniteStepsError]. A loss scaler that starts at 2**16 needs a handful of
            skips to settle; 100 leaves room for that and for a rare bad batch.

    Examples:
        >>> import lightning.pytorch as pl
        >>> from lightning_fastscale.precision import LARSMixedPrecision
        >>> trainer = pl.Trainer(
        ...     plugins=[LARSMixedPrecision("bf16-mixed", device="cpu")],
        ...     callbacks=[NonFiniteGuard(max_consecutive=100)], accelerator="cpu", logger=False)
    """

    def __init__(self, max_consecutive: int = 100) -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 0:
            raise ValueError(
                f"NonFiniteGuard(max_consecutive={max_consecutive!r}) must be an integer >= 0 "
                "(0: stop at the first non-finite step; 100 is the default)"
            )
        self.max_consecutive = max_consecutive
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
        losses, self._losses = self._losses, []
        if hasattr(plugin, "consecutive_skipped_steps"):
            self.consecutive = int(plugin.consecutive_skipped_steps)
        else:
            if scaler is not None:
                bad = self._scale_before is not None and scale is not None and scale < self._scale_before
            else:
                bad = bool(losses) and not bool(torch.stack(losses).all())
                if trainer.world_size > 1:
                    # each rank has its own loss: stop on all of them at the same step, or the
                    # ranks still running would wait in the next collective
                    bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
            self.consecutive = self.consecutive + 1 if bad else 0
        if self.consecutive > self.max_consecutive:
            raise NonFiniteStepsError(self._message(trainer, pl_module, scale))

    def _message(self, trainer: pl.Trainer, pl_module: pl.LightningModule, scale: float | None) -> str:
        plugin = trainer.precision_plugin
        name = getattr(plugin, "first_nonfinite_parameter", None) or first_nonfinite_gradient(pl_module)
        if scale is None:
            scale_text = "no loss scaler"
        else:
            scale_text = f"loss scale {scale:g}" + (" (underflowed to 0)" if scale == 0 or not math.isfinite(scale) else "")
        what = "skipped for non-finite gradients" if getattr(plugin, "scaler", None) is not None or hasattr(
            plugin, "consecutive_skipped_steps") else "had a non-finite loss"
        last = trainer.global_step  # optimizer steps taken, so the last one's number counted from 1
        return (
            f"NonFiniteGuard: {self.consecutive} consecutive optimizer steps {what}: optimizer steps "
            f"{last - self.consecutive + 1} to {last} (trainer.global_step={last}), more than "
            f"max_consecutive={self.max_consecutive}; {scale_text}; "
            f"first parameter with a non-finite gradient: {name or 'none found on this rank'}. The run "
            "diverged or a layer produces inf/NaN: lower the learning rate or lengthen the warmup, check the "
            "data and that layer, or raise callbacks.non_finite_guard.max_consecutive"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """The running count, so a resumed run keeps counting where it stopped."""
        return {"consecutive": self.consecutive}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what [`state_dict`][lightning_fastscale.callbacks.NonFiniteGuard.state_dict] saved."""
        self.consecutive = int(state_dict.get("consecutive", 0))
