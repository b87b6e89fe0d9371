"""``LARSMixedPrecision``: the Trainer's precision plugin for LARS (You et al. 2017) with mixed precision
as Jia et al. 2018 (arXiv:1807.11205) ran it: fp32 master weights, LARS on the unscaled gradient.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fastscale.lightning_internals import inside_lightning_hook

from .lars_step import LARSStepMixin

# keys under which checkpoints of the earlier per-mode classes hold this plugin's state
_CHECKPOINT_KEYS = ("LARSAutocastPrecision", "LARSFP32Precision")


def _lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside strategy wrappers such as DistributedDataParallel."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


class LARSMixedPrecision(LARSStepMixin, MixedPrecision):
    """Lightning Trainer plugin: autocast compute, fp32 master weights, loss scaling, LARS (Jia et al. 2018).

    Use with a plain optimizer (momentum SGD); the step order is in ``docs/methods/lars_mixed_precision.md``.

    Args:
        precision: ``"16-mixed"`` (with loss scaling), ``"bf16-mixed"`` or ``"32-true"``/``"32"`` (no autocast).
        device: autocast device type, ``"cuda"`` or ``"cpu"`` (default: ``"cuda"`` if available).
        eta, eps, trust_clip: as for `LARS` (eta 0.001 in You et al. 2017 and the MLPerf reference).
        exclude: extra glob patterns on parameter names that LARS leaves alone.
        scaler: a ``torch.amp.GradScaler`` for ``"16-mixed"`` (one is made otherwise).

    Examples:
        >>> trainer = pl.Trainer(plugins=[LARSMixedPrecision("bf16-mixed", "cpu", eta=0.001)], logger=False)
        >>> trainer.precision
        'bf16-mixed'
    """

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Classify the parameters and validate the optimizers before the first step."""
        self.classify(_lightning_module(model))
        for optimizer in optimizers:
            self.validate(optimizer)
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """The module unchanged (its fp32 parameters are the master weights); refuses Fabric."""
        if not isinstance(_lightning_module(module), pl.LightningModule):
            raise TypeError("LARSMixedPrecision is the Trainer's plugin; in lightning.Fabric use "
                            "lightning_fastscale.precision.LARSFabricPrecision with the same arguments")
        return module

    @override
    def clip_gradients(
        self, optimizer: Optimizer, clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled gradients (this plugin unscales for every optimizer, fused ones too)."""
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Closure, unscale, hooks and clipping, the LARS step, scaler update."""
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return closure_result  # training_step returned None: no backward, nothing to step
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        trainer = model.trainer
        agree = None if trainer.world_size == 1 else (
            lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False))
        step_output = self.lars_step(optimizer, agree, **kwargs)  # type: ignore[arg-type]
        self.update_scaler()
        if inside_lightning_hook(model):  # self.log is valid inside the fit loop's hooks only
            metrics = {"lars/skipped_steps": float(self.skipped_steps)}
            if self.scaler is not None:
                metrics["lars/loss_scale"] = float(self.scaler.get_scale())
            model.log_dict(metrics, on_step=True, on_epoch=False, logger=trainer.logger is not None)
        return closure_result if step_output is None else step_output

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read the state that checkpoints of the earlier per-mode classes keep under their names."""
        old = next((k for k in _CHECKPOINT_KEYS if k in checkpoint), None)
        if type(self).__qualname__ not in checkpoint and old is not None:
            self.load_state_dict(checkpoint[old])
