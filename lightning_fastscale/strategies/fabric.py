"""``FabricHierarchicalAllReduceStrategy``: the hierarchical (Jia et al. 2018) / 2D-torus (Mikami et al.
2018) all-reduce for Lightning Fabric, under the Trainer's names ``"hier_ring"`` and ``"hier_torus"``.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_fastscale.strategies.hierarchical_mixin import HierarchicalAllReduceMixin
from lightning_fastscale.strategies.option_checks import check_optimizers_for_topk_momentum


class FabricHierarchicalAllReduceStrategy(HierarchicalAllReduceMixin, DDPStrategy):
    """Fabric's DDP with the arguments of `HierarchicalAllReduceStrategy`; `teardown` releases the groups.

    Examples:
        >>> from lightning.fabric import Fabric
        >>> fabric = Fabric(strategy="hier_ring", accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> strategy = FabricHierarchicalAllReduceStrategy(algorithm="hier", ranks_per_node=1)
        >>> fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> strategy.algorithm, strategy.ranks_per_node
        ('hier', 1)
    """

    _front = "Fabric"

    @override
    def _set_world_ranks_now(self) -> None:
        self._set_world_ranks()

    @override
    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        """Plan the buckets, wrap ``module`` in DDP and install the communication hook."""
        self._plan_ddp(module)
        ddp_module = super().setup_module(module)
        self._install_hook(ddp_module)
        rank_zero_info(self.plan_message())
        return ddp_module

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Fabric's optimizer set-up; with ``topk_momentum`` the optimizer must hold no momentum."""
        check_optimizers_for_topk_momentum(self.topk_momentum, [optimizer])
        return super().setup_optimizer(optimizer)

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Fabric's backward, raising a failed bucket all-reduce as the Trainer strategy's ``backward`` does."""
        with self._raising_hook_failure():
            super().backward(tensor, module, *args, **kwargs)


def register_fabric_strategies() -> None:
    """Make ``Fabric(strategy="hier_ring" | "hier_torus" | "hier_ring_spawn" | "hier_torus_spawn")`` work."""
    FabricHierarchicalAllReduceStrategy.register_strategies(STRATEGY_REGISTRY)
