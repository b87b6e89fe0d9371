"""``HierarchicalAllReduceStrategy``: Lightning's DDP whose buckets go through a two-level all-reduce
(Jia et al. 2018, arXiv:1807.11205; Mikami et al. 2018, arXiv:1811.05233), as ``"hier_ring"`` / ``"hier_torus"``.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastscale.lightning_internals import attached_trainer, logs_hyperparameters
from lightning_fastscale.strategies.hierarchical_mixin import HierarchicalAllReduceMixin
from lightning_fastscale.strategies.option_checks import check_optimizers_for_topk_momentum
from lightning_fastscale.strategies.topk_residuals import SavedResiduals, residual_path, residual_state


class HierarchicalAllReduceStrategy(HierarchicalAllReduceMixin, DDPStrategy):
    """DDP whose gradient buckets are all-reduced hierarchically (Jia et al. 2018), as a 2D torus
    (Mikami et al. 2018), or flat. Every option is described in ``docs/strategy.md``.

    Args:
        algorithm: ``"hier"``, ``"torus2d"``, ``"flat"`` or ``"auto"`` (the planner chooses).
        ranks_per_node: ranks forming one node (default: the launcher's devices per node).
        fusion_plan: DDP bucket caps in MB, gradient-ready order (``bucket_cap_mb_list``);
            ``two_segment_split``: two buckets split before this trainable parameter.
        pipeline_chunk_mb: MiB per chunk pipelined through the stages; ``"auto"``: 2 MiB per node.
        compression: ``"topk"``: only the ``topk_ratio`` largest entries cross between nodes, the rest
            kept as error feedback; ``topk_momentum`` > 0 moves the optimizer's momentum into it
            (momentum correction, Lin et al. 2018; the optimizer's own momentum must then be 0).
        planner: a `CommPlanner` such as `CostModelPlanner`, asked once at setup.
        ddp_comm_hook: a torch DDP hook run as the inter-node stage of ``"hier"``, with
            ``ddp_comm_state`` (process group ``None``) and ``ddp_comm_wrapper``.
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
    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's optimizer set-up; with ``topk_momentum`` the optimizers must hold no momentum."""
        super().setup_optimizers(trainer)
        check_optimizers_for_topk_momentum(self.topk_momentum, self.optimizers)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks on CUDA only; torch's hooks work on every backend, gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        self._install_hook(self.model)
        rank_zero_info(self.plan_message())

    @override
    def on_train_start(self) -> None:
        """Write the plan to the loggers as hyper-parameters, unless the module opted out (``logger=False``)."""
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
        """Save the checkpoint; with top-k, every rank also writes its residuals beside it (`residual_path`)."""
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
            with contextlib.suppress(FileNotFoundError):
                self.checkpoint_io.remove_checkpoint(residual_path(filepath, self.global_rank))

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DDP's backward; a failed bucket all-reduce is raised as the hook's `CommHookError`."""
        with self._raising_hook_failure():
            return super().backward(closure_loss, optimizer, *args, **kwargs)


def register_strategies() -> None:
    """Make ``Trainer(strategy="hier_ring" | "hier_torus" | "hier_ring_spawn" | "hier_torus_spawn")`` work."""
    HierarchicalAllReduceStrategy.register_strategies(StrategyRegistry)
