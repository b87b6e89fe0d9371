"""The algorithm and fusion plan of a run, for a strategy's ``algorithm="auto"`` (Jia et al. 2018).

Each candidate's buckets are planned under its cost; the earliest end of communication wins,
plain DDP kept where it is within ``plain_ddp_tolerance`` of the best (``docs/planner.md``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import numpy as np
import torch
from torch import nn

from lightning_fastscale.planner.baseline import PLAIN_DDP_TOLERANCE
from lightning_fastscale.planner.cost_model import ALGORITHMS, CommParams, Topology
from lightning_fastscale.planner.fusion import FusionPlan, plan_fusion
from lightning_fastscale.planner.profile import GradientProfile, measure_backward_profile, profile_module
from lightning_fastscale.planner.scaling import allreduce_cost
from lightning_fastscale.strategies.options import PLAIN_DDP, CommSetting, check_algorithms
from lightning_fastscale.strategies.planning import CommPlan, PlanRequest

CALIBRATION_ATTEMPTS = 3
"""Link fits `CostModelPlanner` tries, each with 4x the previous sizes, before its error stands."""

CHUNK_CANDIDATES_MB: tuple[float | None, ...] = (None, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
"""Pipeline chunk sizes (MiB; ``None`` = unchunked) [`best_chunk_plan`][lightning_fastscale.planner.best_chunk_plan] compares."""


@dataclass(frozen=True)
class AutoPlan:
    """The chosen algorithm, its fusion plan, DDP keyword arguments and every candidate's plan.

    ``baseline``: plain DDP's plan (``None`` on one node or when not asked for); ``plain_ddp``:
    it was kept (no hook); ``reason``: why, in words.
    """

    algorithm: str
    plan: FusionPlan
    ddp_kwargs: dict
    candidates: dict[str, FusionPlan]
    baseline: FusionPlan | None = None
    plain_ddp: bool = False
    reason: str = ""

    def summary(self) -> dict:
        """JSON-friendly summary for logging (rank 0 logs it with the topology)."""
        return {
            "algorithm": self.algorithm,
            "plain_ddp": self.plain_ddp,
            "reason": self.reason,
            "plan": self.plan.as_dict(),
            "ddp_kwargs": self.ddp_kwargs,
            "predicted_finish_s": {a: p.finish_s for a, p in self.candidates.items()},
            "plain_ddp_finish_s": None if self.baseline is None else self.baseline.finish_s,
        }

    def comm_plan(self) -> CommPlan:
        """The strategy's view of this plan: algorithm, DDP bucket caps, and why plain DDP if it is kept."""
        return CommPlan(self.algorithm, tuple(self.plan.ddp_bucket_cap_mb_list()),
                        self.reason if self.plain_ddp else None)


def module_profile(
    module: nn.Module,
    backward_time_s: float | None = None,
    example_input: torch.Tensor | None = None,
    sustained_tflops: float | None = None,
) -> GradientProfile:
    """Gradient profile of a live module: per-layer FLOPs at ``sustained_tflops``, else ``backward_time_s`` by size."""
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


def _measured_on_rank0(module: nn.Module, example_input: torch.Tensor) -> GradientProfile:
    """Backward measured on every rank (SyncBatchNorm stays matched), rank 0's kept: DDP needs one bucket layout."""
    profile = measure_backward_profile(module, example_input)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        shared = [profile]
        torch.distributed.broadcast_object_list(shared, src=0)
        profile = shared[0]
    return profile


