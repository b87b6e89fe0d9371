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
On top of the primitives, the three algorithms of the strategy
([`ALGORITHMS`][lightning_fastscale.planner.ALGORITHMS]):

* ``flat``: one flat ring over all ``P = nodes * ranks_per_node`` ranks, ordered node by
  node. Every step moves ``n/P`` bytes on every edge at once, so a step lasts as long as the
  slowest edge, each with its own latency: ``max(alpha_inter + n/P beta_inter, alpha_intra +
  n/P beta_intra)``, with one flow's ``beta_inter`` ([`CommParams.flow_beta`][lightning_fastscale.planner.CommParams.flow_beta]).
* ``hier`` (Jia et al. 2018, "Highly Scalable Deep Learning Training System with
  Mixed-Precision"): reduce inside the node, ring all-reduce among the node leaders,
  broadcast inside the node.
* ``torus2d`` (Mikami et al. 2018, "Massively Distributed SGD: ImageNet/ResNet-50 Training
  in a Flash"): reduce-scatter inside the node, all-reduce of each ``1/ranks_per_node``
  shard across nodes (``ranks_per_node`` rings in parallel sharing the NIC), all-gather
  inside the node.

On gloo the strategy runs the torus's in-node stages as concurrent per-shard reduces and
broadcasts, not as a reduce-scatter / all-gather; the model still prices them in the ring forms,
because inside the torus they overlap with the inter-node stage (a rank's own shard crosses as
soon as it is reduced), which a sum of separately fitted stages does not capture. How well
this prices the measured algorithms is in ``benchmarks/README.md`` (section "Planner against
measurement").

Each node must send (and receive) at least ``2(N-1)/N * n`` bytes over its link for any
all-reduce across ``N`` nodes: [`bandwidth_bound`][lightning_fastscale.planner.bandwidth_bound]. ``hier`` and ``torus2d`` reach that
byte count; the flat all-reduce sends ``2(P-1)/P * n``, i.e. ``(P-1)N / ((N-1)P)`` times more
(1.75x for 2 nodes x 4 ranks).

The wire dtype applies where the strategy casts: only the inter-node stage of ``hier`` /
``torus2d`` (sums inside a node stay in the gradients' fp32), the whole flat all-reduce once
there are several nodes (all of it crosses nodes), and the whole all-reduce on a single node.
Optional top-k compression (Tencent Cloud 2020; Lin et al. 2018, "Deep Gradient Compression") replaces the inter-node stage of
``hier`` / ``torus2d`` by an all-gather of ``ratio * numel`` (value, int32 index) pairs per
node: sparse vectors from different nodes do not add up in place, so a ring all-reduce of
them is not possible. The flat all-reduce has no separate inter-node stage and is not compressed.

Flows on the node link ([`CommParams.flow_beta`][lightning_fastscale.planner.CommParams.flow_beta]): ``beta_inter`` is what one flow per
node gets (the flat all-reduce's and the leaders' ring). The torus drives ``ranks_per_node`` flows
per node at once; ideally they share the link fairly (each at ``ranks_per_node * beta_inter``),
but concurrency can cost more (``beta_inter_shared``: measured on exactly that traffic by
`calibrate`), and one flow may be unable to fill the link
(``beta_flow``: a per-flow bandwidth limit, e.g. one TCP connection on a fast NIC), which
penalises the one-flow algorithms instead.

Chunk pipelining (``chunk_numel``): the strategy can split a bucket into chunks that flow
through the stages (in-node reduce, inter-node all-reduce, in-node broadcast) at once. With
``k`` chunks, each stage ``s`` costing ``lat_s + bw_s(bytes)``, the model charges every chunk
every stage's latency (``k * sum lat_s``: issuing and per-message overhead do not overlap), the
slowest stage's bandwidth term for the whole message, and the other stages' bandwidth terms
for one chunk each (pipeline fill and drain). One chunk gives the unchunked sum of the
stages; many chunks tend to the slowest stage alone plus the latencies. The flat all-reduce is
one stage: chunking it only adds latencies.

[`allreduce_time`][lightning_fastscale.planner.allreduce_time] accepts a numpy array of sizes as well as a number, so the fusion
planner can price every candidate bucket at once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from lightning_fastscale.strategies.options import (
    ALGORITHMS, canonical_algorithm, canonical_algorithms, wire_bytes_per_element,
)
from lightning_fastscale.strategies.topology import Topology

__all__ = [
    "ALGORITHMS",
    "CommParams",
    "Topology",
    "allgather_time",
    "allreduce_time",
    "bandwidth_bound",
    "broadcast_time",
    "choose_algorithm",
    "predict_allreduce",
    "stage_times",
    "reduce_scatter_time",
    "reduce_time",
    "ring_allreduce_time",
    "wire_bytes_per_element",
]

_INDEX_BYTES = 4  # top-k sends an int32 index with every value
_GRAD_BYTES = 4  # gradients (and the sums inside a node) are fp32


@dataclass(frozen=True)
class CommParams:
    """Link parameters in SI units: seconds per message (alpha), seconds per byte (beta).

    ``beta_inter`` is the seconds per byte of one node's inter-node link (1 / NIC bandwidth)
    as one flow per node sees it. ``beta_inter_shared`` (optional) is the same link's seconds
    per byte when each of the node's ranks drives its own flow at once (the torus stage);
    ``None`` means fair sharing at ``beta_inter``. ``beta_flow`` (optional, 0 = none) is the
    least seconds per byte one flow can reach (a per-flow bandwidth limit). ``gamma`` is
    seconds per byte reduced (the addition in reduce-scatter / all-reduce); ``gamma_inter``
    (optional, default ``gamma``) is the reduction cost still visible in an all-reduce between
    nodes, 0 where it overlaps the transfer (then ``beta_inter`` is the all-reduce's effective
    seconds per byte, as `calibrate` fits it).
    """

    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    gamma: float = 0.0
    beta_inter_shared: float | None = None
    beta_flow: float = 0.0
    gamma_inter: float | None = None

    def __post_init__(self) -> None:
        for name in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma", "beta_flow"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CommParams.{name}={value!r} must be a finite number >= 0")
        for name in ("beta_intra", "beta_inter"):
            if getattr(self, name) == 0:
                raise ValueError(
                    f"CommParams.{name}=0 means infinite bandwidth; give the link's real bandwidth"
                )
        if self.gamma_inter is not None and not (
            isinstance(self.gamma_inter, (int, float)) and math.isfinite(self.gamma_inter) and self.gamma_inter >= 0
        ):
            raise ValueError(f"CommParams.gamma_inter={self.gamma_inter!r} must be a finite number >= 0, or None")
        shared = self.beta_inter_shared
        if shared is not None and not (isinstance(shared, (int, float)) and math.isfinite(shared) and shared > 0):
            raise ValueError(
                f"CommParams.beta_inter_shared={shared!r} must be a finite number > 0, or None for fair sharing"
            )

    @property
    def inter_gamma(self) -> float:
        """Seconds per byte reduced that an all-reduce between nodes pays (``gamma_inter`` or ``gamma``)."""
        return self.gamma if self.gamma_inter is None else self.gamma_inter

    def flow_beta(self, flows: int) -> float:
        """Seconds per byte of each of ``flows`` concurrent flows leaving one node.

        One flow gets the link (``beta_inter``); several share it (``beta_inter_shared``, by
        default ``beta_inter``) equally; no flow is faster than the per-flow limit ``beta_flow``.
        """
        share = self.beta_inter if flows <= 1 or self.beta_inter_shared is None else self.beta_inter_shared
        return max(flows * share, self.beta_flow)

    def as_dict(self) -> dict[str, float]:
        """The parameters as a plain dict (for JSON output and logging)."""
        return asdict(self)


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
    nodes: int, nbytes, flows: int, params: CommParams, wire: int, topk_ratio: float | None
):
    """Inter-node stage: ``flows`` parallel rings per node, each over ``nbytes`` (they share the link)."""
    if nodes <= 1:
        return 0.0 * nbytes
    beta, gamma = params.flow_beta(flows), params.inter_gamma
    if topk_ratio is None:
        # Parallel rings advance in lock-step; each flow gets its share of the link.
        return ring_allreduce_time(nodes, nbytes, params.alpha_inter, beta, gamma)
    # Sparse all-gather: every node receives (N-1) * k (value, index) pairs per flow, then adds them.
    sparse = topk_ratio * (nbytes / wire) * (wire + _INDEX_BYTES)
    gather = (nodes - 1) * params.alpha_inter + (nodes - 1) * sparse * beta
    return gather + (nodes - 1) * sparse * params.gamma


def stage_times(
    algorithm: str,
    numel,
    topology: Topology,
    params: CommParams,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
) -> list:
    """Seconds of each stage of ``algorithm`` on ``numel`` elements, in the order they run.

    ``hier``: [reduce in node, leaders' all-reduce, broadcast in node]; ``torus2d``:
    [reduce-scatter in node, per-shard all-reduce across nodes, all-gather in node]; the flat
    all-reduce and any single-level case are one stage. Stages inside a node move fp32 (4 bytes per
    element); the inter-node stage (and a single-level all-reduce) moves ``wire_dtype``.
    ``numel`` may be a numpy array; zero elements give each stage's pure latency.
    """
    algorithm = canonical_algorithm(algorithm)
    if topk_ratio is not None and not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio={topk_ratio!r} must be in (0, 1]")
    wire = wire_bytes_per_element(wire_dtype)
    p1, nodes, world = topology.ranks_per_node, topology.num_nodes, topology.world_size
    elements = np.asarray(numel, dtype=float) if np.ndim(numel) else float(numel)
    if world <= 1:
        return [0.0 * elements]
    on_wire, in_node = elements * wire, elements * _GRAD_BYTES
    ai, bi, g = params.alpha_intra, params.beta_intra, params.gamma
    if nodes == 1:  # one all-reduce inside the node, all of it in the wire dtype
        return [ring_allreduce_time(p1, on_wire, ai, bi, g)]
    if algorithm == "flat":
        # Every step moves n/P bytes on every edge at once: the slowest edge, its own latency
        # plus its own transfer, sets the step's length.
        step_bytes = on_wire / world
        step = params.alpha_inter + step_bytes * params.flow_beta(1)
        if p1 > 1:
            step = np.maximum(step, ai + step_bytes * bi)
        return [2 * (world - 1) * step + (world - 1) / world * on_wire * params.inter_gamma]
    if p1 == 1:  # one rank per node: only the inter-node all-reduce
        return [_inter_stage(nodes, on_wire, 1, params, wire, topk_ratio)]
    if algorithm == "hier":
        return [
            reduce_time(p1, in_node, ai, bi, g),
            _inter_stage(nodes, on_wire, 1, params, wire, topk_ratio),
            broadcast_time(p1, in_node, ai, bi),
        ]
    return [  # torus2d
        reduce_scatter_time(p1, in_node, ai, bi, g),
        _inter_stage(nodes, on_wire / p1, p1, params, wire, topk_ratio),
        allgather_time(p1, in_node, ai, bi),
    ]


def allreduce_time(
    algorithm: str,
    numel: float,
    topology: Topology,
    params: CommParams,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    chunk_numel: float | None = None,
) -> float:
    """Predicted seconds to all-reduce ``numel`` gradient elements with ``algorithm``.

    ``algorithm`` is ``"flat"``, ``"hier"`` or ``"torus2d"`` (see the module docstring for the
    closed forms and their sources). ``topk_ratio`` (0 < ratio <= 1) compresses the inter-node
    stage of ``hier`` / ``torus2d`` only. ``chunk_numel`` pipelines the stages in chunks of
    that many elements (``None``: one piece); see the module docstring for the formula.
    """
    algorithm = canonical_algorithm(algorithm)
    stages = stage_times(algorithm, numel, topology, params, wire_dtype, topk_ratio)
    if np.ndim(numel) == 0 and (topology.world_size <= 1 or numel <= 0):
        return 0.0
    total = sum(stages)
    if chunk_numel is None:
        return _scalar(np.where(np.asarray(numel) > 0, total, 0.0))
    if not chunk_numel >= 1:
        raise ValueError(f"chunk_numel={chunk_numel!r} must be >= 1 (or None for no chunking)")
    elements = np.asarray(numel, dtype=float)
    chunks = np.maximum(1.0, np.ceil(elements / chunk_numel))
    chunk = np.minimum(elements, float(chunk_numel))
    latency = stage_times(algorithm, 0.0, topology, params, wire_dtype, topk_ratio)
    whole = np.stack([np.broadcast_to(t - lat, elements.shape) for t, lat in zip(stages, latency)])
    one = np.stack([np.broadcast_to(t - lat, elements.shape) for t, lat in
                    zip(stage_times(algorithm, chunk, topology, params, wire_dtype, topk_ratio), latency)])
    slowest = np.argmax(whole, axis=0)
    fill_drain = one.sum(axis=0) - np.take_along_axis(one, slowest[None], axis=0)[0]
    pipelined = chunks * sum(latency) + whole.max(axis=0) + fill_drain
    pipelined = np.where(elements > 0, pipelined, 0.0)
    return _scalar(pipelined)


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
    chunk_numel: float | None = None,
) -> dict[str, float]:
    """Predicted all-reduce seconds of ``numel`` elements for each algorithm."""
    algorithms = canonical_algorithms(algorithms)
    return {a: allreduce_time(a, numel, topology, params, wire_dtype, topk_ratio, chunk_numel) for a in algorithms}


def choose_algorithm(
    params: "CommParams | object",
    message_bytes: float,
    topology: Topology | None = None,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    algorithms: tuple[str, ...] = ALGORITHMS,
    chunk_numel: float | None = None,
) -> str:
    """The algorithm with the smallest predicted all-reduce time for ``message_bytes``.

    ``params`` is a [`CommParams`][lightning_fastscale.planner.CommParams] (then ``topology`` is required) or a
    [`Cluster`][lightning_fastscale.planner.Cluster] (its own topology and parameters
    are used unless ``topology`` is given). ``message_bytes`` counts fp32 gradient bytes as
    held by the model (4 per element); the wire dtype is applied on top. Ties go to the
    simpler algorithm in the order flat, hier, torus2d. On a single node all three are the
    same in-node all-reduce and ``flat`` is returned. ``chunk_numel``: as in [`allreduce_time`][lightning_fastscale.planner.allreduce_time].
    """
    if not isinstance(params, CommParams):
        cluster = params
        params = cluster.comm_params()  # type: ignore[attr-defined]
        topology = topology or cluster.topology()  # type: ignore[attr-defined]
    if topology is None:
        raise ValueError("choose_algorithm needs `topology` when given bare CommParams")
    algorithms = canonical_algorithms(algorithms)
    if topology.num_nodes == 1:
        return "flat"
    times = predict_allreduce(message_bytes / 4, topology, params, wire_dtype, topk_ratio, algorithms, chunk_numel)
    return min(algorithms, key=lambda a: (times[a], algorithms.index(a)))
