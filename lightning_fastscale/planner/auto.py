"""One call for a strategy's ``algorithm="auto"`` and fusion ``"auto"``: algorithm + buckets.

For each candidate algorithm the fusion plan is optimised (:func:`plan_fusion`) under that
algorithm's cost, and the algorithm whose plan ends communication earliest wins (Jia et al.
2018 choose segments from such a model; the choice of algorithm follows the same rule).

Plain DDP is the baseline every plan is held against: its flat fp32 all-reduce as the
backend runs it (NCCL's ring or tree; measured where the calibration timed it), with buckets
planned the same way. Where that plan ends within ``plain_ddp_tolerance`` (5 %) of the best,
:class:`AutoPlan` says so (``plain_ddp``) and the strategy installs no hook: a hook's own
overhead and a cast wire dtype are not worth a gain that small.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from lightning_fastscale.planner.baseline import PLAIN_DDP_TOLERANCE
from lightning_fastscale.planner.cost_model import ALGORITHMS, CommParams, Topology
from lightning_fastscale.planner.fusion import FusionPlan, plan_fusion
from lightning_fastscale.planner.profile import GradientProfile, measure_backward_profile, profile_module
from lightning_fastscale.planner.scaling import allreduce_cost
from lightning_fastscale.strategies.options import (
    DEFAULT_PIPELINE_CHUNK_MB, NOT_GIVEN, canonical_algorithms, chunk_numel_for, renamed_option,
)

__all__ = ["CHUNK_CANDIDATES_MB", "AutoPlan", "CostModelPlanner", "auto_plan", "best_chunk_plan", "module_profile"]

CHUNK_CANDIDATES_MB: tuple[float | None, ...] = (None, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
"""Pipeline chunk sizes (MiB; ``None`` = unchunked) :func:`best_chunk_plan` compares."""


@dataclass(frozen=True)
class AutoPlan:
    """The chosen algorithm, its fusion plan, DDP keyword arguments and every candidate's plan.

    ``baseline``: plain DDP's plan (the flat fp32 all-reduce of the backend, no hook), ``None``
    on one node or when not asked for. ``plain_ddp``: that baseline is within the tolerance of
    the best, so ``algorithm`` is ``"flat"``, ``plan`` is the baseline's and no hook is
    needed; ``reason`` says why in words (for the log).
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


def _measured_on_rank0(module: nn.Module, example_input: torch.Tensor) -> GradientProfile:
    """:func:`measure_backward_profile` on every rank, rank 0's result kept by all.

    Every rank runs the passes, so layers that communicate in forward (SyncBatchNorm) stay
    matched; only rank 0's timings are used, because DDP needs the same buckets everywhere.
    """
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
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    algorithms: Sequence[str] = ALGORITHMS,
    max_buckets: int | None = None,
    pipeline_chunk_mb: float | str | None = None,
    *,
    chunk_mb: float | str | None = NOT_GIVEN,
    plain_ddp_tolerance: float | None = None,
) -> AutoPlan:
    """Choose the algorithm and the buckets with the earliest predicted end of communication.

    Ties go to the earlier entry of ``algorithms`` (flat, hier, torus2d: the simpler one).
    ``pipeline_chunk_mb``: the strategy's option of that name (buckets pipelined in chunks);
    ``chunk_mb`` is its deprecated name. On one node only ``flat`` is considered (all
    algorithms are then one in-node all-reduce). ``plain_ddp_tolerance`` (a fraction, e.g.
    0.05; ``None``: off) also plans plain DDP (flat, fp32, unchunked: DDP's own all-reduce)
    and keeps it where its plan ends within that fraction of the best.
    """
    pipeline_chunk_mb = renamed_option("auto_plan", "chunk_mb", chunk_mb, "pipeline_chunk_mb", pipeline_chunk_mb)
    algorithms = canonical_algorithms(algorithms)
    if plain_ddp_tolerance is not None and not plain_ddp_tolerance >= 0:
        raise ValueError(f"plain_ddp_tolerance={plain_ddp_tolerance!r} must be a fraction >= 0 (0.05 is 5 %) or None")
    if topology.num_nodes == 1:
        algorithms = ("flat",)
    candidates = {
        a: plan_fusion(profile.grad_bytes, profile.backward_s,
                       allreduce_cost(a, topology, params, wire_dtype, topk_ratio, pipeline_chunk_mb=pipeline_chunk_mb),
                       max_buckets)
        for a in algorithms
    }
    best = min(algorithms, key=lambda a: (round(candidates[a].finish_s, 12), algorithms.index(a)))
    plan = candidates[best]
    if plain_ddp_tolerance is None or topology.num_nodes == 1:
        return AutoPlan(best, plan, plan.ddp_kwargs(), candidates)
    baseline = plan_fusion(profile.grad_bytes, profile.backward_s,
                           allreduce_cost("flat", topology, params, "fp32", None, pipeline_chunk_mb=None), max_buckets)
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
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    algorithms: Sequence[str] = ALGORITHMS,
    candidates_mb: Sequence[float | None] = CHUNK_CANDIDATES_MB,
) -> tuple[float | None, AutoPlan, dict]:
    """The pipeline chunk size whose :func:`auto_plan` ends communication earliest.

    Small chunks overlap the stages better but every chunk pays every stage's latency, which
    grows with the node count (``2(N-1)`` messages per ring all-reduce), so the best chunk
    grows with the cluster. Returns ``(chunk_mb, plan, {chunk_mb: finish_s})``; ties go to the
    earlier candidate (unchunked first).
    """
    plans = {c: auto_plan(profile, topology, params, wire_dtype, topk_ratio, algorithms, pipeline_chunk_mb=c)
             for c in candidates_mb}
    best = min(candidates_mb, key=lambda c: (round(plans[c].plan.finish_s, 12), list(candidates_mb).index(c)))
    return best, plans[best], {c: p.plan.finish_s for c, p in plans.items()}


