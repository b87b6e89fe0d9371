"""LARS: layer-wise adaptive rate scaling, as a functional core and a plain torch optimizer.

You, Gitman & Ginsburg 2017 ("Large Batch Training of Convolutional Networks",
arXiv:1708.03888) give each layer its own learning rate, proportional to the ratio of the
weight norm to the gradient norm:

    local_lr = eta * ||w|| / (||g|| + wd * ||w|| + eps)
    g'       = local_lr * (g + wd * w)        then momentum SGD with the global lr.

Jia et al. 2018 (Tencent, "Highly Scalable Deep Learning Training System with
Mixed-Precision: Training ImageNet in Four Minutes") combined it with half-precision compute:
the trust ratio and the update are computed in fp32, on fp32 master weights.

Conventions, chosen to match timm's ``Lars`` (and NVIDIA apex LARC) so trajectories agree:

* the ratio is 1 where ``||w|| == 0`` or ``||g|| == 0`` (fresh zero-initialised layers);
* ``trust_clip`` is LARC's clip mode: ``ratio = min(ratio / lr, 1)``, i.e. the effective
  learning rate of a layer is ``min(local_lr, lr)``;
* parameters that are not adapted (bias, norm layers: see
  [`lightning_fastscale.param_groups`][lightning_fastscale.param_groups]) get ratio 1, i.e. the plain ``g + wd * w``.

The per-layer norms and ratios are one stacked tensor each; the update runs as torch's
multi-tensor (``_foreach``) kernels on accelerators and as per-layer, cache-sized slices on
the CPU (`default_kernels`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..param_groups import is_excluded, split_parameters, validate_patterns

_HALF = (torch.float16, torch.bfloat16)


def check_lars_options(eta: float, eps: float) -> None:
    """Raise ``ValueError`` for a trust coefficient or epsilon LARS cannot use."""
    if not eta > 0:
        raise ValueError(
            f"LARS trust coefficient eta={eta!r} must be > 0; You et al. 2017 and the MLPerf "
            "ResNet-50 reference use eta=0.001"
        )
    if not eps >= 0:
        raise ValueError(f"LARS eps={eps!r} must be >= 0 (it only guards the division; 1e-8 is usual)")


def foreach_norms(tensors: Sequence[Tensor]) -> Tensor:
    """fp32 (or fp64) L2 norm of each tensor, stacked into one 1-D tensor.

    Half-precision inputs are accumulated in fp32: a sum of squares of fp16 values overflows
    above ~256 and underflows below ~1e-4, which is how fp16 LARS loses its updates.
    """
    if not tensors:
        return torch.empty(0)
    dtype = torch.float32 if tensors[0].dtype in _HALF else None
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=dtype))


def trust_ratios(
    w_norms: Tensor,
    g_norms: Tensor,
    *,
    lr: float,
    weight_decay: float,
    eta: float,
    eps: float,
    trust_clip: bool,
    adapt: Tensor | None = None,
) -> Tensor:
    """Per-layer LARS ratios ``eta * ||w|| / (||g|| + wd * ||w|| + eps)`` (You et al. 2017).

    Args:
        w_norms, g_norms: stacked per-layer norms (same shape).
        lr: the group's global learning rate (used only by ``trust_clip``).
        weight_decay: the group's L2 weight decay, folded into the ratio's denominator.
        eta: trust coefficient.
        eps: added to the denominator.
        trust_clip: LARC clip mode, ``min(ratio / lr, 1)``.
        adapt: optional boolean mask; where False the ratio is 1 (parameter not adapted).

    Returns:
        A tensor of ratios, in fp32 for half-precision norms.
    """
    w_norms = w_norms.float() if w_norms.dtype in _HALF else w_norms
    g_norms = g_norms.to(w_norms.dtype)
    ratio = eta * w_norms / (g_norms + weight_decay * w_norms + eps)
    keep = (w_norms > 0) & (g_norms > 0)
    if adapt is not None:
        keep &= adapt
    ratio = torch.where(keep, ratio, torch.ones_like(ratio))
    if trust_clip:
        clipped = (ratio / lr).clamp(max=1.0)
        # unadapted parameters keep ratio 1: clipping is part of LARS, not of plain SGD
        ratio = clipped if adapt is None else torch.where(adapt, clipped, ratio)
    return ratio


KERNELS = ("foreach", "per_tensor")

# elements per slice of the CPU kernels: three fp32 slices of 256K values (3 MiB) stay in cache
# between the operations on them (benchmarks/README.md, "LARS step")
_CPU_SLICE = 1 << 18


def default_kernels(device: torch.device) -> str:
    """The update's implementation for tensors on ``device``.

    ``"foreach"`` (CUDA and other accelerators): torch's multi-tensor kernels with the
    per-layer scalars passed as one list of Python numbers, the form CUDA's foreach dispatch
    runs fused (a list of 0-d tensors sends it to a per-tensor fallback). ``"per_tensor"``
    (CPU, where foreach ops are a per-tensor loop anyway): each layer's operations done in a
    row on cache-sized slices, so a slice is read from memory once for all of them.
    """
    return "per_tensor" if torch.device(device).type == "cpu" else "foreach"


def _check_kernels(kernels: str | None, device: torch.device) -> str:
    kernels = kernels or default_kernels(device)
    if kernels not in KERNELS:
        raise ValueError(f"LARS kernels={kernels!r}: use one of {KERNELS} (or None: by device)")
    return kernels


def _slices(*tensors: Tensor) -> Iterable[tuple[Tensor, ...]]:
    """Matching flat slices of equally shaped tensors (the whole tensors if any is strided)."""
    if not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    for start in range(0, n, _CPU_SLICE):
        yield tuple(f[start : start + _CPU_SLICE] for f in flat)


def _ratio_list(
    params: Sequence[Tensor], g_norms: Tensor, *, lr: float, weight_decay: float, eta: float, eps: float,
    trust_clip: bool, adapt: Tensor | None,
) -> tuple[Tensor, list[float]]:
    """The ratios as one tensor and as Python numbers (one device-to-host copy for all)."""
    ratios = trust_ratios(
        foreach_norms(params), g_norms, lr=lr, weight_decay=weight_decay, eta=eta, eps=eps,
        trust_clip=trust_clip, adapt=adapt,
    )
    return ratios, ratios.tolist()


def lars_rescale_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    lr: float,
    weight_decay: float = 0.0,
    eta: float = 1e-3,
    eps: float = 1e-8,
    trust_clip: bool = False,
    adapt: Tensor | None = None,
    grad_norms: Tensor | None = None,
    kernels: str | None = None,
) -> Tensor:
    """In place: ``grads[i] <- r_i * (grads[i] + weight_decay * params[i])`` (You et al. 2017).

    The gradients must be the true (unscaled) ones: the ratio is not invariant to a loss
    scale when ``weight_decay`` or ``eps`` is non-zero (apex LARC issue #1030 computed it on
    loss-scaled gradients). After this, step any optimizer with weight decay 0 for these
    parameters; their decay is already in the gradient.

    Args:
        params, grads: matching lists, one device.
        lr, weight_decay, eta, eps, trust_clip: see `trust_ratios`.
        adapt: boolean mask over the list; False entries get ratio 1 (plain ``g + wd*w``).
        grad_norms: the stacked gradient norms if the caller already has them.
        kernels: ``"foreach"`` or ``"per_tensor"`` (see `default_kernels`; None: by device).

    Returns:
        The ratios that were applied (1-D, one per tensor).
    """
    if not params:
        return torch.empty(0)
    kernels = _check_kernels(kernels, params[0].device)
    g_norms = foreach_norms(grads) if grad_norms is None else grad_norms
    ratios, r = _ratio_list(
        params, g_norms, lr=lr, weight_decay=weight_decay, eta=eta, eps=eps, trust_clip=trust_clip, adapt=adapt
    )
    grads, params = list(grads), list(params)
    if kernels == "foreach":
        if weight_decay:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        torch._foreach_mul_(grads, r)
        return ratios
    for p, g, ri in zip(params, grads, r):
        for pc, gc in _slices(p, g):
            if weight_decay:
                gc.add_(pc, alpha=weight_decay)
            gc.mul_(ri)
    return ratios


def lars_sgd_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor | None],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    eta: float,
    eps: float,
    trust_clip: bool,
    adapt: Tensor,
    grad_norms: Tensor | None = None,
    kernels: str | None = None,
) -> None:
    """One LARS + momentum-SGD step over lists, leaving ``grads`` unmodified.

    Same update as ``lars_rescale_`` followed by ``torch.optim.SGD`` (weight decay 0), with
    the ratio folded into the momentum update (``buf = m*buf + r*(g + wd*w)``) instead of
    being written into the gradient first. New momentum buffers are stored into
    ``momentum_buffers`` in place. ``grad_norms``: the stacked gradient norms if the caller
    already has them (the plugin's non-finite check computes them). ``kernels``: see
    `default_kernels`.

    The per-layer ratios are computed as one tensor and copied to the host once (a
    synchronisation on CUDA; the plugins already make one for the non-finite decision) so
    that every multi-tensor kernel gets them as a list of numbers.
    """
    if not params:
        return
    kernels = _check_kernels(kernels, params[0].device)
    g_norms = foreach_norms(grads) if grad_norms is None else grad_norms
    _, r = _ratio_list(
        params, g_norms, lr=lr, weight_decay=weight_decay, eta=eta, eps=eps, trust_clip=trust_clip, adapt=adapt
    )
    step = _lars_sgd_foreach if kernels == "foreach" else _lars_sgd_per_tensor
    step(params, grads, momentum_buffers, r, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
         weight_decay=weight_decay)


def _lars_sgd_per_tensor(
    params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], r: list[float], *,
    lr: float, momentum: float, dampening: float, nesterov: bool, weight_decay: float,
) -> None:
    """CPU form: per layer, per cache-sized slice, every operation of the update in a row."""
    wd, m, scale = weight_decay, momentum, 1.0 - dampening
    for i, (p, g, ri) in enumerate(zip(params, grads, r)):
        if m == 0:
            # p <- p * (1 - lr*r*wd) - lr*r*g
            for pc, gc in _slices(p, g):
                if wd:
                    pc.mul_(1.0 - lr * ri * wd)
                pc.add_(gc, alpha=-lr * ri)
            continue
        buf = bufs[i]
        if buf is None:
            # torch SGD starts a buffer at the first update itself (no dampening)
            buf = torch.mul(g, ri)
            if wd:
                buf.add_(p, alpha=ri * wd)
            bufs[i] = buf
            fresh = True
        else:
            fresh = False
        for pc, gc, bc in _slices(p, g, buf):
            if not fresh:
                bc.mul_(m).add_(gc, alpha=ri * scale)
                if wd:
                    bc.add_(pc, alpha=ri * wd * scale)
            if nesterov:
                # p <- p - lr * (r*(g + wd*p) + m*buf), with the decay term taken from the old p
                if wd:
                    pc.mul_(1.0 - lr * ri * wd)
                pc.add_(gc, alpha=-lr * ri).add_(bc, alpha=-lr * m)
            else:
                pc.add_(bc, alpha=-lr)


def _lars_sgd_foreach(
    params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], r: list[float], *,
    lr: float, momentum: float, dampening: float, nesterov: bool, weight_decay: float,
) -> None:
    """Multi-tensor form: four foreach kernels over the whole list, as many as torch's SGD.

    With ``G = g + wd*p`` (one out-of-place kernel, as SGD's own weight decay) scaled in place
    to ``E = r*(1-d)*G / (1-m)``, the momentum update ``m*buf + (1-d)*r*G`` is one
    ``lerp(buf, E, 1-m)``: the per-layer ratio costs no pass over the buffers.
    """
    wd, m = weight_decay, momentum

    def scaled(idx: list[int], factors: list[float]) -> list[Tensor]:
        # G_i * factor_i for the listed layers, in new tensors (the gradients stay as they are)
        gs = [grads[i] for i in idx]
        if wd:
            out = torch._foreach_add(gs, [params[i] for i in idx], alpha=wd)
            torch._foreach_mul_(out, factors)
            return out
        return torch._foreach_mul(gs, factors)

    everything = list(range(len(params)))
    if m == 0:
        torch._foreach_add_(params, scaled(everything, [-lr * ri for ri in r]))
        return
    old = [i for i, b in enumerate(bufs) if b is not None]
    fresh = [i for i, b in enumerate(bufs) if b is None]
    if fresh:
        # torch SGD starts a buffer at the first update itself (no dampening): buf = r*G
        for i, buf in zip(fresh, scaled(fresh, [r[i] for i in fresh])):
            bufs[i] = buf
    if old:
        old_bufs = [bufs[i] for i in old]
        if m < 1:
            e = scaled(old, [r[i] * (1.0 - dampening) / (1.0 - m) for i in old])
            torch._foreach_lerp_(old_bufs, e, 1.0 - m)
        else:  # lerp's weight would be 0: the two-kernel form
            e = scaled(old, [r[i] * (1.0 - dampening) for i in old])
            torch._foreach_mul_(old_bufs, m)
            torch._foreach_add_(old_bufs, e)
    if not nesterov:
        torch._foreach_add_(params, bufs, alpha=-lr)  # type: ignore[arg-type]
        return
    # p <- p - lr * (r*G + m*buf); nesterov needs dampening 0, so r*G = (1-m)*E for the old
    # buffers (m < 1; torch refuses nesterov with m >= 1 only through dampening, so cover it)
    # and r*G = buf for the fresh ones
    if old:
        if m < 1:
            torch._foreach_add_([params[i] for i in old], e, alpha=-lr * (1.0 - m))
        else:
            torch._foreach_add_([params[i] for i in old], e, alpha=-lr)
        torch._foreach_add_([params[i] for i in old], old_bufs, alpha=-lr * m)
    if fresh:
        torch._foreach_add_([params[i] for i in fresh], [bufs[i] for i in fresh], alpha=-lr * (1.0 + m))


class LARS(torch.optim.Optimizer):
    """Momentum SGD with LARS layer-wise learning rates (You et al. 2017), for plain PyTorch.

    The update equals ``torch.optim.SGD`` (momentum, dampening, nesterov) on the gradient
    ``r * (g + wd * w)``, ``r`` the trust ratio of `trust_ratios`, computed in fp32. The
    same arithmetic as [`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision]; use that
    plugin under Lightning (it adds loss scaling and skipping of non-finite steps).

    Which parameters are adapted follows the shared rule of
    [`lightning_fastscale.param_groups`][lightning_fastscale.param_groups]: given bare parameters, those with ``ndim <= 1``
    (bias, norm affine) are not adapted (they still get the group's weight decay, as SGD
    would); [`from_module`][lightning_fastscale.precision.LARS.from_module] applies the full rule (also parameters of norm layers and
    name patterns) and gives the excluded ones weight decay 0, as Jia et al. 2018 do.
    A group with ``lars=False`` is plain SGD.

    Args:
        params: parameters or parameter groups.
        lr: global learning rate.
        momentum, dampening, nesterov, weight_decay: as in ``torch.optim.SGD``.
        eta: trust coefficient (0.001 in You et al. and MLPerf).
        eps: added to the ratio's denominator.
        trust_clip: LARC clip mode (effective lr ``min(local_lr, lr)``).

    Correspondence with ``timm.optim.Lars``: ``trust_coeff=eta``, same ``eps``,
    ``trust_clip``, momentum/dampening/nesterov; timm adapts every parameter of a group with
    non-zero weight decay, so put the excluded parameters in a group with ``weight_decay=0``
    (what [`from_module`][lightning_fastscale.precision.LARS.from_module] does) to get identical trajectories.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        eta: float = 1e-3,
        eps: float = 1e-8,
        trust_clip: bool = False,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"LARS lr={lr!r} must be >= 0")
        if not momentum >= 0:
            raise ValueError(f"LARS momentum={momentum!r} must be >= 0")
        if not weight_decay >= 0:
            raise ValueError(f"LARS weight_decay={weight_decay!r} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("LARS nesterov=True needs momentum > 0 and dampening 0 (as torch SGD)")
        check_lars_options(eta, eps)
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, eta=eta, eps=eps, trust_clip=trust_clip, lars=True,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (may override any default, and ``lars``)."""
        super().add_param_group(param_group)
        check_lars_options(self.param_groups[-1]["eta"], self.param_groups[-1]["eps"])

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        lr: float,
        weight_decay: float = 0.0,
        exclude: Sequence[str] = (),
        **kwargs: Any,
    ) -> LARS:
        """LARS over ``module`` with bias/norm parameters (and ``exclude`` name globs) in a
        group with neither LARS nor weight decay (Jia et al. 2018; MLPerf reference)."""
        adapted, excluded = split_parameters(module, validate_patterns(exclude))
        if not adapted:
            raise ValueError(
                f"LARS.from_module: exclude={list(exclude)!r} together with the bias/norm rule "
                "excludes every parameter of the module; narrow the patterns"
            )
        groups: list[dict[str, Any]] = [{"params": [p for _, p in adapted], "weight_decay": weight_decay}]
        if excluded:
            groups.append({"params": [p for _, p in excluded], "weight_decay": 0.0, "lars": False})
        return cls(groups, lr=lr, **kwargs)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update; ``closure`` re-evaluates the loss as for any torch optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = [self.state[p].get("momentum_buffer") for p in params] if group["momentum"] else []
            adapt = torch.tensor(
                [group["lars"] and not is_excluded("", p) for p in params], device=params[0].device
            )
            lars_sgd_(
                params, grads, bufs, lr=float(group["lr"]), momentum=group["momentum"],
                dampening=group["dampening"], nesterov=group["nesterov"],
                weight_decay=group["weight_decay"], eta=group["eta"], eps=group["eps"],
                trust_clip=group["trust_clip"], adapt=adapt,
            )
            for p, buf in zip(params, bufs):
                self.state[p]["momentum_buffer"] = buf
        return loss
