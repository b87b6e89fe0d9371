"""The node layout the strategy is configured for, checked against the launcher and across the nodes."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lightning_fastscale.strategies.topology import Topology, detect_ranks_per_node

NodeReport = tuple[int, int, "int | None"]
"""What one rank reports for `check_nodes_uniform`: (global rank, node rank, ranks per node the launcher gave it)."""


def configured_topology(owner: str, front: str, num_nodes: int, devices: int, ranks_per_node: int | None) -> Topology:
    """The topology of ``num_nodes`` x ``devices`` ranks grouped ``ranks_per_node`` to a node (default: ``devices``).

    Examples:
        >>> configured_topology("Strategy", "Trainer", 2, 4, 2)
        Topology(num_nodes=4, ranks_per_node=2)
    """
    try:
        return Topology.from_world(num_nodes * devices, ranks_per_node or devices)
    except ValueError as error:
        raise ValueError(
            f"{owner}(ranks_per_node={ranks_per_node}) with {front}(devices={devices}, num_nodes={num_nodes}): {error}"
        ) from None


def check_launcher(front: str, num_nodes: int, devices: int, cluster_environment: Any) -> None:
    """``ValueError`` where the launcher's ranks per node or world size differ from ``front``'s ``devices``/``num_nodes``."""
    world_size = num_nodes * devices
    launcher = detect_ranks_per_node(cluster_environment)
    if launcher is not None and launcher != devices:
        raise ValueError(
            f"the launcher runs {launcher} ranks per node (LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE) "
            f"but {front}(devices={devices}): set devices={launcher}."
        )
    env_world = cluster_environment.world_size() if cluster_environment is not None else world_size
    if env_world != world_size:
        raise ValueError(
            f"{front}(num_nodes={num_nodes}, devices={devices}) gives {world_size} ranks "
            f"but the launcher's world size is {env_world}: make num_nodes * devices match it."
        )


def check_nodes_uniform(reports: Sequence[NodeReport], devices: int) -> None:
    """``ValueError`` unless every node reports the same ranks per node and holds contiguous ranks.

    Examples:
        >>> check_nodes_uniform([(0, 0, 2), (1, 0, 2), (2, 1, 2), (3, 1, 2)], devices=2)
        >>> check_nodes_uniform([(0, 0, 2), (1, 1, 2), (2, 0, 2), (3, 1, 2)], devices=2)
        Traceback (most recent call last):
        ...
        ValueError: global ranks are not contiguous per node (rank, node) = [(1, 1), (2, 0)]: ...
    """
    sizes = {size for _, _, size in reports}
    if len(sizes) > 1:
        raise ValueError(
            f"nodes report different numbers of ranks per node {sorted(map(str, sizes))}: every node "
            "must run the same number of processes (torchrun --nproc_per_node / SLURM --ntasks-per-node)."
        )
    scattered = [(rank, node) for rank, node, _ in reports if rank // devices != node]
    if scattered:
        raise ValueError(
            f"global ranks are not contiguous per node (rank, node) = {scattered[:4]}: launch with "
            "consecutive ranks per node (torchrun and Lightning do) or pass ranks_per_node explicitly."
        )


def gather_node_reports(global_rank: int, node_rank: int, world_size: int, cluster_environment: Any) -> list[NodeReport]:
    """Every rank's `NodeReport` (collective: all ranks call it)."""
    mine: NodeReport = (global_rank, node_rank, detect_ranks_per_node(cluster_environment))
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone
