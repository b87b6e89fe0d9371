"""Predicted cost of batch-norm statistics shared over a span of images (``model.bn_span``; Goyal et al. 2017).

A span wider than one device makes every BN layer all-reduce its sum, sum of squares and count
(2C + 1 values) in forward and again in backward, on the critical path: a span across nodes
waits on the slow link twice per layer per step. More in ``docs/planner.md`` ("BN span").
"""
from __future__ import annotations

from torch import nn

from lightning_fastscale.callbacks.bn_span import bn_span_plan
from lightning_fastscale.callbacks.ghost_batch_norm import _PLAIN_BATCH_NORMS
from lightning_fastscale.planner.cost_model import CommParams, allreduce_time
from lightning_fastscale.strategies.topology import Topology


def bn_channels(model: nn.Module) -> list[int]:
    """Channels of each BN layer that a BN span converts (the plain ``BatchNorm1d/2d/3d``), in module order."""
    return [m.num_features for m in model.modules() if type(m) in _PLAIN_BATCH_NORMS]


def bn_span_cost(span: int, per_device_batch: int, topology: Topology, params: CommParams,
                 channels: list[int]) -> dict:
    """Ranks per BN group, the nodes a group spans, and the seconds per step its all-reduces add.

    A group across nodes is also priced against the widest span inside a node.

    ``ValueError`` (from ``bn_span_plan``) names the nearest spans that work.

    Examples:
        >>> params = CommParams(alpha_intra=5e-6, beta_intra=1e-10, alpha_inter=5e-5, beta_inter=1e-9)
        >>> inside = bn_span_cost(64, 32, Topology(2, 2), params, [64, 128])
        >>> across = bn_span_cost(128, 32, Topology(2, 2), params, [64, 128])
        >>> inside["group_nodes"], across["group_nodes"], across["sync_s"] > 5 * inside["sync_s"]
        (1, 2, True)
    """
    ranks = bn_span_plan(span, per_device_batch, topology.world_size, topology.ranks_per_node)
    per_node = topology.ranks_per_node
    out = {"span": span, "ranks_per_group": ranks, "group_nodes": max(1, ranks // per_node), "bn_layers": len(channels),
           "allreduces_per_step": 2 * len(channels) if ranks > 1 else 0, "sync_s": _sync_s(ranks, per_node, params, channels),
           "widest_span_in_node": per_device_batch * min(per_node, topology.world_size)}
    if out["group_nodes"] > 1:
        out["widest_span_in_node_sync_s"] = _sync_s(per_node, per_node, params, channels)
    return out


def _sync_s(ranks: int, per_node: int, params: CommParams, channels: list[int]) -> float:
    if ranks == 1:
        return 0.0
    group = Topology(1, ranks) if ranks <= per_node else Topology(ranks // per_node, per_node)
    # forward sums the statistics, backward sums their gradients: two all-reduces per layer
    return sum(2 * float(allreduce_time("flat", 2 * c + 1, group, params)) for c in channels)
