"""The LARS step of the precision plugins, independent of Lightning: classify, check, skip, update.

Jia et al. 2018 (Tencent, "Highly Scalable Deep Learning Training System with
Mixed-Precision: Training ImageNet in Four Minutes") compute the LARS trust ratio (You et al.
2017) and the update in fp32 on fp32 master weights from the *unscaled* gradient. Given
unscaled gradients, `LARSStep` does the part of the step that follows:

1. if any gradient is non-finite (or its norm overflows fp32) on any rank: skip the step
   entirely (no weight, momentum or LARS change) and count it, remembering the first
   parameter whose gradient was non-finite;
2. LARS: every gradient becomes ``r * (g + wd * w)`` in fp32, ``r`` the trust ratio for
   adapted parameters and 1 for excluded ones, ``wd`` the group's weight decay; the group's
   ``weight_decay`` is set to 0 for the wrapped step and restored after (as apex LARC does),
   so nothing is decayed twice;
3. the wrapped optimizer's ``step()``.

Steps 2-3 have a fused form for ``torch.optim.SGD`` itself (the usual optimizer): the ratio
is folded into SGD's momentum update (`lars_sgd_`)
on SGD's own state, inside SGD's step hooks, instead of being written into every gradient
first. Same result to float32 rounding, gradients left as they were, and about the cost of a
plain SGD step (``benchmarks/lars_step.py``). Any other optimizer, SGD subclasses included,
takes 2-3 as written.

The Trainer plugin ([`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision]) and the Fabric
plugin ([`LARSFabricPrecision`][lightning_fastscale.precision.LARSFabricPrecision]) each own one
``LARSStep``; they add autocast, loss scaling and the framework's hooks around it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer_module
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from ..param_groups import is_excluded, split_parameters, validate_patterns
from .lars import LARS, check_lars_options, foreach_norms, lars_rescale_, lars_sgd_

log = logging.getLogger(__name__)

# (param group, parameters with a gradient, their gradients, stacked gradient norms)
_Group = tuple[dict, list[Tensor], list[Tensor], Tensor]


def _fused_sgd_applies(optimizer: Optimizer, groups: list[_Group], kwargs: dict) -> bool:
    """Whether ``LARSStep._fused_sgd_step`` reproduces ``optimizer.step()`` exactly.

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


