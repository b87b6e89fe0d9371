"""``HierarchicalAllReduceStrategy``: Lightning's DDP with a two-level gradient all-reduce.

The thin Lightning adapter over :mod:`~lightning_fastscale.strategies.allreduce` (the numbers)
and :mod:`~lightning_fastscale.strategies.comm_hooks` (the DDP wiring): DDP still buckets the
gradients and overlaps communication with backward; each bucket is all-reduced by the
hierarchical algorithm of Jia et al. 2018 (Tencent, arXiv:1807.11205), the 2D torus of Mikami
et al. 2018 (Sony, arXiv:1811.05233) or one flat all-reduce, optionally with a half-precision wire and
top-k compression of the inter-node stage (Tencent Cloud 2020). Registered in Lightning as
``"hier_ring"`` and ``"hier_torus"`` (plus ``*_spawn``) by :func:`register_strategies`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
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


class HierarchicalAllReduceStrategy(DDPStrategy):
    """DDP whose gradient buckets are all-reduced hierarchically, as a 2D torus, or flat.

    Each DDP bucket goes through a communication hook running the algorithm of Jia et al. 2018
    (``hier``) or Mikami et al. 2018 (``torus2d``); on one node in fp32 DDP's own all-reduce is
    kept (see :attr:`uses_ddp_allreduce`).

    Args:
        algorithm: ``"hier"`` (reduce in node, all-reduce among leaders, broadcast in node),
            ``"torus2d"`` (reduce-scatter in node, shard all-reduce across nodes, all-gather),
            ``"flat"`` (one all-reduce over all ranks) or ``"auto"`` (the planner or
            ``algorithm_selector`` chooses). ``"ring"`` is the deprecated name of ``"flat"``.
        ranks_per_node: ranks forming one node. Default: the launcher's devices per node
            (``Trainer(devices=...)``, torchrun ``LOCAL_WORLD_SIZE``, SLURM tasks per node). A
            smaller value groups ranks by NVLink island or emulates several nodes on one machine.
        wire_dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"`` on the inter-node wire (gradients are
            averaged before the cast and copied back into their own dtype; sums inside a node
            stay in the gradient's dtype; with one node the whole all-reduce uses it).
            ``comm_dtype`` is its deprecated name.
        bucket_cap_mb: DDP's uniform bucket cap (default 25 MB).
        fusion_plan: explicit DDP bucket caps in MB in gradient-ready order
            (``bucket_cap_mb_list``), or a callable ``(module, topology) -> caps`` such as the
            planner's cost-model fusion.
        two_segment_split: fuse into two buckets split before this trainable parameter index
            (Jia et al. 2018). Mutually exclusive with ``fusion_plan`` and ``bucket_cap_mb``.
        compression: ``None`` or ``"topk"``: top-k with error feedback on the inter-node stage.
        topk_ratio: fraction of each inter-node shard sent when ``compression="topk"``.
        topk_start_iter: iterations sent uncompressed first (DDP rebuilds buckets after one).
        pipeline_chunk_mb: split each bucket into chunks of this many MiB, pipelined through
            the stages (chunk i crosses the nodes while chunk i+1 is reduced in the node);
            ``"auto"`` (default): 2 MiB per node, so chunks grow with the latency each one pays;
            ``None`` sends each bucket in one piece.
        algorithm_selector: ``(module, topology) -> name`` used for ``algorithm="auto"``
            without a planner.
        planner: a :class:`~lightning_fastscale.planner.CostModelPlanner`. At setup the
            strategy asks it for a plan under its own ``wire_dtype``, top-k ratio and
            ``pipeline_chunk_mb``; the plan gives the algorithm (for ``"auto"``) and, unless
            fusion is set explicitly, the DDP bucket caps.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (and DDP).

    Examples:
        Two emulated nodes of two ranks each on one CPU machine::

            import lightning.pytorch as pl
            from lightning_fastscale.strategies import HierarchicalAllReduceStrategy

            strategy = HierarchicalAllReduceStrategy(algorithm="hier", ranks_per_node=2, wire_dtype="fp16")
            trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_epochs=1)

        The planner choosing algorithm and buckets for a described cluster::

            from lightning_fastscale.planner import CostModelPlanner

            planner = CostModelPlanner("tencent_cloud_25g_vpc", backward_time_s=0.15)
            strategy = HierarchicalAllReduceStrategy(algorithm="auto", planner=planner, wire_dtype="fp16")

        On a cluster, ``Trainer(strategy="hier_ring", num_nodes=N, devices=G)`` under
        torchrun or SLURM detects the ranks per node from the launcher.
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
        for own in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(own) is not None:
                raise ValueError(
                    f"{own}= is not supported by HierarchicalAllReduceStrategy, which installs its own "
                    "communication hook; use lightning's DDPStrategy for a custom hook."
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
        self.pipeline_chunk_mb = pipeline_chunk_mb
        self.planner = planner
        self.algorithm_selector = algorithm_selector or default_algorithm_selector
        self.topology: Topology | None = None
        self.hook_state: HierarchicalHookState | None = None
        self.resolved_algorithm: str | None = None
        self._saved_residuals: tuple[str, dict | None] | None = None

    def _resolve_topology(self) -> Topology:
        world_size = self.num_nodes * self.num_processes
        launcher = detect_ranks_per_node(self.cluster_environment)
        if launcher is not None and launcher != self.num_processes:
            raise ValueError(
                f"the launcher runs {launcher} ranks per node (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE) "
                f"but Trainer(devices={self.num_processes}): set devices={launcher}."
            )
        env_world = self.cluster_environment.world_size() if self.cluster_environment is not None else world_size
        if env_world != world_size:
            raise ValueError(
                f"Trainer(num_nodes={self.num_nodes}, devices={self.num_processes}) gives {world_size} ranks "
                f"but the launcher's world size is {env_world}: make num_nodes * devices match it."
            )
        try:
            return Topology.from_world(world_size, self.ranks_per_node or self.num_processes)
        except ValueError as error:
            raise ValueError(f"HierarchicalAllReduceStrategy(ranks_per_node=...): {error}") from None

    @override
    def setup_environment(self) -> None:
        """Validate the topology before the process group starts, then build the node groups."""
        self.set_world_ranks()
        self.topology = self._resolve_topology()
        super().setup_environment()
        self._check_nodes_uniform()

    def _check_nodes_uniform(self) -> None:
        # Every node must report the same local size, and ranks must be contiguous per node,
        # else "intra" groups would span nodes without the user asking for it.
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
        :meth:`planner_settings`, or ``algorithm_selector`` decides.
        """
        plan = None
        if self.planner is not None:
            algorithms = None if self.algorithm == "auto" else (self.algorithm,)
            plan = self.planner.plan(model, topology, algorithms=algorithms, timeout=self._timeout,
                                     **self.planner_settings())
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

    @override
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        assert self.topology is not None
        self.resolved_algorithm, caps = self.resolve_comm_plan(model, self.topology)
        if caps is not None:
            self._ddp_kwargs["bucket_cap_mb_list"] = caps
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks on CUDA only; torch's hooks work on every backend, gloo too.
        assert isinstance(self.model, DistributedDataParallel) and self.topology is not None
        assert self.resolved_algorithm is not None
        if self.uses_ddp_allreduce:
            self._log_plan()
            return
        groups = build_process_groups(self.topology, timeout=self._timeout)
        self.hook_state = HierarchicalHookState(
            groups=groups,
            wire_dtype=None if self.wire_dtype == "fp32" else WIRE_DTYPES[self.wire_dtype],
            topk=TopKErrorFeedback(self.topk_ratio) if self.compression == "topk" else None,
            topk_start_iter=self.topk_start_iter,
            chunk_numel=chunk_numel_for(self.pipeline_chunk_mb, self.topology.num_nodes),
            algorithm=self.resolved_algorithm,
            param_index={id(p): i for i, p in enumerate(self.model.parameters())},
        )
        self._restore_residuals()
        self.model.register_comm_hook(self.hook_state, HOOKS[self.resolved_algorithm])
        self._log_plan()

    @property
    def uses_ddp_allreduce(self) -> bool:
        """True on one node in fp32 without compression: no hook, DDP's own all-reduce.

        Every algorithm is then one all-reduce inside the node, which DDP's built-in C++ path
        does without the Python hook and its thread, so one node costs what plain DDP does.
        """
        assert self.topology is not None
        return self.topology.num_nodes == 1 and self.wire_dtype == "fp32" and self.compression is None

    def plan_summary(self) -> dict[str, Any]:
        """Topology, algorithm, wire dtype and bucket plan of this run (what rank 0 logs)."""
        assert self.topology is not None
        grads = sum(p.numel() * p.element_size() for p in self.lightning_module.parameters() if p.requires_grad)
        caps = self._ddp_kwargs.get("bucket_cap_mb_list") or [self._ddp_kwargs.get("bucket_cap_mb", 25)]
        return {
            "strategy/algorithm": "ddp_allreduce (one node)" if self.uses_ddp_allreduce else self.resolved_algorithm,
            "strategy/num_nodes": self.topology.num_nodes,
            "strategy/ranks_per_node": self.topology.ranks_per_node,
            "strategy/world_size": self.topology.world_size,
            "strategy/backend": self.hook_state.groups.backend if self.hook_state else None,
            "strategy/wire_dtype": self.wire_dtype,
            "strategy/compression": f"topk:{self.topk_ratio}" if self.compression else "none",
            "strategy/gradient_mb": round(grads / _MB, 3),
            "strategy/bucket_caps_mb": [round(float(c), 3) for c in caps],
            "strategy/pipeline_chunk_mb": resolve_chunk_mb(self.pipeline_chunk_mb, self.topology.num_nodes),
        }

    def _log_plan(self) -> None:
        if self.global_rank != 0:
            return
        summary = self.plan_summary()
        rank_zero_info(
            "HierarchicalAllReduceStrategy: " + ", ".join(f"{k.split('/')[1]}={v}" for k, v in summary.items())
        )
        trainer = self.lightning_module._trainer
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_hyperparams(summary)

    def _residual_path(self, filepath: Any) -> str:
        return f"{filepath}.topk-residuals-rank{self.global_rank}"

    def _comm_layout(self) -> dict[str, Any]:
        assert self.topology is not None and self.hook_state is not None
        return {
            "world_size": self.topology.world_size, "ranks_per_node": self.topology.ranks_per_node,
            "algorithm": self.resolved_algorithm, "topk_ratio": self.topk_ratio,
            "chunk_numel": self.hook_state.chunk_numel, "rank": self.global_rank,
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Save the checkpoint (rank 0); with top-k, every rank also saves its error-feedback residuals.

        The residuals differ per rank (each keeps what it did not send), so each rank writes
        ``<checkpoint>.topk-residuals-rank<R>`` beside the checkpoint, with the layout they belong
        to (world size, ranks per node, algorithm, ratio, chunking, hook iteration).
        """
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        state = self.hook_state
        if state is not None and state.topk is not None:
            residuals = {"layout": self._comm_layout(), "iteration": state.iteration,
                         "errors": {key: t.detach().cpu() for key, t in state.topk.errors.items()}}
            self.checkpoint_io.save_checkpoint(residuals, self._residual_path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint; with top-k, also this rank's residuals (restored once the hook exists)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.compression == "topk":
            path = self._residual_path(checkpoint_path)
            try:
                self._saved_residuals = (path, self.checkpoint_io.load_checkpoint(path))
            except FileNotFoundError:
                self._saved_residuals = (path, None)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint and this rank's top-k residuals beside it."""
        super().remove_checkpoint(filepath)
        if self.compression == "topk":
            try:
                self.checkpoint_io.remove_checkpoint(self._residual_path(filepath))
            except FileNotFoundError:
                pass

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
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DDP's backward; a failed bucket all-reduce is raised as the hook's :class:`CommHookError`.

        DDP reports an exception from a hook's future only as a value it cannot cast to a
        tensor; the hook state keeps the real error (algorithm, stage, bucket, cause).
        """
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        except RuntimeError:
            if self.hook_state is not None:
                self.hook_state.raise_if_failed()
            raise

    @override
    def teardown(self) -> None:
        """Stop the communication thread and release the node groups, then let DDP unwrap the model."""
        if self.hook_state is not None:
            failed = self.hook_state.error is not None
            self.hook_state.close()
            if dist.is_initialized() and not failed:
                # After a failure the groups' peers may be gone: destroying them could block on
                # the dead connections, and the process is about to exit anyway.
                self.hook_state.groups.destroy()
        super().teardown()

    @override
    @classmethod
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


def register_strategies() -> None:
    """Make ``Trainer(strategy="hier_ring" | "hier_torus" | "hier_ring_spawn" | "hier_torus_spawn")`` work."""
    HierarchicalAllReduceStrategy.register_strategies(StrategyRegistry)
