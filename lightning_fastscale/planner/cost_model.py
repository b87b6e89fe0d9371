"""Alpha-beta-gamma cost model of gradient all-reduce on a cluster of nodes x ranks.

The model is the one of Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 2005): a message of ``n`` bytes between two ranks
costs ``alpha + n * beta`` (latency per message, seconds per byte), and reducing ``n`` bytes
costs ``n * gamma``. Closed forms used (``p`` ranks, ``n`` bytes):

* ring all-reduce:      ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``
* ring reduce-scatter:  ``(p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma``
* ring all-gather:      ``(p-1) alpha + (p-1)/p n beta``
* reduce (Rabenseifner: reduce-scatter then binomial gather):
  ``(p-1 + log2 p) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``
* broadcast (van de Geijn: binomial scatter then ring all-gather):
  ``(log2 p + p-1) alpha + 2(p-1)/p n beta``

Two link levels are modelled: an intra-node link (NVLink / PCIe / shared memory) and each
node's inter-node link (its NIC), whose bandwidth is shared by every flow leaving the node.
On top of the primitives, the three algorithms of the strategy:

* ``ring``: one flat ring over all ``P = nodes * ranks_per_node`` ranks, ordered node by
  node. Every step moves ``n/P`` bytes on every edge at once, so a step lasts as long as the
  slowest edge (the inter-node one once there are two nodes).
* ``hier`` (Jia et al. 2018, "Highly Scalable Deep Learning Training System with
  Mixed-Precision"): reduce inside the node, ring all-reduce among the node leaders,
  broadcast inside the node.
* ``torus2d`` (Mikami et al. 2018, "Massively Distributed SGD: ImageNet/ResNet-50 Training
  in a Flash"): reduce-scatter inside the node, all-reduce of each ``1/ranks_per_node``
  shard across nodes (``ranks_per_node`` rings in parallel sharing the NIC), all-gather
  inside the node.

Each node must send (and receive) at least ``2(N-1)/N * n`` bytes over its link for any
all-reduce across ``N`` nodes: :func:`bandwidth_bound`. ``hier`` and ``torus2d`` reach that
byte count; the flat ring sends ``2(P-1)/P * n``, i.e. ``(P-1)N / ((N-1)P)`` times more
(1.75x for 2 nodes x 4 ranks).

The wire dtype scales the bytes (fp16/bf16 halve them). Optional top-k compression (Tencent
Cloud 2020; Lin et al. 2018, "Deep Gradient Compression") replaces the inter-node stage of
``hier`` / ``torus2d`` by an all-gather of ``ratio * numel`` (value, int32 index) pairs per
node: sparse vectors from different nodes do not add up in place, so a ring all-reduce of
them is not possible. The flat ring has no separate inter-node stage and is not compressed.

:func:`allreduce_time` accepts a numpy array of sizes as well as a number, so the fusion
planner can price every candidate bucket at once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "ALGORITHMS",
    "WIRE_BYTES",
    "CommParams",
    "Topology",
    "allgather_time",
    "allreduce_time",
    "bandwidth_bound",
    "broadcast_time",
    "choose_algorithm",
    "predict_allreduce",
    "reduce_scatter_time",
    "reduce_time",
    "ring_allreduce_time",
    "wire_bytes_per_element",
]

ALGORITHMS: tuple[str, ...] = ("ring", "hier", "torus2d")

WIRE_BYTES: dict[str, int] = {
    "fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "half": 2, "bf16": 2, "bfloat16": 2,
}

_INDEX_BYTES = 4  # top-k sends an int32 index with every value


def wire_bytes_per_element(wire_dtype: str) -> int:
    """Bytes one gradient element takes on the wire for ``wire_dtype`` (fp32, fp16, bf16)."""
    try:
        return WIRE_BYTES[str(wire_dtype).lower()]
    except KeyError:
        raise ValueError(
            f"wire_dtype={wire_dtype!r} is not known; use one of {sorted(set(WIRE_BYTES))}"
        ) from None


@dataclass(frozen=True)
class CommParams:
    """Link parameters in SI units: seconds per message (alpha), seconds per byte (beta).

    ``beta_inter`` is the seconds per byte of one node's whole inter-node link (1 / NIC
    bandwidth); flows leaving a node share it. ``gamma`` is seconds per byte reduced (the
    addition in reduce-scatter / all-reduce).
    """

    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CommParams.{name}={value!r} must be a finite number >= 0")
        for name in ("beta_intra", "beta_inter"):
            if getattr(self, name) == 0:
                raise ValueError(
                    f"CommParams.{name}=0 means infinite bandwidth; give the link's real bandwidth"
                )

    def as_dict(self) -> dict[str, float]:
        """The parameters as a plain dict (for JSON output and logging)."""
        return asdict(self)


@dataclass(frozen=True)
class Topology:
    """``nodes`` nodes of ``ranks_per_node`` ranks each; ranks are numbered node by node."""

    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{name}={value!r} must be an integer >= 1")

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.ranks_per_node

    @classmethod
    def from_world(cls, world_size: int, ranks_per_node: int) -> "Topology":
        """Topology of ``world_size`` ranks grouped ``ranks_per_node`` to a node.

        Raises a ``ValueError`` naming both settings when they do not divide.
        """
        if ranks_per_node < 1 or world_size < 1 or world_size % ranks_per_node:
            raise ValueError(
                f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}: "
                "every node must hold the same number of ranks"
            )
        return cls(world_size // ranks_per_node, ranks_per_node)


def ring_allreduce_time(p: int, nbytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes`` over ``p`` ranks (Thakur et al. 2005, ring algorithm)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta + (p - 1) / p * nbytes * gamma


def reduce_scatter_time(p: int, nbytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Ring reduce-scatter of ``nbytes`` (each rank ends with ``nbytes/p``), Thakur et al."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha + (p - 1) / p * nbytes * (beta + gamma)


def allgather_time(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring all-gather producing ``nbytes`` on every rank (``nbytes/p`` from each), Thakur et al."""
    if p <= 1:
        return 0.0
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


