"""Top-k error-feedback residuals (one file per rank, tagged with its layout) saved beside a checkpoint
and restored on resume; ``docs/strategy.md``.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_fastscale.strategies.comm_hooks import HierarchicalHookState
from lightning_fastscale.strategies.topology import Topology

SavedResiduals = tuple[str, "dict[str, Any] | None"]
"""A rank's residual file as loaded: (path, its content or ``None`` where the file was missing)."""


def residual_path(checkpoint_path: Any, rank: int) -> str:
    """Where rank ``rank`` keeps its residuals for ``checkpoint_path``.

    Examples:
        >>> residual_path("last.ckpt", 3)
        'last.ckpt.topk-residuals-rank3'
    """
    return f"{checkpoint_path}.topk-residuals-rank{rank}"


def comm_layout(topology: Topology, algorithm: str | None, topk_ratio: float, chunk_numel: int | None,
                rank: int) -> dict[str, Any]:
    """What residuals belong to: world size, ranks per node, algorithm, top-k ratio, chunking and rank."""
    return {
        "world_size": topology.world_size, "ranks_per_node": topology.ranks_per_node,
        "algorithm": algorithm, "topk_ratio": topk_ratio,
        "chunk_numel": chunk_numel, "rank": rank,
    }


def residual_state(hook_state: HierarchicalHookState, layout: dict[str, Any]) -> dict[str, Any]:
    """The file content of ``hook_state``'s residuals (on the CPU) under ``layout``, with the hook's iteration."""
    assert hook_state.topk is not None
    return {"layout": layout, "iteration": hook_state.iteration,
            "errors": {key: t.detach().cpu() for key, t in hook_state.topk.errors.items()}}


def restore_residuals(hook_state: HierarchicalHookState, saved: SavedResiduals, layout: dict[str, Any],
                      rank: int, device: torch.device) -> None:
    """Put the ``saved`` residuals and iteration into ``hook_state`` (on ``device``) if they belong to ``layout``; else warn."""
    assert hook_state.topk is not None
    path, state = saved
    if state is None:
        warnings.warn(f"no top-k residuals for rank {rank} at {path}: error feedback restarts "
                      "from zero, so this run will not equal an uninterrupted one.", stacklevel=2)
        return
    then = state.get("layout", {})
    differ = {k: (then.get(k), v) for k, v in layout.items() if then.get(k) != v}
    if differ:
        what = ", ".join(f"{k} {a!r} in the checkpoint vs {b!r} now" for k, (a, b) in differ.items())
        warnings.warn(f"top-k residuals at {path} belong to another layout ({what}): error feedback restarts "
                      "from zero.", stacklevel=2)
        return
    hook_state.topk.errors = {key: t.to(device) for key, t in state["errors"].items()}
    hook_state.topk.restored = set(state["errors"])
    hook_state.iteration = int(state["iteration"])
