"""Batch norm over fixed-size groups of the batch (Goyal et al. 2017, section 2.3; Hoffer et al. 2017;
Ying et al. 2018).

Method card: ``docs/methods/ghost_batch_norm.md``.
"""
from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_fastscale._validation import positive_int

_PLAIN_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _check_ghost_batch_size(ghost_batch_size: int) -> None:
    hint = "the number of samples each BN group normalises over, e.g. the per-worker batch of the run being reproduced"
    positive_int("ghost_batch_size", ghost_batch_size, minimum=2, hint=hint)


def ghost_batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    ghost_batch_size: int,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Training-mode batch norm of ``x`` (N, C, ...) over consecutive groups of ``ghost_batch_size``.

    Running statistics move toward the mean over full groups of the group statistics.
    """
    _check_ghost_batch_size(ghost_batch_size)
    n, channels = x.shape[0], x.shape[1]
    groups = n // ghost_batch_size
    if groups <= 1:
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    full = groups * ghost_batch_size
    # Fold the group index into the channel axis, so one native batch-norm call normalises
    # every (group, channel) pair on its own: (G*g, C, ...) -> (g, G*C, ...).
    spatial = x.shape[2:]
    folded = (
        x[:full].reshape(groups, ghost_batch_size, channels, -1)
        .transpose(0, 1).reshape(ghost_batch_size, groups * channels, -1)
    )
    group_mean = group_var = None
    if running_mean is not None and running_var is not None:
        group_mean = running_mean.repeat(groups)
        group_var = running_var.repeat(groups)
    out = F.batch_norm(
        folded, group_mean, group_var,
        None if weight is None else weight.repeat(groups),
        None if bias is None else bias.repeat(groups),
        True, momentum, eps,
    )
    out = out.reshape(ghost_batch_size, groups, channels, -1).transpose(0, 1).reshape(full, channels, *spatial)
    if group_mean is not None:
        # Each group's copy moved from the same start by the same momentum, so their mean is
        # the update with the mean of the group statistics.
        with torch.no_grad():
            running_mean.copy_(group_mean.view(groups, channels).mean(0))
            running_var.copy_(group_var.view(groups, channels).mean(0))
    if full == n:
        return out
    rest = F.batch_norm(x[full:], None, None, weight, bias, True, 0.0, eps)
    return torch.cat([out, rest])


class GhostBatchNormLayer(_BatchNorm):
    """A BatchNorm layer (``nn.BatchNorm2d``'s state-dict keys) normalising training batches in groups."""

    def __init__(self, num_features: int, ghost_batch_size: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None) -> None:
        _check_ghost_batch_size(ghost_batch_size)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.ghost_batch_size = ghost_batch_size

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"GhostBatchNormLayer expects input of shape (N, C, ...), got {tuple(input.shape)}")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ghost_batch_size={self.ghost_batch_size}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        return ghost_batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias,
            self.ghost_batch_size, momentum, self.eps,
        )


def share_state(bn: _BatchNorm, layer: _BatchNorm) -> _BatchNorm:
    """``layer`` (made on the meta device) holding ``bn``'s very parameters and buffers (an optimizer keeps working)."""
    for name, tensor in [*bn.named_parameters(recurse=False), *bn.named_buffers(recurse=False)]:
        setattr(layer, name, tensor)
    layer.train(bn.training)
    return layer


def apply_ghost_batch_norm(model: nn.Module, ghost_batch_size: int) -> list[str]:
    """Replace every plain ``nn.BatchNorm1d/2d/3d`` in ``model`` by a `GhostBatchNormLayer`; the names converted.

    Subclasses (SyncBatchNorm, timm's BatchNormAct2d) are left alone; none to convert is an error.
    """
    _check_ghost_batch_size(ghost_batch_size)
    converted: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, GhostBatchNormLayer):
                child.ghost_batch_size = ghost_batch_size
                converted.append(qualified)
            elif type(child) in _PLAIN_BATCH_NORMS:
                setattr(parent, child_name, share_state(child, GhostBatchNormLayer(
                    child.num_features, ghost_batch_size, child.eps, child.momentum, child.affine,
                    child.track_running_stats, device="meta")))
                converted.append(qualified)
    if not converted:
        others = sorted({type(m).__name__ for m in model.modules() if isinstance(m, _BatchNorm)})
        found = f"; it has {', '.join(others)}, which are not converted" if others else ""
        raise ValueError(
            f"GhostBatchNorm: {type(model).__name__} has no nn.BatchNorm1d/2d/3d layer{found}; "
            "remove the callback, or build the model with plain BatchNorm layers"
        )
    return converted


class GhostBatchNorm(pl.Callback):
    """Normalise each device's training batch in groups of ``ghost_batch_size`` samples.

    Applies `apply_ghost_batch_norm` in ``setup("fit")``, before the optimizers are built; warns
    once if a training batch is no larger than one group (Goyal et al. 2017 used 32).

    Examples:
        Per-worker BN of 32 x 16 on one device holding a batch of 512:

        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
        >>> apply_ghost_batch_norm(model, 16)
        ['1']
        >>> type(model[1]).__name__, model[1].ghost_batch_size
        ('GhostBatchNormLayer', 16)
    """

    def __init__(self, ghost_batch_size: int) -> None:
        _check_ghost_batch_size(ghost_batch_size)
        self.ghost_batch_size = ghost_batch_size
        self._warned = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        layers = apply_ghost_batch_norm(pl_module, self.ghost_batch_size)
        rank_zero_info(f"GhostBatchNorm: {len(layers)} BatchNorm layers normalise groups of {self.ghost_batch_size}")

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if self._warned:
            return
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        size = getattr(inputs, "shape", (None,))[0]
        if size is not None and size <= self.ghost_batch_size:
            rank_zero_warn(
                f"GhostBatchNorm: the per-device training batch ({size}) is not larger than "
                f"ghost_batch_size={self.ghost_batch_size}, so BN is plain batch norm here"
            )
            self._warned = True
