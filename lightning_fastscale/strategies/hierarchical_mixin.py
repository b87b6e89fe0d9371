"""The hierarchical all-reduce strategy's steps, for the Trainer's and Fabric's DDP alike (torch only).

More in ``docs/strategy.md`` ("The shared strategy core").
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastscale.faults.peer_watchdog import PeerWatchdog
from lightning_fastscale.strategies.allreduce import TopKErrorFeedback
from lightning_fastscale.strategies.comm_hooks import HierarchicalHookState
from lightning_fastscale.strategies.node_checks import (
    check_launcher,
    check_nodes_uniform,
    configured_topology,
    gather_node_reports,
)
from lightning_fastscale.strategies.option_checks import check_strategy_options, check_topk_momentum_stage
from lightning_fastscale.strategies.options import DEFAULT_PIPELINE_CHUNK_MB, CommSetting, chunk_numel_for
from lightning_fastscale.strategies.plan_report import hook_name, plan_message, plan_summary
from lightning_fastscale.strategies.planning import (
    CommPlanner,
    PlanRequest,
    explicit_fusion_plan,
    gradient_bytes,
    resolve_comm_plan,
    runs_ddp_allreduce,
)
from lightning_fastscale.strategies.topk_residuals import SavedResiduals, comm_layout, restore_residuals
from lightning_fastscale.strategies.topology import Topology, build_process_groups
from lightning_fastscale.strategies.user_hooks import UserHook


class HierarchicalAllReduceMixin:
    """The hierarchical all-reduce's options, planning, hook and teardown, shared by the Trainer and Fabric strategies.

    Args: see [`HierarchicalAllReduceStrategy`][lightning_fastscale.strategies.HierarchicalAllReduceStrategy];
    ``ddp_comm_hook``/``ddp_comm_state``/``ddp_comm_wrapper`` compose as described in
    `lightning_fastscale.strategies.user_hooks`. Everything else goes to the next class in the
    MRO (Lightning's or Fabric's ``DDPStrategy``, and through it to ``DistributedDataParallel``).
    """

    def __init__(
        self,
        algorithm: str = "hier",
        ranks_per_node: int | None = None,
        wire_dtype: str = "fp32",
        bucket_cap_mb: float | None = None,
        fusion_plan: Sequence[float] | None = None,
        two_segment_split: int | None = None,
        compression: str | None = None,
        topk_ratio: float = 0.01,
        topk_start_iter: int = 2,
        topk_momentum: float = 0.0,
        pipeline_chunk_mb: float | str | None = DEFAULT_PIPELINE_CHUNK_MB,
        planner: CommPlanner | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Callable | None = None,
        **kwargs: Any,
    ) -> None:
        user_hook = UserHook(ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)
        check_strategy_options(
            algorithm=algorithm, ranks_per_node=ranks_per_node, wire_dtype=wire_dtype, bucket_cap_mb=bucket_cap_mb,
            fusion_plan=fusion_plan, two_segment_split=two_segment_split, compression=compression,
            topk_ratio=topk_ratio, topk_start_iter=topk_start_iter, topk_momentum=topk_momentum,
            pipeline_chunk_mb=pipeline_chunk_mb,
            planner=planner, user_hook=user_hook, model_averaging_period=kwargs.pop("model_averaging_period", None),
        )
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(**kwargs)
        self.algorithm = algorithm
        self.ranks_per_node = ranks_per_node
        self.wire_dtype = wire_dtype
        self.fusion_plan = fusion_plan
        self.two_segment_split = two_segment_split
        self.compression = compression
        self.topk_ratio = topk_ratio
        self.topk_start_iter = topk_start_iter
        self.topk_momentum = topk_momentum
        self.pipeline_chunk_mb = pipeline_chunk_mb
        self.planner = planner
        self.user_hook = user_hook
        self.topology: Topology | None = None
        self.hook_state: HierarchicalHookState | None = None
        self._watchdog: PeerWatchdog | None = None
        self.resolved_algorithm: str | None = None
        self.plain_ddp_reason: str | None = None
        self._gradient_bytes = 0
        self._saved_residuals: SavedResiduals | None = None

    _front = "Trainer"
    """What the user configures devices and nodes on, for error messages."""

    # Attributes the DDP strategy this is mixed into provides.
    num_nodes: int
    num_processes: int
    cluster_environment: Any
    global_rank: int
    node_rank: int
    world_size: int
    _ddp_kwargs: dict[str, Any]
    _timeout: Any
    root_device: torch.device

    def _set_world_ranks_now(self) -> None:
        """Set the ranks and the environment's world size (each DDP strategy spells this differently)."""
        raise NotImplementedError

    @override
    def setup_environment(self) -> None:
        """Validate the topology before the process group starts, then check the nodes agree."""
        self._set_world_ranks_now()
        self.topology = self._resolve_topology()
        super().setup_environment()  # type: ignore[misc]
        if self.world_size > 1:  # one process has nothing to compare with, and issues no collective
            check_nodes_uniform(gather_node_reports(self.global_rank, self.node_rank, self.world_size,
                                                    self.cluster_environment), self.num_processes)
            # a rank hung outside any collective ends once a peer has failed
            env = self.cluster_environment
            timeout_s = self._timeout.total_seconds() if self._timeout is not None else 0.0
            self._watchdog = PeerWatchdog(env.main_address, env.main_port, self.global_rank,
                                          grace_s=max(timeout_s, 60.0))
            self._watchdog.start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks this one failed (not on a preemption stop or Ctrl-C: every rank ends then)."""
        if self._watchdog is not None:
            if isinstance(exception, Exception):
                self._watchdog.report_failure(f"{type(exception).__name__}: {str(exception).strip()[:300]}")
            self._watchdog.stop()
        super().on_exception(exception)  # type: ignore[misc]

    def check_topology(self) -> Topology:
        """The topology the Trainer's devices and nodes give with ``ranks_per_node``; no launcher needed.

        Callable right after the Trainer is built, before any process starts: raises
        ``ValueError`` naming ``ranks_per_node`` and the devices when they do not divide.
        """
        return configured_topology(type(self).__name__, self._front, self.num_nodes, self.num_processes,
                                   self.ranks_per_node)

    def _resolve_topology(self) -> Topology:
        check_launcher(self._front, self.num_nodes, self.num_processes, self.cluster_environment)
        return self.check_topology()

    def plan_request(self, model: nn.Module, topology: Topology) -> PlanRequest:
        """What this strategy asks its planner: ``model`` on ``topology`` under its wire dtype, top-k and chunking."""
        setting = CommSetting(None if self.algorithm == "auto" else (self.algorithm,), self.wire_dtype,
                              self.topk_ratio if self.compression == "topk" else None, self.pipeline_chunk_mb)
        return PlanRequest(model, topology, setting, self._timeout)

    def resolve_comm_plan(self, model: nn.Module, topology: Topology) -> tuple[str, list[float] | None]:
        """The algorithm and the fusion plan (``None``: DDP's uniform cap) for ``model`` on ``topology``.

        Explicit settings win; the planner, asked once with `plan_request`, gives the rest
        ([`resolve_comm_plan`][lightning_fastscale.strategies.planning.resolve_comm_plan]) and
        may set `plain_ddp_reason`.
        """
        plan = resolve_comm_plan(
            self.plan_request(model, topology), self.planner, algorithm=self.algorithm,
            fusion_plan=explicit_fusion_plan(model, self.fusion_plan, self.two_segment_split),
            uniform_cap=self._ddp_kwargs.get("bucket_cap_mb") is not None, user_hook=self.user_hook.given,
        )
        self.plain_ddp_reason = plan.plain_ddp_reason
        return plan.algorithm, None if plan.fusion_plan is None else list(plan.fusion_plan)

    def _plan_ddp(self, model: nn.Module) -> None:
        """Choose the algorithm and the fusion plan (into the DDP kwargs), before DDP wraps ``model``."""
        if self.topology is None:  # Fabric's setup_module may be called without setup_environment
            self.topology = self._resolve_topology()
        self.resolved_algorithm, fusion_plan = self.resolve_comm_plan(model, self.topology)
        if self.uses_ddp_allreduce:
            # One node, no hook: every algorithm is then the one all-reduce DDP runs itself.
            self.resolved_algorithm = "flat"
        check_topk_momentum_stage(self.topk_momentum, self.topology.num_nodes, self.resolved_algorithm,
                                  self.plain_ddp_reason)
        if fusion_plan is not None:
            self._ddp_kwargs["bucket_cap_mb_list"] = fusion_plan
        if self.user_hook.hook is not None and self.topology.num_nodes > 1:
            self.user_hook.check(self.resolved_algorithm, self.wire_dtype, self.compression)
        self._gradient_bytes = gradient_bytes(model)

    def _install_hook(self, ddp_model: DistributedDataParallel) -> None:
        """Build the node groups and register the communication hook (collective: every rank calls it)."""
        assert self.topology is not None and self.resolved_algorithm is not None
        if self.user_hook.hook is not None and self.topology.num_nodes == 1:
            # No inter-node stage: the user's hook is the whole all-reduce, as with plain DDP.
            self.user_hook.register_alone(ddp_model)
            return
        if self.uses_ddp_allreduce:
            return  # plain_ddp_reason, if set, reaches the log through plan_message
        if not dist.is_initialized():
            # Only reachable with a stand-in for DistributedDataParallel (a real one needs the
            # process group): there are no peers to build groups with.
            warnings.warn(f"{type(self).__name__}: no process group, so no communication hook was installed")
            return
        self.hook_state = HierarchicalHookState(
            groups=build_process_groups(self.topology, timeout=self._timeout),
            wire_dtype=self.wire_dtype,
            topk=TopKErrorFeedback(self.topk_ratio, self.topk_momentum) if self.compression == "topk" else None,
            topk_start_iter=self.topk_start_iter,
            chunk_numel=chunk_numel_for(self.pipeline_chunk_mb, self.topology.num_nodes),
            algorithm=self.resolved_algorithm,
            param_index={id(p): i for i, p in enumerate(ddp_model.parameters())},
        )
        self.user_hook.register(ddp_model, self.hook_state)
        saved, self._saved_residuals = self._saved_residuals, None
        if saved is not None and self.hook_state.topk is not None:
            # gloo works on host copies of the buckets (CUDA ones too), so the residuals live there
            device = torch.device("cpu") if self.hook_state.groups.backend == "gloo" else self.root_device
            restore_residuals(self.hook_state, saved, self._comm_layout(), device)

    @contextmanager
    def _raising_hook_failure(self) -> Iterator[None]:
        """Re-raise a failed bucket all-reduce as the hook's [`CommHookError`][lightning_fastscale.strategies.CommHookError]
        (DDP reports a hook's exception only as a value it cannot cast to a tensor)."""
        try:
            yield
        except RuntimeError:
            if self.hook_state is not None:
                self.hook_state.raise_if_failed()
            raise

    @property
    def uses_ddp_allreduce(self) -> bool:
        """True where DDP's own all-reduce runs, without a hook ([`runs_ddp_allreduce`][lightning_fastscale.strategies.planning.runs_ddp_allreduce])."""
        assert self.topology is not None
        return runs_ddp_allreduce(self.topology, self.wire_dtype, self.compression, self.user_hook.given,
                                  self.plain_ddp_reason)

    @property
    def comm_hook(self) -> str | None:
        """Name of the communication hook on the DDP module; ``None`` when DDP's own all-reduce runs.

        Known once the model is set up (``Trainer.fit`` / ``Fabric.setup``).
        """
        if self.topology is None or self.resolved_algorithm is None:
            return None
        return hook_name(self.resolved_algorithm, self.user_hook, self.uses_ddp_allreduce)

    @property
    def comm_hook_calls(self) -> int:
        """Backward passes whose gradients went through this strategy's hook (0 when none is installed).

        Counts each backward once, when its last DDP bucket is handed to the hook; a user's hook
        on one node (registered as plain DDP would) is not counted.
        """
        return self.hook_state.iteration if self.hook_state is not None else 0

    def plan_summary(self) -> dict[str, Any]:
        """Topology, algorithm, wire dtype and fusion plan of this run (what rank 0 logs)."""
        assert self.topology is not None
        return plan_summary(
            topology=self.topology, requested_algorithm=self.algorithm, algorithm=self.resolved_algorithm, user_hook=self.user_hook, hook=self.comm_hook,
            backend=self.hook_state.groups.backend if self.hook_state else None, wire_dtype=self.wire_dtype,
            compression=self.compression, topk_ratio=self.topk_ratio, gradient_bytes=self._gradient_bytes,
            fusion_plan=self._ddp_kwargs.get("bucket_cap_mb_list") or [self._ddp_kwargs.get("bucket_cap_mb", 25)],
            pipeline_chunk_mb=self.pipeline_chunk_mb, plain_ddp_reason=self.plain_ddp_reason,
        )

    def plan_message(self) -> str:
        """`plan_summary` as one line, for rank-zero info at setup."""
        return plan_message(type(self).__name__, self.plan_summary())

    def _comm_layout(self) -> dict[str, Any]:
        assert self.topology is not None and self.hook_state is not None
        return comm_layout(self.topology, self.resolved_algorithm, self.topk_ratio, self.hook_state.chunk_numel,
                           self.global_rank, self.topk_momentum)

    @override
    def teardown(self) -> None:
        """Stop the communication thread and release the node groups, then the DDP strategy's teardown."""
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.hook_state is not None:
            failed = self.hook_state.error is not None
            self.hook_state.close()
            if dist.is_initialized() and not failed:
                # After a failure the groups' peers may be gone: destroying them could block on
                # the dead connections, and the process is about to exit anyway.
                self.hook_state.groups.destroy()
        super().teardown()  # type: ignore[misc]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``hier_ring``/``hier_torus`` (subprocess launch) and their ``_spawn`` variants."""
        for name, algorithm in (("hier_ring", "hier"), ("hier_torus", "torus2d")):
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn")):
                strategy_registry.register(
                    name + suffix,
                    cls,
                    description=f"{cls.__name__} with algorithm={algorithm!r}, start_method={start_method!r}",
                    override=True,
                    algorithm=algorithm,
                    start_method=start_method,
                )
