"""Hierarchical / 2D-torus gradient all-reduce for Lightning (Jia et al. 2018; Mikami et al. 2018).

Importing this package registers ``"hier_ring"``, ``"hier_torus"`` and their ``_spawn``
variants in Lightning's ``StrategyRegistry`` (for the Trainer) and in Fabric's strategy registry.
"""
from lightning_fastscale.strategies.allreduce import (
    ALGORITHMS,
    TopKErrorFeedback,
    hierarchical_allreduce_,
    ring_allreduce_,
    torus2d_allreduce_,
)
from lightning_fastscale.strategies.comm_hooks import (
    HOOKS,
    HierarchicalHookState,
    hierarchical_hook,
    ring_hook,
    torus2d_hook,
)
from lightning_fastscale.strategies.fabric import FabricHierarchicalAllReduceStrategy, register_fabric_strategies
from lightning_fastscale.strategies.hierarchical import (
    HierarchicalAllReduceStrategy,
    default_algorithm_selector,
    register_strategies,
    two_segment_caps_mb,
)
from lightning_fastscale.strategies.topology import (
    ProcessGroups,
    Topology,
    build_process_groups,
    detect_ranks_per_node,
)

register_strategies()
register_fabric_strategies()

__all__ = [
    "ALGORITHMS",
    "FabricHierarchicalAllReduceStrategy",
    "HOOKS",
    "HierarchicalAllReduceStrategy",
    "HierarchicalHookState",
    "ProcessGroups",
    "Topology",
    "TopKErrorFeedback",
    "build_process_groups",
    "default_algorithm_selector",
    "detect_ranks_per_node",
    "hierarchical_allreduce_",
    "hierarchical_hook",
    "register_fabric_strategies",
    "register_strategies",
    "ring_allreduce_",
    "ring_hook",
    "torus2d_allreduce_",
    "torus2d_hook",
    "two_segment_caps_mb",
]
