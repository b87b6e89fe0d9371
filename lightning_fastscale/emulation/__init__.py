"""Emulated multi-node clusters on one Linux machine (network namespaces + ``tbf`` caps).

Used by the multi-node tests and by ``benchmarks/`` to measure communication where no real
cluster is available; see :mod:`lightning_fastscale.emulation.netns_cluster`.
"""
from lightning_fastscale.emulation.netns_cluster import (
    EmulatedCluster,
    EmulatedNode,
    NamespaceUnavailable,
    NodeResult,
    check_namespace_support,
    remove_stale_namespaces,
)

__all__ = [
    "EmulatedCluster",
    "EmulatedNode",
    "NamespaceUnavailable",
    "NodeResult",
    "check_namespace_support",
    "remove_stale_namespaces",
]
