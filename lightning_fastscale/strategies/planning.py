"""Where a run's algorithm and fusion plan come from: the user's settings, then a `CommPlanner`
asked once with a `PlanRequest` (``docs/strategy.md``, "Planner plug point").
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

from torch import nn

from lightning_fastscale.strategies.options import MB, CommSetting, check_algorithm
from lightning_fastscale.strategies.topology import Topology

__all__ = ["CommPlan", "CommPlanner", "NodeCountPlanner", "PlanRequest", "explicit_fusion_plan", "gradient_bytes",
           "resolve_comm_plan", "runs_ddp_allreduce", "two_segment_fusion_plan"]


@dataclass(frozen=True)
class PlanRequest:
    """What the strategy will send, for the planner to price: ``module`` on ``topology`` under ``setting``."""

    module: nn.Module
    topology: Topology
    setting: CommSetting = CommSetting()
    timeout: timedelta | None = None


@dataclass(frozen=True)
class CommPlan:
    """A planner's answer: the algorithm, DDP bucket caps in MB (``None``: uniform), why plain DDP if kept."""

    algorithm: str
    fusion_plan: tuple[float, ...] | None = None
    plain_ddp_reason: str | None = None

    def __post_init__(self) -> None:
        check_algorithm(self.algorithm, "CommPlan.algorithm")
        caps = self.fusion_plan
        if caps is not None and (not caps or min(caps) <= 0):
            raise ValueError(f"fusion_plan={list(caps)}: bucket caps must be a non-empty list of positive MB.")


@runtime_checkable
class CommPlanner(Protocol):
    """Anything the strategy can ask for a `CommPlan` (``planner=`` of the strategies)."""

    def plan_comm(self, request: PlanRequest) -> CommPlan:
        """The algorithm and buckets for ``request``."""
        ...


class NodeCountPlanner:
    """``hier`` across nodes, ``flat`` inside one; DDP's buckets. What ``algorithm="auto"`` uses without a planner.

    Examples:
        >>> from torch import nn
        >>> request = PlanRequest(nn.Linear(2, 2), Topology(num_nodes=2, ranks_per_node=4))
        >>> NodeCountPlanner().plan_comm(request)
        CommPlan(algorithm='hier', fusion_plan=None, plain_ddp_reason=None)
    """

    def plan_comm(self, request: PlanRequest) -> CommPlan:
        """``hier`` on several nodes, ``flat`` on one (restricted to ``request.setting.algorithms`` when given)."""
        preferred = "hier" if request.topology.num_nodes > 1 else "flat"
        candidates = request.setting.candidates
        return CommPlan(preferred if preferred in candidates else candidates[0])


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s trainable parameters: what one all-reduce of its gradients moves in their dtype."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def two_segment_fusion_plan(module: nn.Module, split: int) -> list[float]:
    """DDP bucket caps in MB of two buckets split before trainable parameter ``split`` (Jia et al. 2018).

    Examples:
        Two layers of 1 MiB of fp32 weights each, split between them:

        >>> two_segment_fusion_plan(nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False)), 1)
        [1.0, 3.0]
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not 0 < split < len(params):
        raise ValueError(
            f"two_segment_split={split} must lie between 1 and {len(params) - 1} (the model has "
            f"{len(params)} trainable parameter tensors)."
        )
    tail = sum(p.numel() * p.element_size() for p in params[split:])
    head = sum(p.numel() * p.element_size() for p in params[:split])
    # DDP closes a bucket once it reaches its cap: the tail bucket ends exactly at the split,
    # and a cap above the head size keeps the rest in one bucket.
    return [tail / MB, (head + tail) / MB + 1.0]


def explicit_fusion_plan(
    module: nn.Module, fusion_plan: Sequence[float] | None, two_segment_split: int | None
) -> list[float] | None:
    """The fusion plan the user fixed (``two_segment_split`` or ``fusion_plan``); ``None`` if neither."""
    if two_segment_split is not None:
        return two_segment_fusion_plan(module, two_segment_split)
    return None if fusion_plan is None else list(fusion_plan)


def resolve_comm_plan(
    request: PlanRequest,
    planner: CommPlanner | None,
    *,
    algorithm: str,
    fusion_plan: Sequence[float] | None = None,
    uniform_cap: bool = False,
    user_hook: bool = False,
) -> CommPlan:
    """The plan a run uses: ``algorithm`` unless ``"auto"``, ``fusion_plan`` unless ``None``; the planner fills the rest.

    Examples:
        >>> request = PlanRequest(nn.Linear(2, 2), Topology(num_nodes=2, ranks_per_node=4))
        >>> resolve_comm_plan(request, None, algorithm="auto")
        CommPlan(algorithm='hier', fusion_plan=None, plain_ddp_reason=None)
        >>> resolve_comm_plan(request, None, algorithm="torus2d", fusion_plan=[1.0, 8.0])
        CommPlan(algorithm='torus2d', fusion_plan=(1.0, 8.0), plain_ddp_reason=None)
    """
    if planner is None and algorithm == "auto":
        planner = NodeCountPlanner()
    plan = None if planner is None else planner.plan_comm(request)
    if fusion_plan is None and plan is not None and not uniform_cap:
        fusion_plan = plan.fusion_plan
    fusion = None if fusion_plan is None else tuple(fusion_plan)
    if plan is None or algorithm != "auto":
        return CommPlan(algorithm, fusion)
    return CommPlan(plan.algorithm, fusion, None if user_hook else plan.plain_ddp_reason)


def runs_ddp_allreduce(
    topology: Topology, wire_dtype: str, compression: str | None, user_hook: bool, plain_ddp_reason: str | None
) -> bool:
    """True where DDP's own all-reduce runs, without a hook: plain DDP kept, or one node in fp32 plainly.

    Examples:
        >>> runs_ddp_allreduce(Topology(1, 4), "fp32", None, False, None)
        True
        >>> runs_ddp_allreduce(Topology(1, 4), "fp16", None, False, None)
        False
    """
    one_node_plain = topology.num_nodes == 1 and wire_dtype == "fp32" and compression is None and not user_hook
    return plain_ddp_reason is not None or one_node_plain