def agree_across_ranks(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on any rank of torch.distributed's default group.

    Plain ``torch.distributed`` for loops that have no Lightning strategy to ask (Fabric's
    precision plugins are not given one); a no-op without an initialised group of 2 or more.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flag
    # NCCL reduces only CUDA tensors: put the flag where the gradients are
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


class LARSStep:
    """LARS on unscaled gradients with a non-finite skip, shared by the precision plugins.

    Args:
        eta: trust coefficient (0.001 in You et al. 2017 and the MLPerf reference).
        eps: added to the ratio's denominator.
        trust_clip: LARC clip mode, ratio ``min(ratio / lr, 1)``: a layer's effective
            learning rate is ``min(local_lr, lr)``.
        exclude: extra glob patterns on parameter names (``fnmatch``) that LARS leaves
            alone, on top of the shared bias/norm rule of [`lightning_fastscale.param_groups`][lightning_fastscale.param_groups].

    Attributes:
        skipped_steps: optimizer steps skipped for non-finite gradients, in total.
        consecutive_skipped_steps: steps skipped in a row up to now (0 after an applied step).
        last_step_skipped: whether the most recent step was skipped.
        first_nonfinite_parameter: name of the first parameter (in optimizer order) whose
            gradient was non-finite at the most recent skipped step; ``None`` when this rank's
            gradients were finite (another rank's were not) or no step was skipped.

    Examples:
        >>> import torch
        >>> net = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        >>> lars = LARSStep(eta=1e-3)
        >>> lars.classify(net)
        >>> net(torch.randn(3, 4)).sum().backward()
        >>> lars.step(opt)
        >>> lars.last_step_skipped
        False
    """

    def __init__(
        self, *, eta: float = 1e-3, eps: float = 1e-8, trust_clip: bool = False, exclude: Sequence[str] = ()
    ) -> None:
        check_lars_options(eta, eps)
        self.eta = eta
        self.eps = eps
        self.trust_clip = trust_clip
        self.exclude = validate_patterns(exclude)
        self.skipped_steps = 0
        self.consecutive_skipped_steps = 0
        self.last_step_skipped = False
        self.first_nonfinite_parameter: str | None = None
        self._adapted_ids: set[int] | None = None
        self._names: dict[int, str] = {}
        self._validated: set[int] = set()

    @property
    def classified(self) -> bool:
        """Whether `classify` has run."""
        return self._adapted_ids is not None

    def classify(self, module: nn.Module) -> None:
        """Record which of ``module``'s parameters LARS adapts (the shared rule + ``exclude``)."""
        adapted, excluded = split_parameters(module, self.exclude)
        self._adapted_ids = {id(p) for _, p in adapted}
        self._names = {id(p): name for name, p in (*adapted, *excluded)}

    def adapts(self, p: Tensor) -> bool:
        """Whether LARS adapts ``p`` (a parameter the module does not name: ``ndim`` rule only)."""
        if self._adapted_ids is None:
            raise RuntimeError("LARSStep: classify(module) before the first step")
        if id(p) in self._names:
            return id(p) in self._adapted_ids
        return not is_excluded("", p)

    def validate(self, optimizer: Optimizer) -> None:
        """Refuse configurations LARS cannot serve; warn about decayed bias/norm parameters."""
        self._validated.add(id(optimizer))
        if isinstance(optimizer, LARS):
            raise ValueError(
                "LARSMixedPrecision would apply LARS a second time on top of the LARS optimizer; "
                "use it with a plain optimizer (torch.optim.SGD), or use the LARS optimizer with "
                "Lightning's own precision (Trainer(precision='16-mixed'|'bf16-mixed'))"
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if params and not any(self.adapts(p) for p in params):
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
            for p in g["params"] if not self.adapts(p)
        )
        if decayed_excluded:
            rank_zero_warn(
                f"LARSMixedPrecision: {decayed_excluded} parameters that LARS excludes (bias/norm) "
                "are in optimizer groups with weight decay, so they are still decayed; Jia et al. "
                "2018 decay neither: add the NoWeightDecayOnBiasNorm callback or build the groups "
                "with lightning_fastscale.param_groups"
            )

    def is_validated(self, optimizer: Optimizer) -> bool:
        """Whether `validate` has seen ``optimizer``."""
        return id(optimizer) in self._validated

    def step(self, optimizer: Optimizer, agree: Callable[[bool], bool] | None = None, **kwargs: Any) -> Any:
        """Skip if non-finite, else LARS, then ``optimizer.step``; on unscaled gradients.

        For ``torch.optim.SGD`` itself, with no ``kwargs``, LARS and the step are one fused
        update (`_fused_sgd_step`) and the gradients are left unchanged; otherwise the
        gradients are rescaled in place and ``optimizer.step(**kwargs)`` runs.

        Args:
            optimizer: the wrapped optimizer.
            agree: turns this rank's "non-finite" flag into the decision of all ranks (skip
                if any rank saw one). Gradients are identical after DDP's all-reduce, but a
                rank that steps while another skips would silently fork the replicas, so the
                plugins pay one scalar all-reduce per step for the guarantee.
            kwargs: passed to ``optimizer.step``.

        Returns the optimizer's return value, or None for a skipped step (``last_step_skipped``
        tells which).
        """
        if self._adapted_ids is None:
            raise RuntimeError("LARSMixedPrecision.lars_step before classify(module): connect the plugin first")
        groups: list[_Group] = []
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
            self.consecutive_skipped_steps += 1
            self.first_nonfinite_parameter = self._first_nonfinite(groups) if nonfinite else None
            log.info(
                "LARS: non-finite gradient (first: %s), step skipped (%d in a row, %d in total)",
                self.first_nonfinite_parameter or "on another rank", self.consecutive_skipped_steps,
                self.skipped_steps,
            )
            return None
        self.consecutive_skipped_steps = 0
        if _fused_sgd_applies(optimizer, groups, kwargs):
            return self._fused_sgd_step(optimizer, groups)
        saved: list[tuple[dict, float]] = []
        try:
            for group, params, grads, g_norms in groups:
                flags = [self.adapts(p) for p in params]
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

    def _first_nonfinite(self, groups: list[_Group]) -> str:
        for _, params, _, g_norms in groups:
            bad = (~torch.isfinite(g_norms)).nonzero()
            if len(bad):
                p = params[int(bad[0])]
                return self._names.get(id(p), f"<unnamed parameter of shape {tuple(p.shape)}>")
        return "<none on this rank>"

    def _fused_sgd_step(self, optimizer: Optimizer, groups: list[_Group]) -> None:
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
                        adapt=torch.tensor([self.adapts(p) for p in params], device=g_norms.device),
                    )
                    for p, buf in zip(params, bufs):
                        opt.state[p]["momentum_buffer"] = buf

        if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
            optimizer._opt_called = True  # type: ignore[attr-defined]
        return Optimizer.profile_hook_step(update)(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The skip counters (the plugins add their scaler's state)."""
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped_steps": self.consecutive_skipped_steps,
            "last_step_skipped": self.last_step_skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (missing keys: a fresh count)."""
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive_skipped_steps = int(state_dict.get("consecutive_skipped_steps", 0))
        self.last_step_skipped = bool(state_dict.get("last_step_skipped", False))
