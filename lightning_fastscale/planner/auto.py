"""One call for a strategy's ``algorithm="auto"`` and fusion ``"auto"``: algorithm + buckets.

For each candidate algorithm the fusion plan is optimised (:func:`plan_fusion`) under that
algorithm's cost, and the algorithm whose plan ends communication earliest wins (Jia et al.
2018 choose segments from such a model; the choice of algorithm follows the same rule).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_fastscale.planner.cost_model import ALGORITHMS, CommParams, Topology
from lightning_fastscale.planner.fusion import FusionPlan, plan_fusion
from lightning_fastscale.planner.profile import GradientProfile, profile_module
from lightning_fastscale.planner.scaling import allreduce_cost

__all__ = ["AutoPlan", "auto_plan", "module_profile"]


@dataclass(frozen=True)
class AutoPlan:
    """The chosen algorithm, its fusion plan, DDP keyword arguments and every candidate's plan."""

    algorithm: str
    plan: FusionPlan
    ddp_kwargs: dict
    candidates: dict[str, FusionPlan]

    def summary(self) -> dict:
        """JSON-friendly summary for logging (rank 0 logs it with the topology)."""
        return {
            "algorithm": self.algorithm,
            "plan": self.plan.as_dict(),
            "ddp_kwargs": self.ddp_kwargs,
            "predicted_finish_s": {a: p.finish_s for a, p in self.candidates.items()},
        }


def module_profile(
    module: nn.Module,
    backward_time_s: float | None = None,
    example_input: torch.Tensor | None = None,
    sustained_tflops: float | None = None,
) -> GradientProfile:
    """Gradient profile of a live module, for planning inside a strategy.

    With ``example_input`` and ``sustained_tflops`` the backward time of each layer comes
    from its FLOPs (:func:`profile_module`, one forward pass without autograd). Otherwise
    ``backward_time_s`` (e.g. measured over the first steps) is spread over the gradients in
    proportion to their size, a cruder but measurement-free estimate.
    """
    if example_input is not None and sustained_tflops is not None:
        return profile_module(module, example_input, sustained_tflops)
    if backward_time_s is None or backward_time_s < 0:
        raise ValueError(
            "module_profile needs backward_time_s >= 0, or example_input and sustained_tflops"
        )
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad][::-1]
    sizes = [p.numel() * p.element_size() for _, p in params]
    total = float(sum(sizes))
    times = [backward_time_s * s / total for s in sizes]
    return GradientProfile(tuple(n for n, _ in params), tuple(sizes), tuple(times), backward_time_s / 2)


def auto_plan(
    profile: GradientProfile,
    topology: Topology,
    params: CommParams,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    algorithms: Sequence[str] = ALGORITHMS,
    max_buckets: int | None = None,
) -> AutoPlan:
    """Choose the algorithm and the buckets with the earliest predicted end of communication.

    Ties go to the earlier entry of ``algorithms`` (ring, hier, torus2d: the simpler one).
    """
    if topology.nodes == 1:
        algorithms = ("ring",)
    candidates = {
        a: plan_fusion(profile.grad_bytes, profile.backward_s,
                       allreduce_cost(a, topology, params, wire_dtype, topk_ratio), max_buckets)
        for a in algorithms
    }
    best = min(algorithms, key=lambda a: (round(candidates[a].finish_s, 12), algorithms.index(a)))
    plan = candidates[best]
    return AutoPlan(best, plan, plan.ddp_kwargs(), candidates)
