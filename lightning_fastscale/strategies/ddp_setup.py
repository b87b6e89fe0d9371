"""What every hierarchical DDP strategy does, the Trainer's and Fabric's alike (torch only).

:class:`HierarchicalDDPSetup` is a mixin placed before a Lightning ``DDPStrategy`` (the
Trainer's :class:`~lightning_fastscale.strategies.HierarchicalAllReduceStrategy` and Fabric's
:class:`~lightning_fastscale.strategies.fabric.FabricHierarchicalAllReduceStrategy`). It validates
the options before any process starts, resolves the node topology against the launcher, checks
that every node holds the same contiguous ranks, chooses the bucket plan and algorithm, builds
the node groups and installs the communication hook on the ``DistributedDataParallel`` module,
and releases them at teardown. It relies only on what both DDP strategies share (``num_nodes``,
``num_processes``, ``cluster_environment``, ``global_rank``, ``node_rank``, ``world_size``,
``_ddp_kwargs``); each strategy file calls these steps from its own Lightning or Fabric hooks.
The algorithms are Jia et al. 2018 (hierarchical, arXiv:1807.11205) and Mikami et al. 2018
(2D torus, arXiv:1811.05233).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastscale.strategies.allreduce import TopKErrorFeedback
from lightning_fastscale.strategies.comm_hooks import HOOKS, HierarchicalHookState
from lightning_fastscale.strategies.options import (
    DEFAULT_PIPELINE_CHUNK_MB,
    WIRE_DTYPES,
    canonical_algorithm,
    chunk_numel_for,
    renamed_option,
    resolve_chunk_mb,
)
from lightning_fastscale.strategies.topology import Topology, build_process_groups, detect_ranks_per_node
from lightning_fastscale.strategies.user_hooks import (
    LeaderHookState,
    check_user_hook,
    leader_hook,
    user_hook_for_one_node,
)

if TYPE_CHECKING:  # the planner imports this package; the annotation only names its class
    from lightning_fastscale.planner.auto import CostModelPlanner

_MB = 1024 * 1024
AlgorithmSelector = Callable[[nn.Module, Topology], str]
FusionPlanner = Callable[[nn.Module, Topology], Sequence[float]]


def default_algorithm_selector(module: nn.Module, topology: Topology) -> str:
    """``algorithm="auto"`` without a planner: hierarchical across nodes, flat inside one node."""
    return "hier" if topology.num_nodes > 1 else "flat"


def two_segment_caps_mb(module: nn.Module, split: int) -> list[float]:
    """DDP bucket caps (MB, in gradient-ready order) giving two buckets split before parameter ``split``.

    Jia et al. 2018 fuse all gradients into two segments (ResNet-50 split between tensors 76 and
    77): the late layers, whose gradients are ready first, go out while backward continues, the
    rest in one large message. ``split`` indexes ``module.parameters()`` that require grad.
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
    return [tail / _MB, (head + tail) / _MB + 1.0]