def auto_plan(
    profile: GradientProfile,
    topology: Topology,
    params: CommParams,
    setting: CommSetting = CommSetting(),
    max_buckets: int | None = None,
    *,
    plain_ddp_tolerance: float | None = None,
) -> AutoPlan:
    """Choose the algorithm and the buckets with the earliest predicted end of communication.

    Ties go to the simpler algorithm; on one node only ``flat``. ``plain_ddp_tolerance`` (e.g.
    0.05; ``None``: off) keeps plain DDP where its plan ends within that fraction of the best.
    """
    if plain_ddp_tolerance is not None and not plain_ddp_tolerance >= 0:
        raise ValueError(f"plain_ddp_tolerance={plain_ddp_tolerance!r} must be a fraction >= 0 (0.05 is 5 %) or None")
    algorithms = ("flat",) if topology.num_nodes == 1 else setting.candidates

    def planned(algorithm: str, how: CommSetting) -> FusionPlan:
        cost = allreduce_cost(algorithm, topology, params, how)
        return plan_fusion(profile.grad_bytes, profile.backward_s, cost, max_buckets)

    candidates = {a: planned(a, setting) for a in algorithms}
    best = min(algorithms, key=lambda a: (round(candidates[a].finish_s, 12), algorithms.index(a)))
    plan = candidates[best]
    if plain_ddp_tolerance is None or topology.num_nodes == 1:
        return AutoPlan(best, plan, plan.ddp_kwargs(), candidates)
    baseline = planned("flat", PLAIN_DDP)
    fastest = min(plan.finish_s, baseline.finish_s)
    source = "measured" if params.flat_measured is not None and params.flat_measured.applies_to(topology) else "modelled"
    if baseline.finish_s <= (1 + plain_ddp_tolerance) * fastest:
        reason = (f"plain DDP ({params.backend} flat all-reduce, {source}) ends communication at "
                  f"{baseline.finish_s * 1e3:.3f} ms, within {plain_ddp_tolerance:.0%} of the best "
                  f"({best}: {plan.finish_s * 1e3:.3f} ms): no communication hook")
        return AutoPlan("flat", baseline, baseline.ddp_kwargs(), candidates, baseline, True, reason)
    reason = (f"{best} ends communication at {plan.finish_s * 1e3:.3f} ms, "
              f"{baseline.finish_s / plan.finish_s:.2f}x sooner than plain DDP ({params.backend} flat all-reduce, "
              f"{source}: {baseline.finish_s * 1e3:.3f} ms)")
    return AutoPlan(best, plan, plan.ddp_kwargs(), candidates, baseline, False, reason)


def best_chunk_plan(
    profile: GradientProfile,
    topology: Topology,
    params: CommParams,
    setting: CommSetting = CommSetting(),
    candidates_mb: Sequence[float | None] = CHUNK_CANDIDATES_MB,
) -> tuple[float | None, AutoPlan, dict]:
    """The pipeline chunk size whose `auto_plan` ends communication earliest: ``(chunk_mb, plan, {chunk_mb: finish_s})``."""
    plans = {c: auto_plan(profile, topology, params, replace(setting, pipeline_chunk_mb=c)) for c in candidates_mb}
    best = min(candidates_mb, key=lambda c: (round(plans[c].plan.finish_s, 12), list(candidates_mb).index(c)))
    return best, plans[best], {c: p.plan.finish_s for c, p in plans.items()}


