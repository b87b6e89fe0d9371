"""LARS: layer-wise adaptive rate scaling, as functions over tensor lists and a torch optimizer.

You, Gitman & Ginsburg 2017 ("Large Batch Training of Convolutional Networks",
arXiv:1708.03888) give each layer its own learning rate:

    r  = eta * ||w|| / (||g|| + wd * ||w|| + eps)
    g' = r * (g + wd * w)        then momentum SGD with the global lr.

Jia et al. 2018 (arXiv:1807.11205) combined it with half-precision compute: the ratio and the
update are computed in fp32, on fp32 master weights. As in timm's ``Lars`` and NVIDIA apex
LARC, the ratio is 1 where ``||w||`` or ``||g||`` is 0, ``trust_clip`` is LARC's clip mode
(``r = min(r / lr, 1)``), and parameters that are not adapted get ratio 1.

Every update is one multi-tensor (``torch._foreach_*``) kernel. On accelerators it runs once
over the whole list; on the CPU, where a foreach op is a loop over tensors anyway, it runs over
cache-sized batches of slices, so each slice is read from memory once for all the operations.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from ..param_groups import is_excluded, split_parameters, validate_patterns

# elements per CPU batch: three fp32 columns of 256K values (3 MiB) stay in cache
_CPU_BATCH = 1 << 18


def _batch_size(device: torch.device) -> int | None:
    """Elements per kernel call on ``device``; None: the whole list at once."""
    return _CPU_BATCH if device.type == "cpu" else None


def _batches(columns: Sequence[Sequence[Tensor]], size: int | None) -> Iterator[tuple[list[int], list[list[Tensor]]]]:
    """Matching slices of equally shaped tensor columns, grouped about ``size`` elements a batch,
    with the index of the tensor each slice came from (a strided tensor is one slice)."""
    if size is None:
        yield list(range(len(columns[0]))), [list(c) for c in columns]
        return
    idx: list[int] = []
    out: list[list[Tensor]] = [[] for _ in columns]
    count = 0
    for i, row in enumerate(zip(*columns)):
        if all(t.is_contiguous() for t in row):
            flat = [t.view(-1) for t in row]
            pieces = [[f[s : s + size] for f in flat] for s in range(0, flat[0].numel(), size)]
        else:
            pieces = [list(row)]
        for piece in pieces:
            idx.append(i)
            for column, t in zip(out, piece):
                column.append(t)
            count += piece[0].numel()
            if count >= size:
                yield idx, out
                idx, out, count = [], [[] for _ in columns], 0
    if idx:
        yield idx, out


def check_lars_options(eta: float, eps: float) -> None:
    """Raise ``ValueError`` for a trust coefficient or epsilon LARS cannot use."""
    if not eta > 0:
        raise ValueError(f"LARS eta={eta!r} must be > 0; You et al. 2017 and the MLPerf reference use 0.001")
    if not eps >= 0:
        raise ValueError(f"LARS eps={eps!r} must be >= 0 (it only guards the division; 1e-8 is usual)")


def foreach_norms(tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norm of each tensor, stacked; half-precision inputs accumulate in fp32 (a sum of
    fp16 squares underflows below ~1e-4, which is how fp16 LARS loses its updates)."""
    half = tensors[0].dtype in (torch.float16, torch.bfloat16)
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32 if half else None))


def trust_ratios(
    params: Sequence[Tensor], g_norms: Tensor, *, lr: float, weight_decay: float, eta: float, eps: float,
    trust_clip: bool, adapt: Sequence[bool] | Tensor,
) -> list[float]:
    """Per-tensor ratios ``eta * ||w|| / (||g|| + wd * ||w|| + eps)`` (1 where not ``adapt``),
    computed in one stacked fp32 tensor and copied to the host once."""
    w_norms = foreach_norms(params)
    g_norms = g_norms.to(w_norms.dtype)
    adapt = torch.as_tensor(adapt, dtype=torch.bool, device=w_norms.device)
    ratio = eta * w_norms / (g_norms + weight_decay * w_norms + eps)
    ratio = torch.where(adapt & (w_norms > 0) & (g_norms > 0), ratio, 1.0)
    if trust_clip:  # clipping is part of LARS: parameters it does not adapt keep ratio 1
        ratio = torch.where(adapt, (ratio / lr).clamp(max=1.0), ratio)
    return ratio.tolist()