class HierarchicalDDPSetup:
    """The hierarchical all-reduce's options and setup steps, shared by the Trainer and Fabric strategies.

    Args: see :class:`~lightning_fastscale.strategies.HierarchicalAllReduceStrategy`;
    ``ddp_comm_hook``/``ddp_comm_state``/``ddp_comm_wrapper`` compose as described in
    :mod:`lightning_fastscale.strategies.user_hooks`. Everything else goes to the next class in the
    MRO (Lightning's or Fabric's ``DDPStrategy``, and through it to ``DistributedDataParallel``).
    """

    def __init__(
        self,
        algorithm: str = "hier",
        ranks_per_node: int | None = None,
        wire_dtype: str = "fp32",
        bucket_cap_mb: float | None = None,
        fusion_plan: Sequence[float] | FusionPlanner | None = None,
        two_segment_split: int | None = None,
        compression: str | None = None,
        topk_ratio: float = 0.01,
        topk_start_iter: int = 2,
        pipeline_chunk_mb: float | str | None = DEFAULT_PIPELINE_CHUNK_MB,
        algorithm_selector: AlgorithmSelector | None = None,
        planner: CostModelPlanner | None = None,
        comm_dtype: str | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Callable | None = None,
        **kwargs: Any,
    ) -> None:
        if comm_dtype is not None:
            wire_dtype = renamed_option(type(self).__name__, "comm_dtype", comm_dtype, "wire_dtype", wire_dtype, "fp32")
        algorithm = canonical_algorithm(algorithm, extra=("auto",))
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={wire_dtype!r}: choose one of {list(WIRE_DTYPES)}.")
        if compression not in (None, "topk"):
            raise ValueError(f"compression={compression!r}: choose None or 'topk'.")
        if compression == "topk" and algorithm == "flat":
            raise ValueError(
                "compression='topk' compresses the inter-node stage, which algorithm='flat' does not "
                "have: use algorithm='hier' or 'torus2d'."
            )
        if compression == "topk":
            TopKErrorFeedback(topk_ratio)  # validates the ratio now, before any process starts
        if topk_start_iter < 1:
            raise ValueError(f"topk_start_iter={topk_start_iter} must be >= 1 (DDP rebuilds buckets after iteration 0).")
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 (or None to detect it).")
        if sum(x is not None for x in (bucket_cap_mb, fusion_plan, two_segment_split)) > 1:
            raise ValueError("set only one of bucket_cap_mb, fusion_plan and two_segment_split.")
        chunk_numel_for(pipeline_chunk_mb)  # validates it before any process starts
        check_user_hook(ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper, algorithm, wire_dtype, compression)
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError(
                "model_averaging_period= (post-local SGD) replaces the gradient all-reduce by periodic "
                "model averaging, so there is no gradient all-reduce left to make hierarchical: use "
                "lightning's DDPStrategy for post-local SGD."
            )
        kwargs.pop("model_averaging_period", None)
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
        self.pipeline_chunk_mb = pipeline_chunk_mb
        self.planner = planner
        self.algorithm_selector = algorithm_selector or default_algorithm_selector
        self.user_comm_hook = ddp_comm_hook
        self.user_comm_state = ddp_comm_state
        self.user_comm_wrapper = ddp_comm_wrapper
        self.topology: Topology | None = None
        self.hook_state: HierarchicalHookState | None = None
        self.resolved_algorithm: str | None = None
        self.plain_ddp_reason: str | None = None
        self._gradient_bytes = 0
        self._saved_residuals: tuple[str, dict | None] | None = None

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

    def _resolve_topology(self) -> Topology:
        world_size = self.num_nodes * self.num_processes
        launcher = detect_ranks_per_node(self.cluster_environment)
        if launcher is not None and launcher != self.num_processes:
            raise ValueError(
                f"the launcher runs {launcher} ranks per node (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE) "
                f"but {self._front}(devices={self.num_processes}): set devices={launcher}."
            )
        env_world = self.cluster_environment.world_size() if self.cluster_environment is not None else world_size
        if env_world != world_size:
            raise ValueError(
                f"{self._front}(num_nodes={self.num_nodes}, devices={self.num_processes}) gives {world_size} ranks "
                f"but the launcher's world size is {env_world}: make num_nodes * devices match it."
            )
        try:
            return Topology.from_world(world_size, self.ranks_per_node or self.num_processes)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}(ranks_per_node=...): {error}") from None

    def _check_nodes_uniform(self) -> None:
        # Every node must report the same local size, and ranks must be contiguous per node,
        # else "intra" groups would span nodes without the user asking for it. One process has
        # nothing to compare with, and issues no collective.
        if self.world_size == 1:
            return
        mine = (self.global_rank, self.node_rank, detect_ranks_per_node(self.cluster_environment))
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        sizes = {size for _, _, size in everyone}
        if len(sizes) > 1:
            raise ValueError(
                f"nodes report different numbers of ranks per node {sorted(map(str, sizes))}: every node "
                "must run the same number of processes (torchrun --nproc_per_node / SLURM --ntasks-per-node)."
            )
        scattered = [(rank, node) for rank, node, _ in everyone if rank // self.num_processes != node]
        if scattered:
            raise ValueError(
                f"global ranks are not contiguous per node (rank, node) = {scattered[:4]}: launch with "
                "consecutive ranks per node (torchrun and Lightning do) or pass ranks_per_node explicitly."
            )

    @property
    def comm_dtype(self) -> str:
        """Deprecated name of :attr:`wire_dtype`."""
        return self.wire_dtype

    def planner_settings(self) -> dict[str, Any]:
        """The settings the planner must price: this strategy's wire dtype, top-k ratio and chunk size."""
        return {
            "wire_dtype": self.wire_dtype,
            "topk_ratio": self.topk_ratio if self.compression == "topk" else None,
            "pipeline_chunk_mb": self.pipeline_chunk_mb,
        }

    def resolve_comm_plan(self, model: nn.Module, topology: Topology) -> tuple[str, list[float] | None]:
        """The algorithm and the DDP bucket caps (MB, ``None``: DDP's uniform cap) for ``model`` on ``topology``.

        Explicit settings win: a fixed ``algorithm``; ``two_segment_split``, ``fusion_plan`` or
        ``bucket_cap_mb`` for the buckets. Otherwise the planner, asked with this strategy's
        :meth:`planner_settings`, or ``algorithm_selector`` decides. With ``algorithm="auto"``
        and no user hook, a planner that finds plain DDP within its tolerance of the best sets
        :attr:`plain_ddp_reason`: the flat path then runs as DDP's own all-reduce, no hook.
        """
        plan = None
        self.plain_ddp_reason = None
        if self.planner is not None:
            algorithms = None if self.algorithm == "auto" else (self.algorithm,)
            plan = self.planner.plan(model, topology, algorithms=algorithms, timeout=self._timeout,
                                     **self.planner_settings())
            no_user_hook = self.user_comm_hook is None and self.user_comm_wrapper is None
            if self.algorithm == "auto" and getattr(plan, "plain_ddp", False) and no_user_hook:
                self.plain_ddp_reason = plan.reason
        caps: Sequence[float] | None = None
        if self.two_segment_split is not None:
            caps = two_segment_caps_mb(model, self.two_segment_split)
        elif callable(self.fusion_plan):
            caps = list(self.fusion_plan(model, topology))
        elif self.fusion_plan is not None:
            caps = list(self.fusion_plan)
        elif plan is not None and self._ddp_kwargs.get("bucket_cap_mb") is None:
            caps = plan.plan.ddp_bucket_cap_mb_list()
        if caps is not None and (not caps or min(caps) <= 0):
            raise ValueError(f"fusion plan {caps}: bucket caps must be a non-empty list of positive MB.")
        if self.algorithm != "auto":
            algorithm = self.algorithm
        elif plan is not None:
            algorithm = plan.algorithm
        else:
            algorithm = canonical_algorithm(self.algorithm_selector(model, topology), "algorithm_selector result")
        return algorithm, None if caps is None else list(caps)

    def _plan_ddp(self, model: nn.Module) -> None:
        """Choose the algorithm and the bucket caps (into the DDP kwargs), before DDP wraps ``model``."""
        if self.topology is None:  # Fabric's setup_module may be called without setup_environment
            self.topology = self._resolve_topology()
        self.resolved_algorithm, caps = self.resolve_comm_plan(model, self.topology)
        if caps is not None:
            self._ddp_kwargs["bucket_cap_mb_list"] = caps
        if self.user_comm_hook is not None and self.topology.num_nodes > 1:
            check_user_hook(self.user_comm_hook, self.user_comm_state, self.user_comm_wrapper,
                            self.resolved_algorithm, self.wire_dtype, self.compression)
        self._gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def _install_hook(self, ddp_model: DistributedDataParallel) -> None:
        """Build the node groups and register the communication hook (collective: every rank calls it)."""
        assert self.topology is not None and self.resolved_algorithm is not None
        if self.user_comm_hook is not None and self.topology.num_nodes == 1:
            # No inter-node stage: the user's hook is the whole all-reduce, as with plain DDP.
            user_hook_for_one_node(ddp_model, self.user_comm_hook, self.user_comm_state, self.user_comm_wrapper)
            return
        if self.uses_ddp_allreduce:
            return  # plain_ddp_reason, if set, reaches the log through plan_message
        if not dist.is_initialized():
            # Only reachable with a stand-in for DistributedDataParallel (a real one needs the
            # process group): there are no peers to build groups with.
            warnings.warn(f"{type(self).__name__}: no process group, so no communication hook was installed")
            return
        groups = build_process_groups(self.topology, timeout=self._timeout)
        self.hook_state = HierarchicalHookState(
            groups=groups,
            wire_dtype=None if self.wire_dtype == "fp32" else WIRE_DTYPES[self.wire_dtype],
            topk=TopKErrorFeedback(self.topk_ratio) if self.compression == "topk" else None,
            topk_start_iter=self.topk_start_iter,
            chunk_numel=chunk_numel_for(self.pipeline_chunk_mb, self.topology.num_nodes),
            algorithm=self.resolved_algorithm,
            param_index={id(p): i for i, p in enumerate(ddp_model.parameters())},
        )
        self._restore_residuals()
        if self.user_comm_hook is not None:
            state = LeaderHookState.create(self.hook_state, self.user_comm_hook, self.user_comm_state,
                                           self.user_comm_wrapper)
            ddp_model.register_comm_hook(state, leader_hook)
            return
        hook = HOOKS[self.resolved_algorithm]
        if self.user_comm_wrapper is not None:
            hook = self.user_comm_wrapper(hook)
        ddp_model.register_comm_hook(self.hook_state, hook)

    @property
    def uses_ddp_allreduce(self) -> bool:
        """True where DDP's own all-reduce runs, without a hook.

        On one node in fp32 without compression or user hook: every algorithm is then one
        all-reduce inside the node, which DDP's built-in C++ path does without the Python hook
        and its thread, so one node costs what plain DDP does. With ``algorithm="auto"``, also
        where the planner found plain DDP within its tolerance of the best
        (:attr:`plain_ddp_reason` says why).
        """
        assert self.topology is not None
        if self.plain_ddp_reason is not None:
            return True
        plain = self.wire_dtype == "fp32" and self.compression is None
        no_user_hook = self.user_comm_hook is None and self.user_comm_wrapper is None
        return self.topology.num_nodes == 1 and plain and no_user_hook

    def _algorithm_label(self) -> str | None:
        if self.user_comm_hook is not None:
            name = getattr(self.user_comm_hook, "__qualname__", repr(self.user_comm_hook))
            assert self.topology is not None
            return name if self.topology.num_nodes == 1 else f"hier (inter-node stage: {name})"
        if self.plain_ddp_reason is not None:
            return "ddp_allreduce (planner: plain DDP within tolerance of the best)"
        if self.uses_ddp_allreduce:
            return "ddp_allreduce (one node)"
        return self.resolved_algorithm

    def plan_summary(self) -> dict[str, Any]:
        """Topology, algorithm, wire dtype and bucket plan of this run (what rank 0 logs)."""
        assert self.topology is not None
        caps = self._ddp_kwargs.get("bucket_cap_mb_list") or [self._ddp_kwargs.get("bucket_cap_mb", 25)]
        why = {} if self.plain_ddp_reason is None else {"strategy/plain_ddp_reason": self.plain_ddp_reason}
        return {
            "strategy/algorithm": self._algorithm_label(),
            "strategy/num_nodes": self.topology.num_nodes,
            "strategy/ranks_per_node": self.topology.ranks_per_node,
            "strategy/world_size": self.topology.world_size,
            "strategy/backend": self.hook_state.groups.backend if self.hook_state else None,
            "strategy/wire_dtype": self.wire_dtype,
            "strategy/compression": f"topk:{self.topk_ratio}" if self.compression else "none",
            "strategy/gradient_mb": round(self._gradient_bytes / _MB, 3),
            "strategy/bucket_caps_mb": [round(float(c), 3) for c in caps],
            "strategy/pipeline_chunk_mb": resolve_chunk_mb(self.pipeline_chunk_mb, self.topology.num_nodes),
            **why,
        }

    def plan_message(self) -> str:
        """:meth:`plan_summary` as one line, for rank-zero info at setup."""
        return f"{type(self).__name__}: " + ", ".join(
            f"{key.split('/')[1]}={value}" for key, value in self.plan_summary().items()
        )

    def _comm_layout(self) -> dict[str, Any]:
        assert self.topology is not None and self.hook_state is not None
        return {
            "world_size": self.topology.world_size, "ranks_per_node": self.topology.ranks_per_node,
            "algorithm": self.resolved_algorithm, "topk_ratio": self.topk_ratio,
            "chunk_numel": self.hook_state.chunk_numel, "rank": self.global_rank,
        }

    def _restore_residuals(self) -> None:
        saved = self._saved_residuals
        if saved is None or self.hook_state is None or self.hook_state.topk is None:
            return
        self._saved_residuals = None
        path, state = saved
        if state is None:
            warnings.warn(f"no top-k residuals for rank {self.global_rank} at {path}: error feedback restarts "
                          "from zero, so this run will not equal an uninterrupted one.", stacklevel=2)
            return
        now, then = self._comm_layout(), state.get("layout", {})
        differ = {k: (then.get(k), v) for k, v in now.items() if then.get(k) != v}
        if differ:
            what = ", ".join(f"{k} {a!r} in the checkpoint vs {b!r} now" for k, (a, b) in differ.items())
            warnings.warn(f"top-k residuals at {path} belong to another layout ({what}): error feedback restarts "
                          "from zero.", stacklevel=2)
            return
        # gloo works on host copies of the buckets (CUDA ones too), so the residuals live there
        device = torch.device("cpu") if self.hook_state.groups.backend == "gloo" else self.root_device
        self.hook_state.topk.errors = {key: t.to(device) for key, t in state["errors"].items()}
        self.hook_state.topk.restored = set(state["errors"])
        self.hook_state.iteration = int(state["iteration"])

    @override
    def teardown(self) -> None:
        """Stop the communication thread and release the node groups, then the DDP strategy's teardown."""
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
