"""Hierarchical / 2D-torus gradient all-reduce for Lightning (Jia et al. 2018; Mikami et al. 2018);
importing it registers ``"hier_ring"``, ``"hier_torus"`` (and ``_spawn``) for the Trainer and Fabric.
"""
from lightning_fastscale.strategies.allreduce import (
    ALLREDUCE_FUNCTIONS,
    STAGES,
    CollectiveStageError,
    TopKErrorFeedback,
    flat_allreduce_,
    hier_allreduce_,
    torus2d_allreduce_,
)
from lightning_fastscale.strategies.comm_hooks import (
    HOOKS,
    CommHookError,
    HierarchicalHookState,
    flat_hook,
    hier_hook,
    torus2d_hook,
)
from lightning_fastscale.strategies.fabric import FabricHierarchicalAllReduceStrategy, register_fabric_strategies
from lightning_fastscale.strategies.hierarchical import HierarchicalAllReduceStrategy, register_strategies
from lightning_fastscale.strategies.hierarchical_mixin import HierarchicalAllReduceMixin
from lightning_fastscale.strategies.options import (
    ALGORITHMS,
    DEFAULT_PIPELINE_CHUNK_MB,
    WIRE_DTYPES,
    CommSetting,
    check_algorithm,
    chunk_numel_for,
    resolve_chunk_mb,
    wire_bytes_per_element,
)
from lightning_fastscale.strategies.planning import (
    CommPlan,
    CommPlanner,
    NodeCountPlanner,
    PlanRequest,
    two_segment_fusion_plan,
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
    "ALLREDUCE_FUNCTIONS",
    "DEFAULT_PIPELINE_CHUNK_MB",
    "HOOKS",
    "STAGES",
    "WIRE_DTYPES",
    "CollectiveStageError",
    "CommHookError",
    "CommPlan",
    "CommPlanner",
    "CommSetting",
    "FabricHierarchicalAllReduceStrategy",
    "HierarchicalAllReduceMixin",
    "HierarchicalAllReduceStrategy",
    "HierarchicalHookState",
    "NodeCountPlanner",
    "PlanRequest",
    "ProcessGroups",
    "Topology",
    "TopKErrorFeedback",
    "build_process_groups",
    "check_algorithm",
    "chunk_numel_for",
    "detect_ranks_per_node",
    "flat_allreduce_",
    "flat_hook",
    "hier_allreduce_",
    "hier_hook",
    "register_fabric_strategies",
    "register_strategies",
    "resolve_chunk_mb",
    "torus2d_allreduce_",
    "torus2d_hook",
    "two_segment_fusion_plan",
    "wire_bytes_per_element",
]
