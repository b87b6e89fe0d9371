"""The hierarchical all-reduce strategy's options, checked together when the strategy is built."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_fastscale._validation import positive_number
from lightning_fastscale.strategies.allreduce import TopKErrorFeedback
from lightning_fastscale.strategies.options import check_algorithm, chunk_numel_for, wire_torch_dtype
from lightning_fastscale.strategies.planning import CommPlanner
from lightning_fastscale.strategies.user_hooks import POST_LOCAL_SGD, UserHook


def check_strategy_options(
    *,
    algorithm: str,
    ranks_per_node: int | None,
    wire_dtype: str,
    bucket_cap_mb: float | None,
    fusion_plan: Sequence[float] | None,
    two_segment_split: int | None,
    compression: str | None,
    topk_ratio: float,
    topk_start_iter: int,
    pipeline_chunk_mb: float | str | None,
    planner: Any,
    user_hook: UserHook,
    model_averaging_period: Any = None,
    topk_momentum: float = 0.0,
) -> None:
    """Raise naming the argument when an option of the strategy, or a combination of them, is invalid.

    Examples:
        >>> options = dict(algorithm="hier", ranks_per_node=None, wire_dtype="fp16", bucket_cap_mb=None,
        ...                fusion_plan=None, two_segment_split=None, compression=None, topk_ratio=0.01,
        ...                topk_start_iter=2, pipeline_chunk_mb="auto", planner=None, user_hook=UserHook())
        >>> check_strategy_options(**options)
        >>> check_strategy_options(**{**options, "bucket_cap_mb": 5, "fusion_plan": [1.0]})
        Traceback (most recent call last):
        ...
        ValueError: set only one of bucket_cap_mb, fusion_plan and two_segment_split.
    """
    check_algorithm(algorithm, extra=("auto",))
    wire_torch_dtype(wire_dtype)
    if planner is not None and not isinstance(planner, CommPlanner):
        raise TypeError(
            f"planner={planner!r} has no plan_comm(request) method: pass e.g. "
            "lightning_fastscale.planner.CostModelPlanner(...) or any CommPlanner."
        )
    if compression not in (None, "topk"):
        raise ValueError(f"compression={compression!r}: choose None or 'topk'.")
    if compression == "topk" and algorithm == "flat":
        raise ValueError(
            "compression='topk' compresses the inter-node stage, which algorithm='flat' does not "
            "have: use algorithm='hier' or 'torus2d'."
        )
    if compression == "topk":
        TopKErrorFeedback(topk_ratio, topk_momentum)  # validates the ratio and the momentum
    elif topk_momentum:
        raise ValueError(f"topk_momentum={topk_momentum} corrects top-k's error feedback: set compression='topk' "
                         "too, or leave topk_momentum=0 and the momentum in the optimizer.")
    if topk_start_iter < 1:
        raise ValueError(f"topk_start_iter={topk_start_iter} must be >= 1 (DDP rebuilds buckets after iteration 0).")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 (or None to detect it).")
    if bucket_cap_mb is not None:
        positive_number("bucket_cap_mb", bucket_cap_mb, hint="DDP's bucket size in MB (None: 25)")
    if sum(x is not None for x in (bucket_cap_mb, fusion_plan, two_segment_split)) > 1:
        raise ValueError("set only one of bucket_cap_mb, fusion_plan and two_segment_split.")
    if fusion_plan is not None and (not fusion_plan or min(fusion_plan) <= 0):
        raise ValueError(f"fusion_plan={list(fusion_plan)}: bucket caps must be a non-empty list of positive MB.")
    chunk_numel_for(pipeline_chunk_mb)  # validates it
    user_hook.check(algorithm, wire_dtype, compression)
    if model_averaging_period is not None:
        raise ValueError(f"model_averaging_period= {POST_LOCAL_SGD}")


def check_optimizers_for_topk_momentum(topk_momentum: float, optimizers: Sequence[Any]) -> None:
    """Raise where an optimizer keeps a momentum that ``topk_momentum`` > 0 has moved into the top-k stage.

    With momentum correction (Lin et al. 2018) the gradient reaching the optimizer already holds
    the momentum; a momentum in the optimizer would apply it twice.

    Examples:
        >>> import torch
        >>> check_optimizers_for_topk_momentum(0.9, [torch.optim.SGD([torch.zeros(1)], lr=0.1)])
        >>> check_optimizers_for_topk_momentum(0.9, [torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=0.9)])
        Traceback (most recent call last):
        ...
        ValueError: topk_momentum=0.9 moves the momentum into the top-k stage (momentum correction), but SGD has momentum=0.9 in param group 0: set the optimizer's momentum to 0 (e.g. SGD(..., momentum=0)), or topk_momentum=0.
    """
    if not topk_momentum:
        return
    for optimizer in optimizers:
        held = optimizer_momentum(optimizer)
        if held is not None:
            raise ValueError(
                f"topk_momentum={topk_momentum} moves the momentum into the top-k stage (momentum correction), "
                f"but {type(optimizer).__name__} has {held[1]} in param group {held[0]}: set the optimizer's "
                "momentum to 0 (e.g. SGD(..., momentum=0)), or topk_momentum=0."
            )


def check_topk_momentum_stage(topk_momentum: float, num_nodes: int, algorithm: str | None,
                              plain_ddp_reason: str | None = None) -> None:
    """Raise where ``topk_momentum`` > 0 would be lost: no top-k stage between nodes (one node, a flat all-reduce).

    Examples:
        >>> check_topk_momentum_stage(0.9, 2, "hier")
        >>> check_topk_momentum_stage(0.9, 1, "hier")
        Traceback (most recent call last):
        ...
        ValueError: topk_momentum=0.9 moves the optimizer's momentum into the top-k stage between nodes, which this run does not have (one node): set topk_momentum=0 and keep the momentum in the optimizer.
    """
    if not topk_momentum or (num_nodes > 1 and algorithm != "flat"):
        return
    why = "one node" if num_nodes == 1 else plain_ddp_reason or "a flat all-reduce"
    raise ValueError(
        f"topk_momentum={topk_momentum} moves the optimizer's momentum into the top-k stage between nodes, "
        f"which this run does not have ({why}): set topk_momentum=0 and keep the momentum in the optimizer."
    )


def optimizer_momentum(optimizer: Any) -> tuple[int, str] | None:
    """The first param group of ``optimizer`` that holds a momentum, and which (``momentum=`` or Adam's ``betas=``)."""
    for index, group in enumerate(optimizer.param_groups):
        momentum, betas = group.get("momentum", 0.0), group.get("betas")
        if momentum:
            return index, f"momentum={momentum}"
        if betas is not None and betas[0]:
            return index, f"betas={tuple(betas)}"
    return None
