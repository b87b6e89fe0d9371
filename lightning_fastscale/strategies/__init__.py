"""Hierarchical / 2D-torus gradient all-reduce for Lightning (Jia et al. 2018; Mikami et al. 2018).

Importing this package registers ``"hier_ring"``, ``"hier_torus"`` and their ``_spawn``
variants in Lightning's ``StrategyRegistry`` (for the Trainer) and in Fabric's strategy registry.
"""
import warnings
from typing import Any

from lightning_fastscale.strategies.allreduce import (
    ALLREDUCE_FUNCTIONS,
    STAGES,
    CollectiveStageError,
    TopKErrorFeedback,
    flat_allreduce_,
    hierarchical_allreduce_,
    torus2d_allreduce_,
)
from lightning_fastscale.strategies.comm_hooks import (
    HOOKS,
    CommHookError,
    HierarchicalHookState,
    flat_hook,
    hierarchical_hook,
    torus2d_hook,
)
from lightning_fastscale.strategies.fabric import FabricHierarchicalAllReduceStrategy, register_fabric_strategies
from lightning_fastscale.strategies.hierarchical import (
    HierarchicalAllReduceStrategy,
    default_algorithm_selector,
    register_strategies,
    two_segment_caps_mb,
)
from lightning_fastscale.strategies.hook_check import check_hooks, check_hooks_on_cuda
from lightning_fastscale.strategies.options import (
    ALGORITHMS,
    DEFAULT_PIPELINE_CHUNK_MB,
    WIRE_DTYPES,
    canonical_algorithm,
    chunk_numel_for,
    resolve_chunk_mb,
    wire_bytes_per_element,
)
from lightning_fastscale.strategies.topology import (
    ProcessGroups,
    Topology,
    build_process_groups,
    detect_ranks_per_node,
)

register_strategies()
register_fabric_strategies()

_RENAMED = {"ring_allreduce_": "flat_allreduce_", "ring_hook": "flat_hook"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"lightning_fastscale.strategies.{name} is deprecated: use {new}", DeprecationWarning,
                      stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALGORITHMS",
    "ALLREDUCE_FUNCTIONS",
    "DEFAULT_PIPELINE_CHUNK_MB",
    "HOOKS",
    "STAGES",
    "WIRE_DTYPES",
    "CollectiveStageError",
    "CommHookError",
    "FabricHierarchicalAllReduceStrategy",
    "HierarchicalAllReduceStrategy",
    "HierarchicalHookState",
    "ProcessGroups",
    "Topology",
    "TopKErrorFeedback",
    "build_process_groups",
    "canonical_algorithm",
    "check_hooks",
    "check_hooks_on_cuda",
    "chunk_numel_for",
    "default_algorithm_selector",
    "detect_ranks_per_node",
    "flat_allreduce_",
    "flat_hook",
    "hierarchical_allreduce_",
    "hierarchical_hook",
    "register_fabric_strategies",
    "register_strategies",
    "resolve_chunk_mb",
    "torus2d_allreduce_",
    "torus2d_hook",
    "two_segment_caps_mb",
    "wire_bytes_per_element",
]
