"""Emulated multi-node clusters on one Linux machine (network namespaces + ``tbf`` caps).

Used by the multi-node tests and by ``benchmarks/`` to measure communication where no real
cluster is available; see `lightning_fastscale.emulation.netns_cluster`. Fault injection
(a rank killed or hung mid-backward) on local CPU ranks: [`lightning_fastscale.emulation.faults`][lightning_fastscale.emulation.faults].
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
    "FaultOutcome",
    "NamespaceUnavailable",
    "NodeResult",
    "check_namespace_support",
    "format_outcomes",
    "remove_stale_namespaces",
    "run_fault_scenario",
]

_FAULTS = ("FaultOutcome", "format_outcomes", "run_fault_scenario")


def __getattr__(name: str):
    # Imported on use: ``python -m lightning_fastscale.emulation.faults`` must not find it imported already.
    if name in _FAULTS:
        from lightning_fastscale.emulation import faults

        return getattr(faults, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