@torch.no_grad()
def lars_rescale_(
    params: Sequence[Tensor], grads: Sequence[Tensor], *, lr: float, weight_decay: float = 0.0, eta: float = 1e-3,
    eps: float = 1e-8, trust_clip: bool = False, adapt: Sequence[bool] | Tensor | None = None,
    g_norms: Tensor | None = None,
) -> list[float]:
    """In place: ``grads[i] <- r_i * (grads[i] + weight_decay * params[i])``; returns the ratios.

    The gradients must be the true (unscaled) ones: with weight decay or ``eps`` the ratio is
    not invariant to a loss scale (apex LARC computed it on scaled gradients, apex issue #1030).
    Then step any optimizer with weight decay 0 for these parameters. ``adapt``: which tensors
    LARS adapts (default all); ``g_norms``: the stacked gradient norms if already known.
    """
    if not params:
        return []
    g_norms = foreach_norms(grads) if g_norms is None else g_norms
    r = trust_ratios(params, g_norms, lr=lr, weight_decay=weight_decay, eta=eta, eps=eps, trust_clip=trust_clip,
                     adapt=[True] * len(params) if adapt is None else adapt)
    for idx, (ps, gs) in _batches([params, grads], _batch_size(params[0].device)):
        if weight_decay:
            torch._foreach_add_(gs, ps, alpha=weight_decay)
        torch._foreach_mul_(gs, [r[i] for i in idx])
    return r


@torch.no_grad()
def lars_sgd_(
    params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], *, lr: float, momentum: float,
    dampening: float, nesterov: bool, weight_decay: float, eta: float, eps: float, trust_clip: bool,
    adapt: Sequence[bool], g_norms: Tensor | None = None, rescale_grads: bool = False,
) -> None:
    """One LARS momentum-SGD step over lists, new buffers stored in ``bufs``.

    Equal to `lars_rescale_` followed by ``torch.optim.SGD`` with weight decay 0, with
    the ratio folded into the momentum update: with ``G = g + wd*w`` and ``c = r*(1-d)`` (``r``
    for a new buffer, which torch SGD starts undampened from zero), ``buf = m*buf + c*G``. For
    plain momentum that is computed in place as ``c * (buf * m/c + G)``: no temporary, no pass
    more than SGD's own. ``grads`` are left unchanged, unless ``rescale_grads``: then they
    become ``r*G`` and the update is torch SGD's own operations on them, batch by batch (what
    the plugins run for ``torch.optim.SGD``). ``g_norms``: the stacked gradient norms if known.
    """
    if not params:
        return
    g_norms = foreach_norms(grads) if g_norms is None else g_norms
    r = trust_ratios(params, g_norms, lr=lr, weight_decay=weight_decay, eta=eta, eps=eps,
                     trust_clip=trust_clip, adapt=adapt)
    m, fresh = momentum, [b is None for b in bufs]
    if m:
        bufs[:] = [torch.zeros_like(p) if b is None else b for p, b in zip(params, bufs)]
    c = [ri if f else ri * (1.0 - dampening) for ri, f in zip(r, fresh)]
    # the in-place form rounds twice more: single or double precision, and m/c well inside their range
    in_place = m and not nesterov and params[0].dtype in (torch.float32, torch.float64)
    size = _batch_size(params[0].device)
    for idx, (ps, gs, *bs) in _batches([params, grads, bufs] if m else [params, grads], size):
        cs = [c[i] for i in idx]
        if rescale_grads:
            _sgd_on_rescaled(ps, gs, bs[0] if m else [], [r[i] for i in idx], [fresh[i] for i in idx], lr=lr,
                             momentum=m, dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
                             per_slice=size is not None)
            continue
        if in_place and 1e-30 < min(cs) and max(cs) < 1e30:
            torch._foreach_mul_(bs[0], [m / ci for ci in cs])
            torch._foreach_add_(bs[0], gs)
            if weight_decay:
                torch._foreach_add_(bs[0], ps, alpha=weight_decay)
            torch._foreach_mul_(bs[0], cs)
            torch._foreach_add_(ps, bs[0], alpha=-lr)
            continue
        e = torch._foreach_add(gs, ps, alpha=weight_decay) if weight_decay else torch._foreach_mul(gs, 1.0)
        torch._foreach_mul_(e, cs)  # c*G
        if not m:
            torch._foreach_add_(ps, e, alpha=-lr)
            continue
        torch._foreach_mul_(bs[0], m)
        torch._foreach_add_(bs[0], e)
        if nesterov:  # p -= lr * (r*G + m*buf), and r*G = c*G (nesterov has dampening 0)
            torch._foreach_add_(ps, e, alpha=-lr)
            torch._foreach_add_(ps, bs[0], alpha=-lr * m)
        else:
            torch._foreach_add_(ps, bs[0], alpha=-lr)


