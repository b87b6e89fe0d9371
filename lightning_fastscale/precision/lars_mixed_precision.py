"""``LARSMixedPrecision``: half-precision compute, fp32 master weights, loss scaling and LARS.

Jia et al. 2018 (Tencent, "Highly Scalable Deep Learning Training System with
Mixed-Precision: Training ImageNet in Four Minutes") trained ResNet-50 at batch 64K with
fp16 compute and LARS (You et al. 2017). LARS applied to fp16 weights failed: many updates
rounded to zero. Their fix, which this plugin reproduces on top of Lightning's
``MixedPrecision`` plugin: the forward/backward run in half precision under ``torch.autocast``
while the parameters (the master weights) stay fp32; the loss is scaled so small gradients
survive fp16; the trust ratio and the update are computed in fp32 from the *unscaled*
gradient.

The step, in order (``optimizer_step``):

1. closure: forward under autocast, backward of the scaled loss;
2. ``scaler.unscale_`` (16-mixed only): gradients are the true ones from here on;
3. Lightning's ``on_before_optimizer_step`` hooks, then gradient clipping if configured
   (``Trainer(gradient_clip_val=...)``), on the unscaled gradients and before LARS. Note
   that with weight decay 0, LARS is invariant to the gradient's norm, so norm clipping only
   affects parameters LARS does not adapt;
4. if any gradient is non-finite (or its norm overflows fp32) on any rank: skip the step
   entirely (no weight, momentum or LARS change), the scaler backs off, ``skipped_steps``
   grows, ``last_step_skipped`` is True; in bf16/fp32 too, where Lightning has no scaler to
   do it;
5. LARS: every gradient becomes ``r * (g + wd * w)`` in fp32, ``r`` the trust ratio for
   adapted parameters and 1 for excluded ones, with ``wd`` the group's weight decay; the
   group's ``weight_decay`` is set to 0 for the wrapped step and restored after (as apex
   LARC does), so nothing is decayed twice;
6. the wrapped optimizer's ``step()``;
7. ``scaler.update()``.

Steps 5-6 have a fused form for ``torch.optim.SGD`` itself (the usual optimizer): the ratio
is folded into SGD's momentum update (``lars_sgd_``) on SGD's own state, inside SGD's step
hooks, instead of being written into every gradient first. Same result to float32 rounding,
gradients left as they were, and about the cost of a plain SGD step
(``benchmarks/lars_step.py``). Any other optimizer, SGD subclasses included, takes 5-6 as
written.

Which parameters LARS leaves alone is the shared rule of
:mod:`lightning_fastscale.param_groups` (bias, normalisation layers, ``ndim <= 1``, plus the
``exclude`` name globs).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.optim.optimizer as torch_optimizer_module
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer

from ..param_groups import is_excluded, split_parameters, validate_patterns
from .lars import LARS, check_lars_options, foreach_norms, lars_rescale_, lars_sgd_

log = logging.getLogger(__name__)

PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
_ALIASES = {"32": "32-true"}


def _lightning_module(model: nn.Module) -> nn.Module:
    """The LightningModule inside strategy wrappers such as DistributedDataParallel."""
    while not isinstance(model, pl.LightningModule) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _fused_sgd_applies(optimizer: Optimizer, groups: list[tuple[dict, list, list, Tensor]], kwargs: dict) -> bool:
    """Whether ``LARSMixedPrecision._fused_sgd_step`` reproduces ``optimizer.step()`` exactly.

    Only for ``torch.optim.SGD`` itself (a subclass may change ``step``), with no arguments
    for ``step`` (the closure already ran), an options set ``lars_sgd_`` implements (not
    ``maximize``, not ``differentiable``; ``foreach``/``fused`` only choose kernels), dense
    gradients, and ``step`` not replaced on the instance by anything but a torch LR
    scheduler's call-tracking wrapper.
    """
    if type(optimizer) is not torch.optim.SGD or kwargs:
        return False
    instance_step = optimizer.__dict__.get("step")
    if instance_step is not None and not getattr(instance_step, "_wrapped_by_lr_sched", False):
        return False
    return all(
        not group["maximize"] and not group["differentiable"] and not any(g.is_sparse for g in grads)
        for group, _, grads, _ in groups
    )


class LARSMixedPrecision(MixedPrecision):
    """Lightning precision plugin: autocast compute, fp32 master weights, loss scaling, LARS.

    ``Trainer(plugins=[LARSMixedPrecision("bf16-mixed")])`` with the module's own optimizer
    (momentum SGD is the usual one). See the module docstring for the exact step order
    (Jia et al. 2018; You et al. 2017).

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
        skipped_steps: how many optimizer steps were skipped for non-finite gradients
            (saved in checkpoints, logged as ``lars/skipped_steps``).
        last_step_skipped: whether the most recent ``optimizer_step`` was skipped for
            non-finite gradients. Schedulers that must not advance on a skipped step (the
            warmup schedule) read this.
    """

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
        precision = _ALIASES.get(str(precision), str(precision))
        if precision not in PRECISIONS:
            raise ValueError(
                f"LARSMixedPrecision(precision={precision!r}) is not supported; use one of "
                f"{PRECISIONS} ('32' is accepted for '32-true')"
            )
        check_lars_options(eta, eps)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"LARSMixedPrecision(device={device!r}) must be 'cuda' or 'cpu'")
        if precision == "32-true":
            if scaler is not None:
                raise ValueError("LARSMixedPrecision(precision='32-true') uses no loss scaler; drop `scaler`")
            # MixedPrecision accepts only the two autocast modes; fp32 needs none of its setup
            self.precision = precision
            self.device = device
            self.scaler = None
        else:
            super().__init__(precision, device, scaler)  # type: ignore[arg-type]
        self.eta = eta
        self.eps = eps
        self.trust_clip = trust_clip
        self.exclude = validate_patterns(exclude)
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._adapted_ids: set[int] | None = None
        self._named_ids: set[int] = set()

    # ---- setup -------------------------------------------------------------------------

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Classify parameters and validate the configuration before the first step."""
        self.classify(_lightning_module(model))
        for optimizer in optimizers:
            self._validate(optimizer)
        return super().connect(model, optimizers, lr_schedulers)

    def classify(self, module: nn.Module) -> None:
        """Record which of ``module``'s parameters LARS adapts (the shared rule + ``exclude``).

        ``connect`` calls it with the LightningModule; call it yourself only when driving
        :meth:`lars_step` outside a Trainer.
        """
        adapted, excluded = split_parameters(module, self.exclude)
        self._adapted_ids = {id(p) for _, p in adapted}
        self._named_ids = self._adapted_ids | {id(p) for _, p in excluded}

    def _adapts(self, p: Tensor) -> bool:
        assert self._adapted_ids is not None
        if id(p) in self._named_ids:
            return id(p) in self._adapted_ids
        # a parameter the module does not name: only the name-free part of the rule applies
        return not is_excluded("", p)

    def _validate(self, optimizer: Optimizer) -> None:
        if isinstance(optimizer, LARS):
            raise ValueError(
                "LARSMixedPrecision would apply LARS a second time on top of the LARS optimizer; "
                "use it with a plain optimizer (torch.optim.SGD), or use the LARS optimizer with "
                "Lightning's own precision (Trainer(precision='16-mixed'|'bf16-mixed'))"
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if params and not any(self._adapts(p) for p in params):
            raise ValueError(
                f"LARSMixedPrecision(exclude={self.exclude!r}): the bias/norm rule plus these "
                f"patterns exclude all {len(params)} parameters of {type(optimizer).__name__}, so "
                "LARS would do nothing; narrow `exclude` or use plain MixedPrecision"
            )
        low = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
        if low:
            raise ValueError(
                f"LARSMixedPrecision keeps fp32 master weights, but the model has {low} parameters "
                "(e.g. after `.half()`); keep the module in fp32: autocast does the half-precision "
                "compute (Jia et al. 2018: LARS on fp16 weights loses its updates)"
            )
        for group in optimizer.param_groups:
            if group.get("weight_decay", 0.0) and (
                isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
            ):
                raise ValueError(
                    f"LARSMixedPrecision folds weight decay into the gradient (L2, as LARS "
                    f"defines it), which would change {type(optimizer).__name__}'s decoupled "
                    "decay; use SGD (or Adam) for LARS, or set weight_decay=0"
                )
        decayed_excluded = sum(
            1 for g in optimizer.param_groups if g.get("weight_decay", 0.0)
            for p in g["params"] if not self._adapts(p)
        )
        if decayed_excluded:
            rank_zero_warn(
                f"LARSMixedPrecision: {decayed_excluded} parameters that LARS excludes (bias/norm) "
                "are in optimizer groups with weight decay, so they are still decayed; Jia et al. "
                "2018 decay neither: add the NoWeightDecayOnBiasNorm callback or build the groups "
                "with lightning_fastscale.param_groups"
            )

    # ---- autocast ----------------------------------------------------------------------

    def autocast_context_manager(self) -> torch.autocast:
        """``torch.autocast`` for the mixed modes; a disabled one for ``"32-true"``."""
        if self.precision == "32-true":
            return torch.autocast(self.device, enabled=False)
        return super().autocast_context_manager()

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled gradients (this plugin unscales for every optimizer, fused ones too)."""
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    # ---- the step ----------------------------------------------------------------------

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Closure, unscale, hooks/clipping, non-finite skip, LARS, optimizer step, scaler update."""
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("LARSMixedPrecision does not support LBFGS (a closure-driven line search)")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning skipped backward, there is nothing to step
            return closure_result
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if self._adapted_ids is None:
            self.classify(_lightning_module(model))
            self._validate(optimizer)
        step_output = self.lars_step(optimizer, agree=self._any_rank(model), **kwargs)
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

    def lars_step(
        self, optimizer: Optimizer, agree: Callable[[bool], bool] | None = None, **kwargs: Any
    ) -> Any:
        """Steps 4-6 on unscaled gradients: skip if non-finite, else LARS, then ``optimizer.step``.

        For ``torch.optim.SGD`` itself, with no ``kwargs``, LARS and the step are one fused
        update (:meth:`_fused_sgd_step`) and the gradients are left unchanged; otherwise the
        gradients are rescaled in place and ``optimizer.step(**kwargs)`` runs.

        Args:
            optimizer: the wrapped optimizer.
            agree: turns this rank's "non-finite" flag into the decision of all ranks (skip
                if any rank saw one). Gradients are identical after DDP's all-reduce, but a
                rank that steps while another skips would silently fork the replicas, so the
                Trainer path pays one scalar all-reduce per step for the guarantee.
            kwargs: passed to ``optimizer.step``.

        Returns the optimizer's return value, or None for a skipped step (``last_step_skipped``
        tells which). The scaler is not touched here.
        """
        if self._adapted_ids is None:
            raise RuntimeError("LARSMixedPrecision.lars_step before classify(module): connect the plugin first")
        groups = []
        finite: list[Tensor] = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                grads = [p.grad for p in params]
                g_norms = foreach_norms(grads)
                finite.append(torch.isfinite(g_norms).all())
                groups.append((group, params, grads, g_norms))

        nonfinite = bool(finite) and not bool(torch.stack(finite).all())
        self.last_step_skipped = agree(nonfinite) if agree is not None else nonfinite
        if self.last_step_skipped:
            self.skipped_steps += 1
            log.info("LARSMixedPrecision: non-finite gradient, step skipped (%d so far)", self.skipped_steps)
            return None
        if _fused_sgd_applies(optimizer, groups, kwargs):
            return self._fused_sgd_step(optimizer, groups)
        saved: list[tuple[dict, float]] = []
        try:
            for group, params, grads, g_norms in groups:
                flags = [self._adapts(p) for p in params]
                wd = group.get("weight_decay", 0.0)
                if any(flags) or wd:
                    lars_rescale_(
                        params, grads, lr=float(group["lr"]), weight_decay=wd, eta=self.eta,
                        eps=self.eps, trust_clip=self.trust_clip,
                        adapt=torch.tensor(flags, device=g_norms.device), grad_norms=g_norms,
                    )
                if wd:
                    saved.append((group, wd))
                    group["weight_decay"] = 0.0
            return optimizer.step(**kwargs)
        finally:
            for group, wd in saved:
                group["weight_decay"] = wd

    def _fused_sgd_step(self, optimizer: Optimizer, groups: list[tuple[dict, list, list, Tensor]]) -> None:
        """``lars_sgd_`` on torch SGD's own state: the ratio folded into the momentum update.

        Same result as the generic path (rescale the gradients, then ``SGD.step``) without
        writing the rescaled gradients: one read and one write pass over memory less. The
        momentum buffers live in ``optimizer.state[p]["momentum_buffer"]``, where SGD keeps
        them, so checkpoints move freely between the two paths and plain SGD.

        What ``SGD.step()`` does besides the arithmetic is kept:

        * step pre/post hooks (per optimizer and global) and the profiler's
          ``Optimizer.step#SGD.step`` range: torch adds them to ``SGD.step`` by wrapping it
          with ``Optimizer.profile_hook_step`` (``Optimizer._patch_step_function``); the update
          here is wrapped with that same function and called as ``step()`` is, with only the
          optimizer as argument, so hooks run in the same order with the same arguments.
          Pre-hooks run before the update and see the unscaled, un-rescaled gradients (on the
          generic path they see the rescaled ones). The ratio reuses the gradient norms of the
          non-finite check (a pass over memory less) unless a pre-hook is registered, which
          may have changed the gradients: then they are measured again after the hooks.
        * the "optimizer.step() was called" mark of torch LR schedulers: ``LRScheduler``
          replaces the instance's ``step`` by a wrapper that sets ``optimizer._opt_called``
          and then calls the class's ``step``; ``_fused_sgd_applies`` takes this path only
          when that wrapper (or none) is installed, and the mark is set here as the wrapper
          would.
        * no autograd recording (``SGD.step`` runs under no_grad unless ``differentiable``,
          which this path refuses).

        Lightning counts steps in its loops, around the precision plugin, not through the torch
        optimizer, so its accounting is the same on both paths.
        """

        # torch keeps no public list of hooks; an unknown layout counts as "hooks present"
        pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", True) or getattr(
            torch_optimizer_module, "_global_optimizer_pre_hooks", True
        )

        def update(opt: Optimizer) -> None:
            with torch.no_grad():
                for group, params, grads, g_norms in groups:
                    if pre_hooks:
                        g_norms = foreach_norms(grads)
                    momentum = group["momentum"]
                    bufs = [opt.state[p].get("momentum_buffer") for p in params] if momentum else []
                    lars_sgd_(
                        params, grads, bufs, lr=float(group["lr"]), momentum=momentum,
                        dampening=group["dampening"], nesterov=group["nesterov"],
                        weight_decay=float(group["weight_decay"]), eta=self.eta, eps=self.eps,
                        trust_clip=self.trust_clip, grad_norms=g_norms,
                        adapt=torch.tensor([self._adapts(p) for p in params], device=g_norms.device),
                    )
                    for p, buf in zip(params, bufs):
                        opt.state[p]["momentum_buffer"] = buf

        if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
            optimizer._opt_called = True  # type: ignore[attr-defined]
        return Optimizer.profile_hook_step(update)(optimizer)

    def _log(self, model: pl.LightningModule) -> None:
        # self.log is only valid inside the Trainer's control flow (fit loop hooks)
        trainer = getattr(model, "_trainer", None)
        if trainer is None or getattr(model, "_current_fx_name", None) is None:
            return
        metrics = {"lars/skipped_steps": float(self.skipped_steps)}
        if self.scaler is not None:
            metrics["lars/loss_scale"] = float(self.scaler.get_scale())
        model.log_dict(metrics, on_step=True, on_epoch=False, logger=trainer.logger is not None)

    # ---- checkpointing -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Loss-scaler state and the skip counters, saved in Lightning checkpoints."""
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
            "last_step_skipped": self.last_step_skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.last_step_skipped = bool(state_dict.get("last_step_skipped", False))
