"""Batch-norm statistics over a span of N images, whatever the per-device batch and world size (Goyal et al. 2017).

Ghost groups within a device, process subgroups of consecutive ranks above it.
Method card: ``docs/methods/ghost_batch_norm.md`` ("BN span").
"""
from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.callbacks.ghost_batch_norm import _PLAIN_BATCH_NORMS, apply_ghost_batch_norm, share_state


def bn_span_plan(span: int, per_device_batch: int, world_size: int = 1, ranks_per_node: int | None = None) -> int:
    """How many ranks share BN statistics for ``span`` images: 1 (ghost groups on each device) or more.

    ``ValueError`` names the nearest spans that work.

    Examples:
        >>> bn_span_plan(32, per_device_batch=64), bn_span_plan(256, 64, world_size=8, ranks_per_node=4)
        (1, 4)
    """
    positive_int("bn_span", span, minimum=2, hint="the number of images BN normalises over, e.g. 32")
    positive_int("per-device batch", per_device_batch)
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    valid = [n for n in range(2, per_device_batch + 1) if per_device_batch % n == 0] + [
        per_device_batch * k for k in range(2, world_size + 1)
        if world_size % k == 0 and (ranks_per_node % k == 0 or k % ranks_per_node == 0)]
    if span not in valid:
        below = max((n for n in valid if n < span), default=None)
        above = min((n for n in valid if n > span), default=None)
        nearest = " or ".join(str(n) for n in (below, above) if n is not None) or "none (a per-device batch of 1)"
        raise ValueError(
            f"bn_span={span} must divide the per-device batch ({per_device_batch}) or be it times a number of ranks "
            f"dividing the {world_size} ranks and fitting nodes of {ranks_per_node}: use bn_span={nearest}"
        )
    return max(1, span // per_device_batch)


def span_batch_norm(
    x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
    weight: torch.Tensor | None, bias: torch.Tensor | None, group: dist.ProcessGroup | None,
    momentum: float = 0.1, eps: float = 1e-5,
) -> torch.Tensor:
    """Training-mode batch norm of ``x`` (N, C, ...) over the images of every rank of ``group``, on any backend."""
    channels, dims = x.shape[1], [0, *range(2, x.dim())]
    xf = x.float()
    local = torch.cat([xf.sum(dims), xf.square().sum(dims), xf.new_full((1,), x.numel() // channels)])
    total = dist_fn.all_reduce(local, group=group if group is not None else dist.group.WORLD)
    count = total[-1]
    mean = total[:channels] / count
    var = (total[channels:2 * channels] / count - mean.square()).clamp_min(0)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            running_var.lerp_((var * count / (count - 1)).to(running_var.dtype), momentum)
    shape = (1, channels) + (1,) * (x.dim() - 2)
    y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        y = y * weight.view(shape) + bias.view(shape)
    return y.to(x.dtype)


class SpanBatchNormLayer(_BatchNorm):
    """A BatchNorm layer (``nn.BatchNorm2d``'s state-dict keys) whose training statistics span a process subgroup."""

    def __init__(self, num_features: int, group: dist.ProcessGroup | None = None, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True, track_running_stats: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.group = group

    def __deepcopy__(self, memo: dict) -> SpanBatchNormLayer:
        # a process group is a handle to the ranks, not state: the copy (e.g. the meta copy that
        # counts FLOPs for ThroughputMonitor) shares it; deepcopy cannot pickle it
        memo[id(self.group)] = self.group
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SpanBatchNormLayer expects input of shape (N, C, ...), got {tuple(input.shape)}")

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_meta:  # shape or FLOP tracing: no values to share, the local arithmetic is plain BN's
            return super().forward(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        momentum = 0.1 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        return span_batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, self.group,
                               momentum, self.eps)


def span_groups(world_size: int, ranks_per_group: int) -> list[list[int]]:
    """Consecutive ranks, ``ranks_per_group`` to a group (inside a node when they fit: nodes hold consecutive ranks)."""
    return [list(range(start, start + ranks_per_group)) for start in range(0, world_size, ranks_per_group)]


def apply_bn_span(model: nn.Module, span: int, per_device_batch: int, ranks_per_node: int | None = None) -> int:
    """Make every plain BN layer of ``model`` normalise over ``span`` images; returns the ranks per group.

    ``ranks_per_node`` None: the whole world on one node. Across ranks every rank must call this
    (the default process group up).
    """
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
    ranks = bn_span_plan(span, per_device_batch, world_size, ranks_per_node)
    if ranks == 1:
        apply_ghost_batch_norm(model, span)
        return 1
    mine = None
    for members in span_groups(world_size, ranks):  # every rank makes every group, in the same order
        group = dist.new_group(members)
        mine = group if dist.get_rank() in members else mine
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in _PLAIN_BATCH_NORMS:
                setattr(parent, name, share_state(child, SpanBatchNormLayer(
                    child.num_features, mine, child.eps, child.momentum, child.affine, child.track_running_stats,
                    device="meta")))
    if ranks > ranks_per_node:
        rank_zero_warn(f"bn_span={span} synchronises BN over {ranks} ranks, more than a node's {ranks_per_node}: "
                       "every BN layer then waits on the network in forward and backward "
                       f"(`fastscale-plan MODEL CLUSTER --bn-span {span}` prices it)")
    return ranks


class BNSpan(pl.Callback):
    """BN statistics over ``span`` images: ghost groups within a device, process subgroups above.

    Applied at ``setup("fit")`` with the datamodule's per-device ``train_batch_size``.

    Examples:
        >>> trainer = pl.Trainer(devices=8, callbacks=[BNSpan(256)])  # per-device batch 64: groups of 4 ranks  # doctest: +SKIP
    """

    def __init__(self, span: int) -> None:
        positive_int("bn_span", span, minimum=2, hint="the number of images BN normalises over, e.g. 32")
        self.span = span

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        per_device_batch = getattr(trainer.datamodule, "train_batch_size", None)
        if per_device_batch is None:
            raise ValueError("BNSpan needs the per-device batch: use a datamodule with train_batch_size")
        topology = getattr(trainer.strategy, "topology", None)  # the hier_* strategies' node layout
        ranks_per_node = topology.ranks_per_node if topology is not None else trainer.world_size // trainer.num_nodes
        ranks = apply_bn_span(pl_module, self.span, per_device_batch, ranks_per_node)
        rank_zero_info(f"BNSpan: BN normalises {self.span} images ({ranks} rank(s) per group)")
