"""Node topology of a data-parallel job (contiguous ranks per node, as torchrun and SLURM lay them out)
and the per-node and per-local-rank process groups of Jia et al. 2018's and Mikami et al. 2018's all-reduce.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class Topology:
    """``num_nodes`` nodes of ``ranks_per_node`` contiguous ranks each: the package's one topology type.

    Examples:
        >>> topo = Topology(num_nodes=2, ranks_per_node=4)
        >>> topo.world_size, topo.node_ranks(1), topo.peer_ranks(0)
        (8, [4, 5, 6, 7], [0, 4])
        >>> Topology.from_world(8, 4) == topo
        True
    """

    num_nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("num_nodes", "ranks_per_node"):
            _check_count(name, getattr(self, name))

    @classmethod
    def from_world(cls, world_size: int, ranks_per_node: int) -> Topology:
        """``world_size`` ranks grouped ``ranks_per_node`` to a node; ``ValueError`` naming both if they do not divide."""
        _check_count("world_size", world_size)
        _check_count("ranks_per_node", ranks_per_node)
        if world_size % ranks_per_node:
            raise ValueError(
                f"world size {world_size} is not a multiple of ranks_per_node={ranks_per_node}: "
                "every node must hold the same number of ranks. Choose ranks_per_node dividing "
                f"{world_size} (or change Trainer(devices=..., num_nodes=...))."
            )
        return cls(world_size // ranks_per_node, ranks_per_node)

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.num_nodes * self.ranks_per_node

    def node_rank(self, rank: int) -> int:
        """Index of the node holding global ``rank``."""
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """Position of global ``rank`` inside its node."""
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of ``node``."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with ``local_rank`` on every node (the leaders when ``local_rank == 0``)."""
        return [node * self.ranks_per_node + local_rank for node in range(self.num_nodes)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}.")


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        hint = (" Set it to the number of processes per node (e.g. Trainer(devices=...)) or leave it "
                "unset to detect it.") if name == "ranks_per_node" else ""
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.{hint}")


def detect_ranks_per_node(cluster_environment_or_env: Any = None) -> int | None:
    """Ranks per node from torchrun's ``LOCAL_WORLD_SIZE`` or SLURM's ``SLURM_NTASKS_PER_NODE``, else ``None``.

    Accepts a Lightning ``ClusterEnvironment`` or a mapping of environment variables (default: ``os.environ``).
    """
    source = cluster_environment_or_env
    if type(source).__name__ == "LightningEnvironment" and not source.creates_processes_externally:
        return None
    env: Mapping[str, str] = source if isinstance(source, Mapping) else os.environ
    if env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"])
    if env.get("SLURM_NTASKS_PER_NODE"):
        # SLURM writes e.g. "4", "4(x2)" or "4(x2),3" (heterogeneous); only a single count is usable.
        counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", env["SLURM_NTASKS_PER_NODE"])}
        return counts.pop() if len(counts) == 1 else None
    return None


@dataclass
class ProcessGroups:
    """Process groups of one rank for the two-level all-reduce.

    ``intra`` / ``intra_out``: this rank's node (inbound / outbound stages); ``inter``: the ranks
    with this rank's local rank on every node; ``world``: a private group over all ranks.
    """

    topology: Topology
    rank: int
    backend: str
    intra: ProcessGroup
    intra_out: ProcessGroup
    inter: ProcessGroup
    world: ProcessGroup
    intra_ranks: list[int]
    inter_ranks: list[int]

    @property
    def local_rank(self) -> int:
        """This rank's position inside its node."""
        return self.topology.local_rank(self.rank)

    @property
    def node_rank(self) -> int:
        """This rank's node."""
        return self.topology.node_rank(self.rank)

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its node's leader (local rank 0)."""
        return self.local_rank == 0

    def destroy(self) -> None:
        """Release this rank's groups (at teardown; each holds connections to its peers)."""
        for group in {id(g): g for g in (self.intra, self.intra_out, self.inter, self.world)}.values():
            dist.destroy_process_group(group)


def build_process_groups(topology: Topology, timeout: timedelta | None = None) -> ProcessGroups:
    """Create the groups of ``topology`` (collective); ``timeout``: the collectives' (``None``: torch's default)."""
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed.init_process_group to run first.")
    if dist.get_world_size() != topology.world_size:
        raise ValueError(
            f"topology world_size={topology.world_size} but the process group has "
            f"{dist.get_world_size()} ranks."
        )
    rank = dist.get_rank()
    backend = dist.get_backend()
    mine: dict[str, ProcessGroup] = {}
    # new_group is collective over the default group: every rank creates every group.
    for kind in ("intra", "intra_out"):
        for node in range(topology.num_nodes):
            group = dist.new_group(topology.node_ranks(node), timeout=timeout)
            if node == topology.node_rank(rank):
                mine[kind] = group
    for local in range(topology.ranks_per_node):
        group = dist.new_group(topology.peer_ranks(local), timeout=timeout)
        if local == topology.local_rank(rank):
            mine["inter"] = group
    world = dist.new_group(list(range(topology.world_size)), timeout=timeout)
    return ProcessGroups(
        topology=topology,
        rank=rank,
        backend=str(backend),
        intra=mine["intra"],
        intra_out=mine["intra_out"],
        inter=mine["inter"],
        world=world,
        intra_ranks=topology.node_ranks(topology.node_rank(rank)),
        inter_ranks=topology.peer_ranks(topology.local_rank(rank)),
    )