def reduce_time(p: int, nbytes: float, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Reduce to one rank: Rabenseifner's reduce-scatter + binomial gather (Thakur et al.)."""
    if p <= 1:
        return 0.0
    gather = math.ceil(math.log2(p)) * alpha + (p - 1) / p * nbytes * beta
    return reduce_scatter_time(p, nbytes, alpha, beta, gamma) + gather


def broadcast_time(p: int, nbytes: float, alpha: float, beta: float) -> float:
    """Broadcast from one rank: van de Geijn's binomial scatter + ring all-gather (Thakur et al.)."""
    if p <= 1:
        return 0.0
    scatter = math.ceil(math.log2(p)) * alpha + (p - 1) / p * nbytes * beta
    return scatter + allgather_time(p, nbytes, alpha, beta)


def bandwidth_bound(nodes: int, nbytes: float, beta_inter: float) -> float:
    """Lower bound on any all-reduce across ``nodes``: each node moves ``2(N-1)/N * nbytes``."""
    if nodes <= 1:
        return 0.0
    return 2 * (nodes - 1) / nodes * nbytes * beta_inter


def _inter_stage(
    nodes: int, nbytes: float, flows: int, params: CommParams, wire: int, topk_ratio: float | None
) -> float:
    """Inter-node stage: ``flows`` parallel rings per node, each over ``nbytes`` (shares the NIC)."""
    if nodes <= 1:
        return 0.0
    if topk_ratio is None:
        # Parallel rings advance in lock-step; per step the NIC carries every flow's chunk.
        per_ring = ring_allreduce_time(nodes, nbytes, params.alpha_inter, params.beta_inter * flows, params.gamma)
        return per_ring
    # Sparse all-gather: every node receives (N-1) * k (value, index) pairs per flow.
    elements = nbytes / wire
    sparse = topk_ratio * elements * (wire + _INDEX_BYTES)
    gather = (nodes - 1) * params.alpha_inter + (nodes - 1) * sparse * params.beta_inter * flows
    return gather + (nodes - 1) * sparse * params.gamma


def allreduce_time(
    algorithm: str,
    numel: float,
    topology: Topology,
    params: CommParams,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
) -> float:
    """Predicted seconds to all-reduce ``numel`` gradient elements with ``algorithm``.

    ``algorithm`` is ``"ring"``, ``"hier"`` or ``"torus2d"`` (see the module docstring for the
    closed forms and their sources). ``topk_ratio`` (0 < ratio <= 1) compresses the inter-node
    stage of ``hier`` / ``torus2d`` only.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
    if topk_ratio is not None and not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio={topk_ratio!r} must be in (0, 1]")
    wire = wire_bytes_per_element(wire_dtype)
    p1, nodes, world = topology.ranks_per_node, topology.nodes, topology.world_size
    if np.ndim(numel) == 0 and (world <= 1 or numel <= 0):
        return 0.0
    if world <= 1:
        return np.zeros_like(np.asarray(numel, dtype=float))
    n = np.asarray(numel, dtype=float) * wire if np.ndim(numel) else float(numel) * wire
    ai, bi, g = params.alpha_intra, params.beta_intra, params.gamma
    if algorithm == "ring":
        if nodes == 1:
            return ring_allreduce_time(p1, n, ai, bi, g)
        alpha = max(ai, params.alpha_inter) if p1 > 1 else params.alpha_inter
        step_bytes = n / world
        step = np.maximum(alpha + step_bytes * params.beta_inter, (ai + step_bytes * bi) if p1 > 1 else 0.0)
        return _scalar(2 * (world - 1) * step + (world - 1) / world * n * g)
    if algorithm == "hier":
        return _scalar(
            reduce_time(p1, n, ai, bi, g)
            + _inter_stage(nodes, n, 1, params, wire, topk_ratio)
            + broadcast_time(p1, n, ai, bi)
        )
    # torus2d
    return _scalar(
        reduce_scatter_time(p1, n, ai, bi, g)
        + _inter_stage(nodes, n / p1, p1, params, wire, topk_ratio)
        + allgather_time(p1, n, ai, bi)
    )


def _scalar(value):
    """Plain float for scalar inputs (JSON-friendly), the array otherwise."""
    return float(value) if np.ndim(value) == 0 else value


def predict_allreduce(
    numel: float,
    topology: Topology,
    params: CommParams,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    algorithms: tuple[str, ...] = ALGORITHMS,
) -> dict[str, float]:
    """Predicted all-reduce seconds of ``numel`` elements for each algorithm."""
    return {a: allreduce_time(a, numel, topology, params, wire_dtype, topk_ratio) for a in algorithms}


def choose_algorithm(
    params: "CommParams | object",
    message_bytes: float,
    topology: Topology | None = None,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    algorithms: tuple[str, ...] = ALGORITHMS,
) -> str:
    """The algorithm with the smallest predicted all-reduce time for ``message_bytes``.

    ``params`` is a :class:`CommParams` (then ``topology`` is required) or a
    :class:`~lightning_fastscale.planner.cluster.Cluster` (its own topology and parameters
    are used unless ``topology`` is given). ``message_bytes`` counts fp32 gradient bytes as
    held by the model (4 per element); the wire dtype is applied on top. Ties go to the
    simpler algorithm in the order ring, hier, torus2d. On a single node all three coincide
    up to the intra-node forms and ``ring`` is returned.
    """
    if not isinstance(params, CommParams):
        cluster = params
        params = cluster.comm_params()  # type: ignore[attr-defined]
        topology = topology or cluster.topology()  # type: ignore[attr-defined]
    if topology is None:
        raise ValueError("choose_algorithm needs `topology` when given bare CommParams")
    if topology.nodes == 1:
        return "ring"
    times = predict_allreduce(message_bytes / 4, topology, params, wire_dtype, topk_ratio, algorithms)
    return min(algorithms, key=lambda a: (times[a], algorithms.index(a)))
