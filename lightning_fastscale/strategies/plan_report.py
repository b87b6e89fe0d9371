"""What the strategy reports about its run: the hook's name, the plan as hyper-parameters and as one log line."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_fastscale.strategies.comm_hooks import HOOKS
from lightning_fastscale.strategies.options import MB, resolve_chunk_mb
from lightning_fastscale.strategies.topology import Topology
from lightning_fastscale.strategies.user_hooks import UserHook


def hook_name(algorithm: str, user_hook: UserHook, ddp_allreduce: bool) -> str | None:
    """Name of the hook DDP runs: the user's hook, the strategy's for ``algorithm``, or ``None`` for DDP's own all-reduce.

    Examples:
        >>> hook_name("torus2d", UserHook(), ddp_allreduce=False)
        'torus2d_hook'
        >>> hook_name("hier", UserHook(), ddp_allreduce=True) is None
        True
    """
    if user_hook.hook is not None:
        return user_hook.name
    if ddp_allreduce:
        return None
    hook = HOOKS[algorithm]
    return getattr(hook, "__name__", repr(hook))


def algorithm_label(algorithm: str | None, user_hook: UserHook, num_nodes: int) -> str | None:
    """``algorithm``, or the user's hook and where it runs (the whole all-reduce on one node, the inter-node stage on several)."""
    if user_hook.hook is None:
        return algorithm
    return user_hook.name if num_nodes == 1 else f"hier (inter-node stage: {user_hook.name})"


def algorithm_note(requested: str, algorithm: str | None, topology: Topology, ddp_allreduce: bool) -> str | None:
    """Why the run's all-reduce is not the ``requested`` algorithm as such (``None`` where it is).

    Examples:
        >>> algorithm_note("hier", "flat", Topology(1, 4), ddp_allreduce=True)
        "algorithm='hier' runs as DDP's own flat all-reduce: one node, fp32, no compression"
        >>> algorithm_note("torus2d", "torus2d", Topology(4, 1), ddp_allreduce=False)
        "algorithm='torus2d' runs as one all-reduce across nodes: one rank per node"
    """
    if requested in ("auto", "flat") or algorithm is None:
        return None  # auto: plain_ddp_reason says why the planner chose as it did
    if ddp_allreduce and topology.num_nodes == 1:
        return f"algorithm={requested!r} runs as DDP's own flat all-reduce: one node, fp32, no compression"
    if topology.num_nodes == 1:
        return f"algorithm={requested!r} runs as one all-reduce inside the node: one node"
    if topology.ranks_per_node == 1:
        return f"algorithm={requested!r} runs as one all-reduce across nodes: one rank per node"
    return None


def plan_summary(
    *,
    topology: Topology,
    requested_algorithm: str,
    algorithm: str | None,
    user_hook: UserHook,
    hook: str | None,
    backend: str | None,
    wire_dtype: str,
    compression: str | None,
    topk_ratio: float,
    gradient_bytes: int,
    fusion_plan: Sequence[float],
    pipeline_chunk_mb: float | str | None,
    plain_ddp_reason: str | None = None,
) -> dict[str, Any]:
    """Topology, algorithm, wire dtype and fusion plan of a run, as ``strategy/...`` hyper-parameters.

    Examples:
        >>> summary = plan_summary(topology=Topology(2, 4), requested_algorithm="hier", algorithm="hier", user_hook=UserHook(),
        ...                        hook="hier_hook", backend="gloo", wire_dtype="fp16", compression=None,
        ...                        topk_ratio=0.01, gradient_bytes=3 * MB, fusion_plan=[0.0001234, 25],
        ...                        pipeline_chunk_mb="auto")
        >>> summary["strategy/fusion_plan"], summary["strategy/pipeline_chunk_mb"]
        ([0.000123, 25.0], 4.0)
    """
    why = {} if plain_ddp_reason is None else {"strategy/plain_ddp_reason": plain_ddp_reason}
    note = None if user_hook.hook is not None else algorithm_note(requested_algorithm, algorithm, topology, hook is None)
    if note is not None:
        why["strategy/algorithm_note"] = note
    return {
        "strategy/algorithm": algorithm_label(algorithm, user_hook, topology.num_nodes),
        "strategy/num_nodes": topology.num_nodes,
        "strategy/ranks_per_node": topology.ranks_per_node,
        "strategy/world_size": topology.world_size,
        "strategy/backend": backend,
        "strategy/wire_dtype": wire_dtype,
        "strategy/compression": f"topk:{topk_ratio}" if compression else "none",
        "strategy/gradient_mb": round(gradient_bytes / MB, 3),
        # three significant digits: a cap of a few hundred bytes must not read as 0.0
        "strategy/fusion_plan": [float(f"{float(c):.3g}") for c in fusion_plan],
        "strategy/pipeline_chunk_mb": resolve_chunk_mb(pipeline_chunk_mb, topology.num_nodes),
        "strategy/comm_hook": hook or "none (DDP's own all-reduce)",
        **why,
    }


def plan_message(owner: str, summary: dict[str, Any]) -> str:
    """``summary`` as one line ``owner: key=value, ...``, for rank-zero info at setup."""
    return f"{owner}: " + ", ".join(f"{key.split('/')[1]}={value}" for key, value in summary.items())