class CostModelPlanner:
    """Chooses the all-reduce algorithm and the DDP buckets of a run from the communication cost model.

    Give it to ``HierarchicalAllReduceStrategy(algorithm="auto", planner=...)``: at setup the
    strategy calls :meth:`plan` with its own wire dtype, top-k ratio and pipeline chunk size,
    so the plan prices exactly what the strategy will send. :meth:`plan` also works on its own.

    ``params``: a :class:`CommParams`, a :class:`~lightning_fastscale.planner.cluster.Cluster`
    or the name/path of a cluster description; ``None`` with ``calibrate=True`` measures them
    at setup on the real process groups (:mod:`~lightning_fastscale.planner.calibrate`).
    Backward time per gradient: with ``measure_backward=True``, timed on the module's device
    at setup (:func:`~lightning_fastscale.planner.profile.measure_backward_profile` on
    ``example_input``, rank 0's profile broadcast to every rank); else from ``example_input``
    (default: the module's ``example_input_array``) and ``sustained_tflops`` (default: the
    cluster's device), else ``backward_time_s`` spread over the gradients by size. The plan is
    computed once per module, topology and settings; every rank computes the same plan from
    the same inputs (calibrated parameters are broadcast from rank 0). The calibration also
    times plain DDP's flat all-reduce on the world group at the calibration sizes and the
    model's gradient size, so every algorithm is compared against that measurement.

    ``plain_ddp_tolerance`` (default 5 %): where the planner picks the algorithm (no fixed
    ``algorithms``), plain DDP is kept, without a hook, when its plan ends within this
    fraction of the best (:func:`auto_plan`); ``None`` always takes the best algorithm.

    ``wire_dtype``, ``topk_ratio`` and ``pipeline_chunk_mb`` given here are deprecated: they are
    only defaults for calls of :meth:`plan` that do not give them (the strategy always does);
    ``None`` keeps the built-in default (to plan unchunked, pass ``pipeline_chunk_mb=None`` to
    :meth:`plan`). Every constructor default is a plain value, so LightningCLI can build it.

    Examples:
        >>> from torch import nn
        >>> from lightning_fastscale.strategies import Topology
        >>> planner = CostModelPlanner("tencent_cloud_25g_vpc", backward_time_s=0.15)
        >>> model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 10))
        >>> planner.plan(model, Topology(num_nodes=16, ranks_per_node=8), wire_dtype="fp16").algorithm in ALGORITHMS
        True

        With the strategy (it hands the planner its ``wire_dtype``)::

            strategy = HierarchicalAllReduceStrategy(algorithm="auto", wire_dtype="fp16", planner=planner)
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
        wire_dtype: str | None = None,
        topk_ratio: float | None = None,
        pipeline_chunk_mb: float | str | None = None,
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
        self.algorithms = canonical_algorithms(algorithms)
        if plain_ddp_tolerance is not None and not plain_ddp_tolerance >= 0:
            raise ValueError(f"CostModelPlanner(plain_ddp_tolerance={plain_ddp_tolerance!r}) must be a fraction "
                             ">= 0 (0.05 is 5 %) or None")
        self.plain_ddp_tolerance = plain_ddp_tolerance
        self._defaults: dict = {"wire_dtype": "fp32", "topk_ratio": None, "pipeline_chunk_mb": DEFAULT_PIPELINE_CHUNK_MB}
        for name, value in (("wire_dtype", wire_dtype), ("topk_ratio", topk_ratio),
                            ("pipeline_chunk_mb", pipeline_chunk_mb)):
            if value is not None:
                warnings.warn(
                    f"CostModelPlanner({name}=...) is deprecated: pass it to plan(); with "
                    f"HierarchicalAllReduceStrategy(planner=...) the strategy hands the planner its own {name}.",
                    DeprecationWarning, stacklevel=2,
                )
                self._defaults[name] = value
        chunk_numel_for(self._defaults["pipeline_chunk_mb"])  # validates it now, before any process starts
        self._plans: dict[tuple, AutoPlan] = {}

    def _params(
        self, topology: Topology, wire_dtype: str, timeout: timedelta | None, gradient_bytes: int = 0
    ) -> CommParams:
        if self.params is None or self.calibrate:
            from lightning_fastscale.planner.calibrate import DEFAULT_SIZES, calibrate_process_groups
            from lightning_fastscale.strategies.topology import build_process_groups

            sizes = list(self.calibration_sizes or DEFAULT_SIZES)
            flat_sizes = sorted(set(sizes) | ({int(gradient_bytes)} if gradient_bytes > 0 else set()))
            groups = build_process_groups(topology, timeout=timeout)
            try:
                self.params = calibrate_process_groups(groups, sizes, wire_dtype=wire_dtype,
                                                       flat_sizes=flat_sizes).params
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
        self,
        module: nn.Module,
        topology: Topology,
        *,
        wire_dtype: str | None = None,
        topk_ratio: float | None = NOT_GIVEN,
        pipeline_chunk_mb: float | str | None = NOT_GIVEN,
        algorithms: Sequence[str] | None = None,
        timeout: timedelta | None = None,
    ) -> AutoPlan:
        """The :class:`AutoPlan` for ``module`` on ``topology`` under these settings (computed once).

        ``algorithms``: the candidates (default: the planner's, and plain DDP is kept where
        within ``plain_ddp_tolerance`` of the best; given: the best of them, no plain-DDP
        fallback); ``timeout``: of the process groups a calibration creates.
        """
        wire_dtype = self._defaults["wire_dtype"] if wire_dtype is None else wire_dtype
        topk_ratio = self._defaults["topk_ratio"] if topk_ratio is NOT_GIVEN else topk_ratio
        if pipeline_chunk_mb is NOT_GIVEN:
            pipeline_chunk_mb = self._defaults["pipeline_chunk_mb"]
        candidates = self.algorithms if algorithms is None else canonical_algorithms(algorithms)
        key = (id(module), topology, wire_dtype, topk_ratio, pipeline_chunk_mb, candidates)
        if key not in self._plans:
            profile = self._profile(module)
            params = self._params(topology, wire_dtype, timeout, sum(profile.grad_bytes))
            tolerance = self.plain_ddp_tolerance if algorithms is None else None
            self._plans[key] = auto_plan(profile, topology, params, wire_dtype, topk_ratio, candidates,
                                         pipeline_chunk_mb=pipeline_chunk_mb, plain_ddp_tolerance=tolerance)
        return self._plans[key]

    def select_algorithm(self, module: nn.Module, topology: Topology) -> str:
        """An ``algorithm_selector`` (``(module, topology) -> name``): the planned algorithm."""
        return self.plan(module, topology).algorithm

    def fusion_caps(self, module: nn.Module, topology: Topology) -> list[float]:
        """A callable ``fusion_plan``: DDP ``bucket_cap_mb_list`` of the planned buckets."""
        return self.plan(module, topology).plan.ddp_bucket_cap_mb_list()