class CostModelPlanner:
    """Chooses the all-reduce algorithm and the fusion plan of a run from the communication cost model.

    A `CommPlanner` for ``HierarchicalAllReduceStrategy(algorithm="auto", planner=...)``.
    ``params``: `CommParams`, `Cluster` or a cluster name/path; ``None`` with ``calibrate=True``
    measures them at setup. Backward times: measured (``measure_backward=True``), else FLOPs of
    ``example_input`` at ``sustained_tflops``, else ``backward_time_s`` spread by size. Every
    argument is in ``docs/planner.md``.

    Examples:
        >>> from torch import nn
        >>> from lightning_fastscale.strategies.topology import Topology
        >>> planner = CostModelPlanner("tencent_cloud_25g_vpc", backward_time_s=0.15)
        >>> model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 10))
        >>> planner.plan(model, Topology(16, 8), CommSetting(wire_dtype="fp16")).algorithm in ALGORITHMS
        True
    """

    def __init__(
        self,
        params: CommParams | str | None = None,
        *,
        calibrate: bool = False,
        calibration_sizes: Sequence[int] | None = None,
        backward_time_s: float | None = None,
        sustained_tflops: float | None = None,
        example_input: torch.Tensor | None = None,
        measure_backward: bool = False,
        algorithms: Sequence[str] = ALGORITHMS,
        plain_ddp_tolerance: float | None = PLAIN_DDP_TOLERANCE,
    ) -> None:
        from lightning_fastscale.planner.cluster import Cluster, load_cluster

        if isinstance(params, str):
            params = load_cluster(params)
        if isinstance(params, Cluster):
            sustained_tflops = sustained_tflops or params.device.sustained_tflops
            params = params.comm_params()
        if params is None and not calibrate:
            raise ValueError("CostModelPlanner needs params (CommParams, Cluster or cluster name) or calibrate=True")
        self.params: CommParams | None = params
        self.calibrate = calibrate
        self.calibration_sizes = calibration_sizes
        self.backward_time_s = backward_time_s
        self.sustained_tflops = sustained_tflops
        self.example_input = example_input
        self.measure_backward = measure_backward
        self.algorithms = check_algorithms(algorithms)
        if plain_ddp_tolerance is not None and not plain_ddp_tolerance >= 0:
            raise ValueError(f"CostModelPlanner(plain_ddp_tolerance={plain_ddp_tolerance!r}) must be a fraction "
                             ">= 0 (0.05 is 5 %) or None")
        self.plain_ddp_tolerance = plain_ddp_tolerance
        self._plans: dict[tuple, AutoPlan] = {}

    def _params(
        self, topology: Topology, wire_dtype: str, timeout: timedelta | None, gradient_bytes: int = 0
    ) -> CommParams:
        if self.params is None or self.calibrate:
            from lightning_fastscale.planner.calibrate import DEFAULT_SIZES, calibrate_process_groups
            from lightning_fastscale.strategies.topology import build_process_groups

            sizes = list(self.calibration_sizes or DEFAULT_SIZES)
            groups = build_process_groups(topology, timeout=timeout)
            try:
                for attempt in range(CALIBRATION_ATTEMPTS):
                    flat_sizes = sorted(set(sizes) | ({int(gradient_bytes)} if gradient_bytes > 0 else set()))
                    try:
                        self.params = calibrate_process_groups(groups, sizes, wire_dtype=wire_dtype,
                                                               flat_sizes=flat_sizes).params
                        break
                    except ValueError:
                        # timings that do not grow with size: noise above the size signal (a fast
                        # link); every rank fits the same slowest-member timings, so all retry together
                        if attempt + 1 == CALIBRATION_ATTEMPTS:
                            raise
                        sizes = [4 * size for size in sizes]
            finally:
                groups.destroy()
            self.calibrate = False
        return self.params

    def _profile(self, module: nn.Module) -> GradientProfile:
        example = self.example_input
        if example is None:
            example = getattr(module, "example_input_array", None)
        if not isinstance(example, torch.Tensor):
            example = None
        if self.measure_backward:
            if example is None:
                raise ValueError("CostModelPlanner(measure_backward=True) needs example_input=... "
                                 "(or a module example_input_array tensor) to time backward on")
            return _measured_on_rank0(module, example)
        if (example is None or self.sustained_tflops is None) and self.backward_time_s is None:
            raise ValueError(
                "CostModelPlanner cannot estimate backward time: give backward_time_s=..., or "
                "sustained_tflops=... with example_input=... (or a module example_input_array), "
                "or measure_backward=True"
            )
        flops_input = example if self.sustained_tflops is not None else None
        return module_profile(module, self.backward_time_s, flops_input, self.sustained_tflops)

    def plan(
        self, module: nn.Module, topology: Topology, setting: CommSetting = CommSetting(),
        timeout: timedelta | None = None,
    ) -> AutoPlan:
        """The `AutoPlan` for ``module`` on ``topology`` (computed once); plain DDP only without ``setting.algorithms``."""
        key = (id(module), topology, setting)
        if key not in self._plans and topology.world_size == 1:  # a single rank sends nothing: no link to measure
            profile = self._profile(module)
            alone = plan_fusion(profile.grad_bytes, profile.backward_s, np.zeros_like, max_buckets=1)
            self._plans[key] = AutoPlan("flat", alone, alone.ddp_kwargs(), {"flat": alone})
        if key not in self._plans:
            profile = self._profile(module)
            params = self._params(topology, setting.wire_dtype, timeout, sum(profile.grad_bytes))
            fixed = setting.algorithms is not None
            self._plans[key] = auto_plan(profile, topology, params, setting if fixed else
                                         replace(setting, algorithms=self.algorithms),
                                         plain_ddp_tolerance=None if fixed else self.plain_ddp_tolerance)
        return self._plans[key]

    def plan_comm(self, request: PlanRequest) -> CommPlan:
        """The strategy's question: `plan` of the request."""
        return self.plan(request.module, request.topology, request.setting, request.timeout).comm_plan()
