"""Top-k error-feedback residuals saved beside a checkpoint and restored on resume.

With ``compression="topk"`` every rank keeps what it did not send (Tencent Cloud 2020's error
feedback); these residuals differ per rank, so each rank writes its own file next to the
checkpoint, tagged with the communication layout they belong to. A resume on the same layout
restores them (and the hook's iteration), so it equals the uninterrupted run. On another world
size, where each residual covers whole buckets (``hier``, or one rank per node), they are
re-split over the new node leaders so that their sum, what error feedback still owes the model,
is kept; otherwise, or without the files, error feedback restarts from zero with a warning.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fastscale.strategies.comm_hooks import HierarchicalHookState
from lightning_fastscale.strategies.topology import Topology

_RESPLIT_KEYS = frozenset({"world_size", "ranks_per_node", "chunk_numel", "rank"})
"""Layout fields that may change across a re-split (the others must match)."""


def residual_path(checkpoint_path: Any, rank: int) -> str:
    """Where rank ``rank`` keeps its residuals for ``checkpoint_path``.

    Examples:
        >>> residual_path("last.ckpt", 3)
        'last.ckpt.topk-residuals-rank3'
    """
    return f"{checkpoint_path}.topk-residuals-rank{rank}"


@dataclass(frozen=True)
class SavedResiduals:
    """The residual files beside ``checkpoint_path``, read on demand with ``load`` (the checkpoint IO's)."""

    checkpoint_path: str
    load: Callable[[str], dict[str, Any]]

    def of_rank(self, rank: int) -> tuple[str, dict[str, Any] | None]:
        """Rank ``rank``'s file: (path, its content or ``None`` where it is missing)."""
        path = residual_path(self.checkpoint_path, rank)
        try:
            return path, self.load(path)
        except FileNotFoundError:
            return path, None


def comm_layout(topology: Topology, algorithm: str | None, topk_ratio: float, chunk_numel: int | None,
                rank: int, topk_momentum: float = 0.0) -> dict[str, Any]:
    """What residuals belong to: world size, ranks per node, algorithm, top-k ratio and momentum, chunking, rank."""
    layout = {
        "world_size": topology.world_size, "ranks_per_node": topology.ranks_per_node,
        "algorithm": algorithm, "topk_ratio": topk_ratio,
        "chunk_numel": chunk_numel, "rank": rank,
    }
    if topk_momentum:  # absent otherwise, as in files written before momentum correction
        layout["topk_momentum"] = topk_momentum
    return layout


def residual_state(hook_state: HierarchicalHookState, layout: dict[str, Any]) -> dict[str, Any]:
    """The file content of ``hook_state``'s residuals (on the CPU) under ``layout``, with the hook's iteration."""
    assert hook_state.topk is not None
    state = {"layout": layout, "iteration": hook_state.iteration,
             "errors": {key: t.detach().cpu() for key, t in hook_state.topk.errors.items()}}
    if hook_state.topk.momentum:
        state["velocities"] = {key: t.detach().cpu() for key, t in hook_state.topk.velocities.items()}
    return state


def resplit_residuals(saved: list[dict[Hashable, Tensor]], holder: int, holders: int,
                      chunk_numel: int | None) -> dict[Hashable, Tensor]:
    """New node leader ``holder``'s residuals out of the old leaders' ``saved`` (in rank order).

    Keys are ``(bucket, chunk)``: each bucket's chunks are joined, old leader ``j``'s go to new
    leader ``j % holders`` (summed), then cut into ``chunk_numel`` chunks again. Over the new
    leaders the sum per bucket is the old one, and one leader's residual passes through unchanged.

    Examples:
        >>> old = [{(0, 0): torch.tensor([1., 2.])}, {(0, 0): torch.tensor([3., 4.])}, {(0, 0): torch.tensor([5., 6.])}]
        >>> [resplit_residuals(old, h, 2, 1) for h in range(2)]
        [{(0, 0): tensor([6.]), (0, 1): tensor([8.])}, {(0, 0): tensor([3.]), (0, 1): tensor([4.])}]
    """
    whole: dict[Hashable, Tensor] = {}
    for errors in saved[holder::holders]:
        for bucket in {key[0] for key in errors}:
            joined = torch.cat([errors[key] for key in sorted(k for k in errors if k[0] == bucket)])
            whole[bucket] = whole[bucket] + joined if bucket in whole else joined.clone()
    return {(bucket, i): piece.clone() for bucket, t in whole.items()
            for i, piece in enumerate(t.split(chunk_numel) if chunk_numel else [t])}


def _whole_buckets(layout: dict[str, Any]) -> bool:
    """Whether a leader's residual covers whole buckets (the torus keeps one shard per local rank)."""
    return layout.get("algorithm") == "hier" or layout.get("ranks_per_node") == 1


def _restart(path: str, why: str) -> None:
    warnings.warn(f"top-k residuals at {path} {why}: error feedback restarts from zero.", stacklevel=3)


def restore_residuals(hook_state: HierarchicalHookState, saved: SavedResiduals, layout: dict[str, Any],
                      device: torch.device) -> None:
    """Put the ``saved`` residuals (with momentum correction's velocities) and iteration that belong to
    ``layout`` into ``hook_state``; else warn why not.

    On another world size they are re-split ([`resplit_residuals`][lightning_fastscale.strategies.topk_residuals.resplit_residuals]);
    every rank takes the hook's iteration, so all start compressing on the same step.
    ``device``: where the hook keeps residuals (the host on gloo, which works on host copies of
    the buckets, CUDA ones too).
    """
    assert hook_state.topk is not None
    rank = layout["rank"]
    own_path, own = saved.of_rank(rank)
    # a rank the old run did not have: rank 0's file says what the old layout was
    path, state = (own_path, own) if own is not None or rank == 0 else saved.of_rank(0)
    then = {} if state is None else state["layout"]
    keys = list(layout) + [k for k in then if k not in layout]  # a key only one side has differs too
    differ = {k: (then.get(k), layout.get(k)) for k in keys if k != "rank" and then.get(k) != layout.get(k)}
    if state is None or own is None and not differ:
        warnings.warn(f"no top-k residuals for rank {rank} at {own_path}: error feedback restarts "
                      "from zero, so this run will not equal an uninterrupted one.", stacklevel=2)
        return
    what = f"belong to another layout ({', '.join(f'{k} {a!r} in the checkpoint vs {b!r} now' for k, (a, b) in differ.items())})"
    if not differ:
        errors, velocities = state["errors"], state.get("velocities", {})
    elif not set(differ) <= _RESPLIT_KEYS or not (_whole_buckets(then) and _whole_buckets(layout)):
        return _restart(path, what)
    elif layout["world_size"] == layout["ranks_per_node"]:
        return _restart(path, f"{what}, and one node has no inter-node stage to owe them to")
    else:
        old = [saved.of_rank(r) for r in range(0, then["world_size"], then["ranks_per_node"])]
        lost = [p for p, s in old if s is None]
        if lost:
            return _restart(path, f"{what} and {lost[0]} is missing")
        rpn = layout["ranks_per_node"]
        errors, velocities = {}, {}
        if rank % rpn == 0:  # the velocities of momentum correction are re-split as the residuals are
            errors, velocities = (resplit_residuals([s.get(name, {}) for _, s in old], rank // rpn,
                                                    layout["world_size"] // rpn, layout["chunk_numel"])
                                  for name in ("errors", "velocities"))
    hook_state.topk.errors = {key: t.to(device) for key, t in errors.items()}
    hook_state.topk.velocities = {key: t.to(device) for key, t in velocities.items()}
    hook_state.topk.restored = set(errors)
    hook_state.iteration = int(state["iteration"])
