"""``HierarchicalAllReduceStrategy``: Lightning's DDP with a two-level gradient all-reduce.

The thin Lightning adapter over [`allreduce`][lightning_fastscale.strategies.allreduce] (the
numbers) and `comm_hooks` (the DDP wiring): DDP still buckets the gradients and overlaps
communication with backward; each bucket is all-reduced by Jia et al. 2018's hierarchical
algorithm (arXiv:1807.11205), Mikami et al. 2018's 2D torus (arXiv:1811.05233) or one flat
all-reduce. Registered in Lightning as ``"hier_ring"`` and ``"hier_torus"`` (plus ``*_spawn``).
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastscale.lightning_internals import attached_trainer, logs_hyperparameters
from lightning_fastscale.strategies.hierarchical_mixin import HierarchicalAllReduceMixin
from lightning_fastscale.strategies.topk_residuals import SavedResiduals, residual_path, residual_state


class HierarchicalAllReduceStrategy(HierarchicalAllReduceMixin, DDPStrategy):
    """DDP whose gradient buckets are all-reduced hierarchically, as a 2D torus, or flat.

    Each DDP bucket goes through a communication hook running the algorithm of Jia et al. 2018
    (``hier``) or Mikami et al. 2018 (``torus2d``); on one node in fp32 DDP's own all-reduce is
    kept (see `uses_ddp_allreduce`). Every option is described in ``docs/strategy.md``.

    Args:
        algorithm: ``"hier"``, ``"torus2d"``, ``"flat"`` or ``"auto"`` (the planner chooses).
        ranks_per_node: ranks forming one node (default: the launcher's devices per node).
        wire_dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"`` on the inter-node wire.
        bucket_cap_mb: DDP's uniform bucket cap (default 25 MB).
        fusion_plan: DDP bucket caps in MB, gradient-ready order (``bucket_cap_mb_list``).
        two_segment_split: the fusion plan of two buckets split before this trainable
            parameter (Jia et al. 2018). At most one of the three fusion options.
        compression: ``None`` or ``"topk"`` (top-k with error feedback between nodes).
        topk_ratio: fraction of each inter-node shard sent with ``compression="topk"``.
        topk_start_iter: iterations sent uncompressed first (DDP rebuilds buckets after one).
        pipeline_chunk_mb: MiB per chunk pipelined through the stages; ``"auto"`` (2 MiB per
            node) or ``None`` (one piece).
        planner: a [`CommPlanner`][lightning_fastscale.strategies.planning.CommPlanner] such as
            [`CostModelPlanner`][lightning_fastscale.planner.CostModelPlanner], asked once at setup
            (`plan_request`) for the algorithm (``"auto"``) and the fusion plan.
        ddp_comm_hook: a torch DDP communication hook run as the inter-node stage of ``"hier"``
            (the whole all-reduce on one node); see `lightning_fastscale.strategies.user_hooks`.
        ddp_comm_state: the hook's state, with its process group left ``None``.
        ddp_comm_wrapper: e.g. ``fp16_compress_wrapper``, around the user's or the strategy's hook.
        **kwargs: passed to `DDPStrategy` (and DDP).

    Examples:
        Two emulated nodes of two ranks each on one CPU machine::

            import lightning.pytorch as pl
            from lightning_fastscale.strategies import HierarchicalAllReduceStrategy

            strategy = HierarchicalAllReduceStrategy(algorithm="hier", ranks_per_node=2, wire_dtype="fp16")
            trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_epochs=1)

        On a cluster, ``Trainer(strategy="hier_ring", num_nodes=N, devices=G)`` under
        torchrun or SLURM detects the ranks per node from the launcher.
    """

    @override
    def _set_world_ranks_now(self) -> None:
        self.set_world_ranks()

    @override
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        self._plan_ddp(model)
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks on CUDA only; torch's hooks work on every backend, gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        self._install_hook(self.model)
        rank_zero_info(self.plan_message())

    @override
    def on_train_start(self) -> None:
        """Write the plan to the loggers as hyper-parameters, after Lightning logged the module's.

        Skipped when the module opted out with ``save_hyperparameters(logger=False)``; nothing is
        written to loggers during setup.
        """
        super().on_train_start()
        module = self.lightning_module
        trainer = attached_trainer(module) if module is not None else None
        if trainer is None or self.topology is None or not logs_hyperparameters(module) or self.global_rank != 0:
            return
        summary = self.plan_summary()
        for logger in trainer.loggers:
            logger.log_hyperparams(summary)

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
            residuals = residual_state(state, self._comm_layout())
            self.checkpoint_io.save_checkpoint(residuals, residual_path(filepath, self.global_rank))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint; with top-k, note the residual files beside it (read once the hook exists)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.compression == "topk":
            self._saved_residuals = SavedResiduals(str(checkpoint_path), self.checkpoint_io.load_checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint and this rank's top-k residuals beside it."""
        super().remove_checkpoint(filepath)
        if self.compression == "topk":
            try:
                self.checkpoint_io.remove_checkpoint(residual_path(filepath, self.global_rank))
            except FileNotFoundError:
                pass

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DDP's backward; a failed bucket all-reduce is raised as the hook's [`CommHookError`][lightning_fastscale.strategies.CommHookError]."""
        with self._raising_hook_failure():
            return super().backward(closure_loss, optimizer, *args, **kwargs)


def register_strategies() -> None:
    """Make ``Trainer(strategy="hier_ring" | "hier_torus" | "hier_ring_spawn" | "hier_torus_spawn")`` work."""
    HierarchicalAllReduceStrategy.register_strategies(StrategyRegistry)
