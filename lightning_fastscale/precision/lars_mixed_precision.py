"""``LARSMixedPrecision``: half-precision compute, fp32 master weights, loss scaling and LARS.

Jia et al. 2018 (Tencent, "Highly Scalable Deep Learning Training System with
Mixed-Precision: Training ImageNet in Four Minutes") trained ResNet-50 at batch 64K with
fp16 compute and LARS (You et al. 2017). LARS applied to fp16 weights failed: many updates
rounded to zero. Their fix, which this plugin reproduces as a Lightning precision plugin: the
forward/backward run in half precision under ``torch.autocast`` while the parameters (the
master weights) stay fp32; the loss is scaled so small gradients survive fp16; the trust
ratio and the update are computed in fp32 from the *unscaled* gradient.

``LARSMixedPrecision(precision, ...)`` builds one of two classes sharing the step:

* ``"16-mixed"``/``"bf16-mixed"``: `LARSAutocastPrecision`, a Lightning
  ``MixedPrecision`` (its autocast and loss scaling);
* ``"32-true"``: `LARSFP32Precision`, a plain Lightning ``Precision``, so no version
  of ``MixedPrecision`` can put its forward under autocast.

The step, in order (``optimizer_step``):

1. closure: forward (under autocast in the mixed modes), backward of the scaled loss;
2. ``scaler.unscale_`` (16-mixed only): gradients are the true ones from here on;
3. Lightning's ``on_before_optimizer_step`` hooks, then gradient clipping if configured
   (``Trainer(gradient_clip_val=...)``), on the unscaled gradients and before LARS. Note
   that with weight decay 0, LARS is invariant to the gradient's norm, so norm clipping only
   affects parameters LARS does not adapt;
4. `LARSStep`: skip the step on every rank
   if any gradient is non-finite (the scaler backs off; also in bf16/fp32, where Lightning
   has no scaler to do it), else LARS and the optimizer step (fused for torch SGD);
5. ``scaler.update()``.

Under Lightning Fabric the same object hands Fabric's calls (backward, optimizer step,
unscale) to a [`LARSFabricPrecision`][lightning_fastscale.precision.LARSFabricPrecision] that shares its
``LARSStep`` and scaler.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from .lars_fabric import LARSFabricPrecision, check_device, normalise_precision
from .lars_step import LARSStep

PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")


def _lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside strategy wrappers such as DistributedDataParallel."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


class LARSMixedPrecision(Precision):
    """Lightning precision plugin: autocast compute, fp32 master weights, loss scaling, LARS.

    ``Trainer(plugins=[LARSMixedPrecision("bf16-mixed")])`` with the module's own optimizer
    (momentum SGD is the usual one). See the module docstring for the exact step order
    (Jia et al. 2018; You et al. 2017). Calling the class returns a
    `LARSAutocastPrecision` (``"16-mixed"``, ``"bf16-mixed"``) or a
    `LARSFP32Precision` (``"32-true"``); both are ``LARSMixedPrecision`` instances.
    Given to ``lightning.Fabric(plugins=[...])`` it works as [`LARSFabricPrecision`][lightning_fastscale.precision.LARSFabricPrecision].

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + dynamic loss scaling), ``"bf16-mixed"``
            (bf16 autocast, no scaler) or ``"32"``/``"32-true"`` (no autocast). fp16 autocast
            works on CPU with torch >= 2.3 as well as on CUDA.
        device: autocast/scaler device type, ``"cuda"`` or ``"cpu"``; by default ``"cuda"``
            when CUDA is available.
        eta: trust coefficient (0.001 in You et al. and the MLPerf reference).
        eps: added to the ratio's denominator.
        trust_clip: LARC clip mode, ratio ``min(ratio / lr, 1)``: a layer's effective
            learning rate is ``min(local_lr, lr)``.
        exclude: extra glob patterns on parameter names (``fnmatch``) that LARS leaves alone,
            on top of the shared bias/norm rule.
        scaler: a ``torch.amp.GradScaler`` to use for ``"16-mixed"`` (one is made otherwise).

    Attributes:
        lars: the `LARSStep` (LARS options
            and skip counters; ``skipped_steps``, ``consecutive_skipped_steps``,
            ``last_step_skipped`` and ``first_nonfinite_parameter`` are also read here).
            Counters are saved in checkpoints and logged as ``lars/skipped_steps`` (with
            ``lars/loss_scale``); schedulers that must not advance on a skipped step (the
            warmup schedule) read ``last_step_skipped``.

    Examples:
        >>> plugin = LARSMixedPrecision("32", device="cpu", eta=1e-3)
        >>> type(plugin).__name__, isinstance(plugin, LARSMixedPrecision)
        ('LARSFP32Precision', True)
        >>> type(LARSMixedPrecision("bf16-mixed", device="cpu")).__name__
        'LARSAutocastPrecision'
    """

    def __new__(
        cls,
        precision: str = "bf16-mixed",
        device: str | None = None,
        *,
        eta: float = 1e-3,
        eps: float = 1e-8,
        trust_clip: bool = False,
        exclude: Sequence[str] = (),
        scaler: torch.amp.GradScaler | None = None,
    ) -> LARSMixedPrecision:
        # the same signature as __init__: jsonargparse (LightningCLI) reads its options from here
        if cls is LARSMixedPrecision:
            known = str(precision) in ("32", "32-true")
            cls = LARSFP32Precision if known else LARSAutocastPrecision
        return super().__new__(cls)

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str | None = None,
        *,
        eta: float = 1e-3,
        eps: float = 1e-8,
        trust_clip: bool = False,
        exclude: Sequence[str] = (),
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        precision = normalise_precision(precision, "LARSMixedPrecision")
        device = check_device(device, precision, scaler, "LARSMixedPrecision")
        self.lars = LARSStep(eta=eta, eps=eps, trust_clip=trust_clip, exclude=exclude)
        self._init_compute(precision, device, scaler)
        self._connected = False
        self._fabric: LARSFabricPrecision | None = None

    def _init_compute(self, precision: str, device: str, scaler: torch.amp.GradScaler | None) -> None:
        raise NotImplementedError  # each subclass sets up its own compute mode

    # ---- the LARS step's state, read through the plugin ---------------------------------

    @property
    def eta(self) -> float:
        """The trust coefficient."""
        return self.lars.eta

    @property
    def eps(self) -> float:
        """Added to the ratio's denominator."""
        return self.lars.eps

    @property
    def trust_clip(self) -> bool:
        """LARC clip mode."""
        return self.lars.trust_clip

    @property
    def exclude(self) -> list[str]:
        """Extra name globs that LARS leaves alone."""
        return self.lars.exclude

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients, in total."""
        return self.lars.skipped_steps

    @property
    def consecutive_skipped_steps(self) -> int:
        """Steps skipped in a row up to now."""
        return self.lars.consecutive_skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent ``optimizer_step`` was skipped for non-finite gradients."""
        return self.lars.last_step_skipped

    @property
    def first_nonfinite_parameter(self) -> str | None:
        """Name of the first parameter with a non-finite gradient at the last skipped step."""
        return self.lars.first_nonfinite_parameter

    # ---- setup -------------------------------------------------------------------------

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Classify parameters and validate the configuration before the first step."""
        self._connected = True
        self.classify(_lightning_module(model))
        for optimizer in optimizers:
            self.lars.validate(optimizer)
        return super().connect(model, optimizers, lr_schedulers)

    def classify(self, module: nn.Module) -> None:
        """Record which of ``module``'s parameters LARS adapts (the shared rule + ``exclude``).

        ``connect`` calls it with the LightningModule; call it yourself only when driving
        [`lars_step`][lightning_fastscale.precision.LARSMixedPrecision.lars_step] outside a Trainer.
        """
        self.lars.classify(module)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled gradients (this plugin unscales for every optimizer, fused ones too)."""
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    # ---- the step ----------------------------------------------------------------------

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule | None = None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Closure, unscale, hooks/clipping, non-finite skip, LARS, optimizer step, scaler update."""
        if not self._connected:  # Fabric: optimizer.step() after fabric.backward
            return self._fabric_plugin().optimizer_step(optimizer, **kwargs)
        assert model is not None and closure is not None
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("LARSMixedPrecision does not support LBFGS (a closure-driven line search)")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning skipped backward, there is nothing to step
            return closure_result
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        if not self.lars.classified:
            self.classify(_lightning_module(model))
        if not self.lars.is_validated(optimizer):  # type: ignore[arg-type]
            self.lars.validate(optimizer)  # type: ignore[arg-type]
        step_output = self.lars.step(optimizer, agree=self._any_rank(model), **kwargs)  # type: ignore[arg-type]
        if self.scaler is not None:
            # after unscale_ found an inf, update() lowers the scale; otherwise it may grow it
            self.scaler.update()
        self._log(model)
        return closure_result if step_output is None else step_output

    @staticmethod
    def _any_rank(model: pl.LightningModule) -> Callable[[bool], bool] | None:
        trainer = getattr(model, "_trainer", None)
        if trainer is None or trainer.world_size == 1:
            return None
        return lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False)

    def lars_step(self, optimizer: Optimizer, agree: Callable[[bool], bool] | None = None, **kwargs: Any) -> Any:
        """Skip if non-finite, else LARS and ``optimizer.step``, on unscaled gradients, without
        a Trainer (`LARSStep.step <lightning_fastscale.precision.lars_step.LARSStep.step>`);
        the scaler is not touched. Call [`classify`][lightning_fastscale.precision.LARSMixedPrecision.classify] first."""
        return self.lars.step(optimizer, agree=agree, **kwargs)

    def _log(self, model: pl.LightningModule) -> None:
        # self.log is only valid inside the Trainer's control flow (fit loop hooks)
        trainer = getattr(model, "_trainer", None)
        if trainer is None or getattr(model, "_current_fx_name", None) is None:
            return
        metrics = {"lars/skipped_steps": float(self.skipped_steps)}
        if self.scaler is not None:
            metrics["lars/loss_scale"] = float(self.scaler.get_scale())
        model.log_dict(metrics, on_step=True, on_epoch=False, logger=trainer.logger is not None)

    # ---- Lightning Fabric: the same plugin object in a Fabric loop -----------------------

    def _fabric_plugin(self) -> LARSFabricPrecision:
        if self._fabric is None:
            self._fabric = LARSFabricPrecision.sharing(self.lars, self.precision, self.device, self.scaler)
        return self._fabric

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Record which parameters LARS adapts (Fabric's ``setup`` and Lightning's strategies call this)."""
        self.classify(_lightning_module(module))
        return module

    @override
    def convert_output(self, data: Any) -> Any:
        """Unchanged in a Trainer; under Fabric, floating outputs to fp32 as Fabric's AMP does."""
        if not self._connected:
            return self._fabric_plugin().convert_output(data)
        return super().convert_output(data)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        """Lightning's hooks (and loss scaling) in a Trainer; Fabric's convention otherwise."""
        if not self._connected:
            return self._fabric_plugin().pre_backward(tensor, module)
        return super().pre_backward(tensor, module)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any = None, *args: Any, **kwargs: Any
    ) -> None:
        """``LightningModule.backward`` in a Trainer; the (scaled) loss's backward under Fabric."""
        if not self._connected:
            args = (optimizer, *args) if optimizer is not None else args
            return self._fabric_plugin().backward(tensor, model, *args, **kwargs)
        return super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        """Lightning's ``on_after_backward`` hooks in a Trainer; Fabric's convention otherwise."""
        if not self._connected:
            return self._fabric_plugin().post_backward(tensor, module)
        return super().post_backward(tensor, module)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale for ``fabric.clip_gradients`` (the Trainer path unscales in ``optimizer_step``)."""
        if not self._connected:
            self._fabric_plugin().unscale_gradients(optimizer)

    # ---- checkpointing -----------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        """Loss-scaler state and the skip counters, saved in Lightning checkpoints."""
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None, **self.lars.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what [`state_dict`][lightning_fastscale.precision.LARSMixedPrecision.state_dict] saved."""
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        self.lars.load_state_dict(state_dict)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read the state of checkpoints written before the class split (key ``LARSMixedPrecision``)."""
        if type(self).__qualname__ not in checkpoint and "LARSMixedPrecision" in checkpoint:
            self.load_state_dict(checkpoint["LARSMixedPrecision"])


class LARSFP32Precision(LARSMixedPrecision):
    """``LARSMixedPrecision("32-true")``: the LARS step with fp32 compute and no autocast.

    A plain Lightning ``Precision`` underneath (not a ``MixedPrecision``), so the forward is
    never under ``torch.autocast``, whatever Lightning's ``MixedPrecision`` does.
    """

    scaler: None

    @override
    def _init_compute(self, precision: str, device: str, scaler: torch.amp.GradScaler | None) -> None:
        if precision != "32-true":
            raise ValueError(
                f"LARSFP32Precision is the '32-true' mode; for precision={precision!r} use "
                "LARSMixedPrecision(precision) (it picks LARSAutocastPrecision)"
            )
        self.precision = "32-true"  # type: ignore[assignment]
        self.device = device
        self.scaler = None


class LARSAutocastPrecision(LARSMixedPrecision, MixedPrecision):
    """``LARSMixedPrecision("16-mixed" | "bf16-mixed")``: the LARS step on Lightning's
    ``MixedPrecision`` (``torch.autocast`` forward; for 16-mixed, dynamic loss scaling)."""

    @override
    def _init_compute(self, precision: str, device: str, scaler: torch.amp.GradScaler | None) -> None:
        if precision == "32-true":
            raise ValueError(
                "LARSAutocastPrecision is for '16-mixed' and 'bf16-mixed'; for '32-true' use "
                "LARSMixedPrecision('32-true') (it picks LARSFP32Precision)"
            )
        MixedPrecision.__init__(self, precision, device, scaler)  # type: ignore[arg-type]
