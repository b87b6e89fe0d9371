"""The one question the strategy asks a planner: which algorithm, which buckets.

At setup, before DDP wraps the model, the strategy hands its planner a [`PlanRequest`][lightning_fastscale.strategies.planning.PlanRequest]
(the model, the node [`Topology`][lightning_fastscale.planner.Topology] and its own
wire dtype, top-k ratio and pipeline chunk size) and gets a [`CommPlan`][lightning_fastscale.strategies.planning.CommPlan] back: the
algorithm and, optionally, DDP's bucket caps. Any object with that one method plugs in
([`CommPlanner`][lightning_fastscale.strategies.planning.CommPlanner]); the cost-model planner of [`lightning_fastscale.planner`][lightning_fastscale.planner] is one,
[`NodeCountPlanner`][lightning_fastscale.strategies.planning.NodeCountPlanner] (what ``algorithm="auto"`` uses without a planner) another. Neither
side imports the other: both speak the names of [`options`][lightning_fastscale.strategies.options].
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

from torch import nn

from lightning_fastscale.strategies.options import CommSetting, check_algorithm
from lightning_fastscale.strategies.topology import Topology

__all__ = ["CommPlan", "CommPlanner", "NodeCountPlanner", "PlanRequest"]


@dataclass(frozen=True)
class PlanRequest:
    """What the strategy will send, for the planner to price: ``module`` on ``topology`` under ``setting``.

    ``setting.algorithms``: ``None`` lets the planner choose among all of them (and answer plain
    DDP where a hook is not worth it), a fixed algorithm asks only for buckets. ``timeout``: of
    any process group the planner creates (e.g. to calibrate).
    """

    module: nn.Module
    topology: Topology
    setting: CommSetting = CommSetting()
    timeout: timedelta | None = None


@dataclass(frozen=True)
class CommPlan:
    """A planner's answer.

    ``algorithm``: one of [`ALGORITHMS`][lightning_fastscale.planner.ALGORITHMS].
    ``fusion_plan``: DDP bucket caps in MB in gradient-ready order (``bucket_cap_mb_list``);
    ``None`` keeps DDP's uniform cap. ``plain_ddp_reason``: set when plain DDP (its own flat
    all-reduce, no hook) is as good as the best plan, and says why; the strategy then installs
    no hook where the user left the algorithm to the planner.
    """

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
    """Anything the strategy can ask for a [`CommPlan`][lightning_fastscale.strategies.planning.CommPlan] (``planner=`` of the strategies)."""

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
        if preferred not in candidates:
            preferred = candidates[0]
        return CommPlan(preferred)
