"""Predicted step time and weak-scaling efficiency, ``step(1 GPU) / step(P GPUs)``, from 1 GPU upwards.

A step is forward + backward + the communication the fusion plan cannot hide (Jia et al. 2018).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_fastscale.planner.cost_model import CommParams, Topology, allreduce_time
from lightning_fastscale.planner.fusion import FusionPlan, ddp_buckets, plan_fusion, simulate
from lightning_fastscale.planner.profile import GradientProfile
from lightning_fastscale.strategies.options import MB, CommSetting, check_algorithm


def allreduce_cost(
    algorithm: str, topology: Topology, params: CommParams, setting: CommSetting = CommSetting(),
    grad_element_bytes: int = 4,
):
    """A vectorised cost function for the fusion planner: bucket bytes (as held) -> seconds, under ``setting``."""
    algorithm = check_algorithm(algorithm)
    chunk_numel = setting.chunk_numel(topology.num_nodes, grad_element_bytes)

    def cost(nbytes: np.ndarray) -> np.ndarray:
        return allreduce_time(algorithm, np.asarray(nbytes, dtype=float) / grad_element_bytes,
                              topology, params, setting.wire_dtype, setting.topk_ratio, chunk_numel)
    return cost


@dataclass(frozen=True)
class StepPrediction:
    """One (GPU count, algorithm) point of the prediction."""

    gpus: int
    nodes: int
    algorithm: str
    allreduce_s: float
    plan: FusionPlan
    step_s: float
    compute_s: float

    @property
    def efficiency(self) -> float:
        """Scaling efficiency against one GPU (weak scaling)."""
        return self.compute_s / self.step_s

    def as_dict(self) -> dict:
        """JSON-friendly summary."""
        return {
            "gpus": self.gpus, "nodes": self.nodes, "algorithm": self.algorithm,
            "allreduce_s": self.allreduce_s, "step_s": self.step_s, "compute_s": self.compute_s,
            "exposed_comm_s": self.plan.exposed_s, "efficiency": self.efficiency,
            "num_buckets": self.plan.num_buckets,
        }


def topology_for(gpus: int, ranks_per_node: int) -> Topology:
    """Topology of ``gpus`` ranks: one partial node below ``ranks_per_node``, else full nodes."""
    if gpus <= ranks_per_node:
        return Topology(1, gpus)
    return Topology.from_world(gpus, ranks_per_node)


def predict_step(
    profile: GradientProfile, gpus: int, ranks_per_node: int, params: CommParams, algorithm: str,
    setting: CommSetting = CommSetting(), fusion: str = "auto",
) -> StepPrediction:
    """Predicted step on ``gpus`` ranks with ``algorithm``; ``fusion``: ``"auto"``, ``"two"``, ``"single"`` or ``"ddp25"``."""
    topology = topology_for(gpus, ranks_per_node)
    cost = allreduce_cost(algorithm, topology, params, setting)
    grad, back = profile.grad_bytes, profile.backward_s
    if fusion in ("auto", "two"):
        plan = plan_fusion(grad, back, cost, max_buckets=2 if fusion == "two" else None)
    elif fusion == "single":
        plan = simulate([len(grad)], grad, back, cost)
    elif fusion == "ddp25":
        plan = simulate(ddp_buckets(grad, [25 * MB]), grad, back, cost)
    else:
        raise ValueError(f"fusion={fusion!r} must be one of 'auto', 'two', 'single', 'ddp25'")
    compute = profile.forward_s + profile.backward_total_s
    whole = float(cost(np.asarray([float(sum(grad))]))[0])
    return StepPrediction(gpus, topology.num_nodes, algorithm, whole, plan, compute + plan.exposed_s, compute)


def default_gpu_counts(ranks_per_node: int, up_to: int = 4096) -> list[int]:
    """1 GPU, one full node, then twice as many nodes each time, up to ``up_to`` GPUs."""
    counts, nodes = [1], 1
    while nodes * ranks_per_node <= up_to:
        counts.append(nodes * ranks_per_node)
        nodes *= 2
    return sorted(set(counts))


def scaling_curve(
    profile: GradientProfile, gpu_counts: Sequence[int], ranks_per_node: int, params: CommParams,
    setting: CommSetting = CommSetting(), fusion: str = "auto",
) -> list[StepPrediction]:
    """`predict_step` for every GPU count and each of ``setting.candidates``."""
    return [predict_step(profile, g, ranks_per_node, params, a, setting, fusion)
            for g in gpu_counts for a in setting.candidates]