def _sgd_on_rescaled(
    ps: list[Tensor], gs: list[Tensor], bs: list[Tensor], r: list[float], fresh: list[bool], *, lr: float,
    momentum: float, dampening: float, nesterov: bool, weight_decay: float, per_slice: bool,
) -> None:
    """``gs <- r * (gs + wd * ps)`` in place, then torch SGD's update (weight decay 0) on them; a
    new buffer (zeros here) takes the rescaled gradient undampened, as torch SGD's.

    ``per_slice`` (the CPU's cache-sized batches): each slice's operations in a row, the
    momentum as one ``buf <- g + m * buf`` written into ``buf`` (an operation the multi-tensor
    API lacks), four passes over the slice where the multi-tensor form needs five.
    """
    if per_slice:
        for i, (p, g) in enumerate(zip(ps, gs)):
            if weight_decay:
                g.add_(p, alpha=weight_decay)
            g.mul_(r[i])
            if not momentum:
                p.add_(g, alpha=-lr)
                continue
            b = bs[i]
            if dampening and not fresh[i]:
                b.mul_(momentum).add_(g, alpha=1.0 - dampening)
            else:
                torch.add(g, b, alpha=momentum, out=b)
            if nesterov:
                g.add_(b, alpha=momentum)  # in place, as torch SGD does with weight decay 0
            p.add_(g if nesterov else b, alpha=-lr)
        return
    if weight_decay:
        torch._foreach_add_(gs, ps, alpha=weight_decay)
    torch._foreach_mul_(gs, r)
    if not momentum:
        torch._foreach_add_(ps, gs, alpha=-lr)
        return
    torch._foreach_mul_(bs, momentum)
    if dampening and any(fresh):
        for b, g, f in zip(bs, gs, fresh):
            b.add_(g, alpha=1.0 if f else 1.0 - dampening)
    else:
        torch._foreach_add_(bs, gs, alpha=1.0 - dampening)
    if nesterov:
        torch._foreach_add_(gs, bs, alpha=momentum)
    torch._foreach_add_(ps, gs if nesterov else bs, alpha=-lr)


class LARS(torch.optim.Optimizer):
    """Momentum SGD with LARS layer-wise learning rates (You et al. 2017), for plain PyTorch.

    Equal to ``torch.optim.SGD`` on the gradient ``r * (g + wd * w)`` (see `lars_sgd_`),
    with SGD's state layout (``momentum_buffer``). Given bare parameters, those with
    ``ndim <= 1`` (bias, norm affine) are not adapted but still decayed, as by SGD;
    [`from_module`][lightning_fastscale.precision.LARS.from_module] applies the full rule of [`lightning_fastscale.param_groups`][lightning_fastscale.param_groups] and
    gives the excluded parameters neither LARS nor weight decay (Jia et al. 2018). A group with
    ``lars=False`` is plain SGD. Under Lightning, prefer
    [`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision] (loss scaling, non-finite skip).

    Same trajectory as ``timm.optim.Lars(trust_coeff=eta)`` with the excluded parameters in a
    group of weight decay 0 and ``always_adapt=True`` on the others.

    Args:
        params: parameters or parameter groups.
        lr: global learning rate.
        momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``.
        eta: trust coefficient (0.001 in You et al. and MLPerf).
        eps: added to the ratio's denominator.
        trust_clip: LARC clip mode (a layer's effective lr is ``min(local_lr, lr)``).

    Examples:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        >>> opt = LARS.from_module(net, lr=0.1, momentum=0.9, weight_decay=5e-5, eta=1e-3)
        >>> net(torch.randn(3, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self, params: Iterable[Any], lr: float, momentum: float = 0.9, dampening: float = 0.0,
        weight_decay: float = 0.0, nesterov: bool = False, *, eta: float = 1e-3, eps: float = 1e-8,
        trust_clip: bool = False,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0:
                raise ValueError(f"LARS {name}={value!r} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("LARS nesterov=True needs momentum > 0 and dampening 0 (as torch SGD)")
        check_lars_options(eta, eps)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, eta=eta, eps=eps, trust_clip=trust_clip, lars=True)
        super().__init__(params, defaults)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (it may override any default, and ``lars``)."""
        super().add_param_group(param_group)
        check_lars_options(self.param_groups[-1]["eta"], self.param_groups[-1]["eps"])

    @classmethod
    def from_module(
        cls, module: nn.Module, lr: float, weight_decay: float = 0.0, exclude: Sequence[str] = (), **kwargs: Any
    ) -> LARS:
        """LARS over ``module``: bias/norm parameters (and ``exclude`` name globs) in a group
        with neither LARS nor weight decay (Jia et al. 2018; MLPerf reference)."""
        adapted, excluded = split_parameters(module, validate_patterns(exclude))
        if not adapted:
            raise ValueError(f"LARS.from_module: exclude={list(exclude)!r} with the bias/norm rule excludes "
                             "every parameter of the module; narrow the patterns")
        groups: list[dict[str, Any]] = [{"params": [p for _, p in adapted], "weight_decay": weight_decay}]
        if excluded:
            groups.append({"params": [p for _, p in excluded], "weight_decay": 0.0, "lars": False})
        return cls(groups, lr=lr, **kwargs)

    @override
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
            bufs = [self.state[p].get("momentum_buffer") for p in params]
            lars_sgd_(
                params, [p.grad for p in params], bufs, lr=float(group["lr"]), momentum=group["momentum"],
                dampening=group["dampening"], nesterov=group["nesterov"], weight_decay=group["weight_decay"],
                eta=group["eta"], eps=group["eps"], trust_clip=group["trust_clip"],
                adapt=[group["lars"] and not is_excluded("", p) for p in params],
            )
            if group["momentum"]:
                for p, buf in zip(params, bufs):
                    self.state[p]["momentum_buffer"] = buf
        return loss
