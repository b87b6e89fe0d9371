"""LARS (You, Gitman & Ginsburg 2017, arXiv:1708.03888): layer-wise learning rates, as one
update function over tensor lists and a torch optimizer.

    r  = eta * ||w|| / (||g|| + wd * ||w|| + eps)
    g' = r * (g + wd * w)        then momentum SGD with the global lr.

Details in ``docs/methods/lars_mixed_precision.md``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.sgd import sgd
from typing_extensions import override

from ..param_groups import is_excluded, split_parameters, validate_patterns

# values per CPU slice: three fp32 slices of 256K values (3 MiB) stay in cache
_CPU_SLICE = 1 << 18


def _batch_size(device: torch.device) -> int | None:
    """Values per slice on ``device``; None: multi-tensor operations (the tests' seam)."""
    return _CPU_SLICE if device.type == "cpu" else None


def _slices(columns: Sequence[Sequence[Tensor]], size: int) -> Iterator[tuple[int, list[Tensor]]]:
    """Matching slices of at most ``size`` values of equally shaped tensors, with their tensors' index."""
    for i, row in enumerate(zip(*columns)):
        if all(t.is_contiguous() for t in row):
            flat = [t.view(-1) for t in row]
            for s in range(0, row[0].numel(), size):
                yield i, [f[s : s + size] for f in flat]
        else:
            yield i, list(row)


def check_lars_options(eta: float, eps: float) -> None:
    """Raise ``ValueError`` for a trust coefficient or epsilon LARS cannot use."""
    if not eta > 0:
        raise ValueError(f"LARS eta={eta!r} must be > 0; You et al. 2017 and the MLPerf reference use 0.001")
    if not eps >= 0:
        raise ValueError(f"LARS eps={eps!r} must be >= 0 (it only guards the division; 1e-8 is usual)")


def foreach_norms(tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norm of each tensor, stacked; half-precision inputs accumulate in fp32."""
    half = tensors[0].dtype in (torch.float16, torch.bfloat16)
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32 if half else None))


@torch.no_grad()
def lars_update_(
    params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None] | None, *, lr: float,
    weight_decay: float, eta: float, eps: float, trust_clip: bool, adapt: Sequence[bool] | Tensor,
    momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False, g_norms: Tensor | None = None,
) -> list[float]:
    """``g' = r * (g + wd * w)`` with the ratios ``r`` (1 where not ``adapt``); returns the ratios.

    Without ``bufs``, ``g'`` is written into ``grads``; given ``bufs`` (momentum buffers or None),
    torch SGD's update on ``g'`` is applied instead and the gradients stay as they were.
    """
    if not params:
        return []
    w_norms = foreach_norms(params)
    g_norms = (foreach_norms(grads) if g_norms is None else g_norms).to(w_norms.dtype)
    adapt = torch.as_tensor(adapt, dtype=torch.bool, device=w_norms.device)
    ratio = eta * w_norms / (g_norms + weight_decay * w_norms + eps)
    ratio = torch.where(adapt & (w_norms > 0) & (g_norms > 0), ratio, 1.0)
    if trust_clip:  # clipping is part of LARS: parameters it does not adapt keep ratio 1
        ratio = torch.where(adapt, (ratio / lr).clamp(max=1.0), ratio)
    r = ratio.tolist()  # one copy to the host
    size = _batch_size(params[0].device)
    if bufs is None:  # the rescale alone, in place
        if size is None:
            if weight_decay:
                torch._foreach_add_(grads, params, alpha=weight_decay)
            torch._foreach_mul_(grads, r)
        else:
            for i, (p, g) in _slices([params, grads], size):
                if weight_decay:
                    g.add_(p, alpha=weight_decay)
                g.mul_(r[i])
        return r
    if size is None:
        if weight_decay:
            e = torch._foreach_add(grads, params, alpha=weight_decay)
            torch._foreach_mul_(e, r)
        else:
            e = torch._foreach_mul(grads, r)
        sgd(params, e, bufs, foreach=True, weight_decay=0.0, momentum=momentum, lr=lr, dampening=dampening,
            nesterov=nesterov, maximize=False)
        return r
    # CPU: each slice's operations in a row, on a cache-sized scratch
    fresh = [b is None for b in bufs]
    if momentum:
        bufs[:] = [torch.empty_like(p) if b is None else b for p, b in zip(params, bufs)]
    scratch = torch.empty(size, dtype=grads[0].dtype, device=grads[0].device)
    # an existing buffer takes the ratio folded in (no scratch; fp32/fp64 only, see the method card)
    fold = momentum and not (dampening or nesterov) and params[0].dtype in (torch.float32, torch.float64)
    for i, (p, g, *rest) in _slices([params, grads, bufs] if momentum else [params, grads], size):  # type: ignore[list-item]
        buf = rest[0] if rest else None
        if fold and not fresh[i] and 1e-30 < r[i] < 1e30:
            torch.add(g, buf, alpha=momentum / r[i], out=buf)  # buf <- r * (g + wd * w + m / r * buf)
            if weight_decay:
                buf.add_(p, alpha=weight_decay)
            buf.mul_(r[i])
            p.add_(buf, alpha=-lr)
            continue
        fits = g.numel() <= size and g.dtype == scratch.dtype
        out = scratch[: g.numel()].view(g.shape) if fits else torch.empty_like(g)
        if weight_decay:
            torch.add(g, p, alpha=weight_decay, out=out)
            out.mul_(r[i])
        else:
            torch.mul(g, r[i], out=out)
        if buf is not None:
            if fresh[i]:
                buf.copy_(out)  # torch SGD starts a buffer from the first gradient, undampened
            elif dampening:
                buf.mul_(momentum).add_(out, alpha=1.0 - dampening)
            else:
                torch.add(out, buf, alpha=momentum, out=buf)  # buf <- g' + m * buf in one pass
            if nesterov:
                out.add_(buf, alpha=momentum)
        p.add_(buf if buf is not None and not nesterov else out, alpha=-lr)
    return r


def lars_rescale_(
    params: Sequence[Tensor], grads: Sequence[Tensor], *, lr: float, weight_decay: float = 0.0, eta: float = 1e-3,
    eps: float = 1e-8, trust_clip: bool = False, adapt: Sequence[bool] | Tensor | None = None,
) -> list[float]:
    """In place: ``grads[i] <- r_i * (grads[i] + weight_decay * params[i])`` (You et al. 2017); returns the ratios.

    The gradients must be the unscaled ones; then step any optimizer with weight decay 0 for these parameters.
    """
    return lars_update_(list(params), list(grads), None, lr=lr, weight_decay=weight_decay, eta=eta, eps=eps,
                        trust_clip=trust_clip, adapt=[True] * len(params) if adapt is None else adapt)


class LARS(torch.optim.Optimizer):
    """Momentum SGD with LARS layer-wise learning rates (You et al. 2017), for plain PyTorch.

    ``torch.optim.SGD`` on ``r * (g + wd * w)`` with SGD's state layout; a group with
    ``lars=False`` is plain SGD. Under Lightning, prefer `LARSMixedPrecision`.

    Args:
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
        """LARS over ``module``, bias/norm parameters (and ``exclude`` globs) with neither LARS nor decay (Jia et al. 2018)."""
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
            bufs = [self.state[p].get("momentum_buffer") if group["momentum"] else None for p in params]
            lars_update_(params, [p.grad for p in params], bufs, lr=float(group["lr"]), momentum=group["momentum"],
                         dampening=group["dampening"], nesterov=group["nesterov"],
                         weight_decay=group["weight_decay"], eta=group["eta"], eps=group["eps"],
                         trust_clip=group["trust_clip"], adapt=[group["lars"] and not is_excluded("", p) for p in params])
            for p, buf in zip(params, bufs):
                if buf is not None:
                    self.state[p]["momentum_buffer"] = buf
        return loss
