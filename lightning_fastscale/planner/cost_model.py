"""Alpha-beta-gamma cost model of gradient all-reduce on a cluster of nodes x ranks per node.

The closed forms of Thakur, Rabenseifner & Gropp (IJHPCA 2005) for ring, reduce and broadcast,
over an intra-node and an inter-node link, price the strategy's algorithms: ``flat`` as gloo or
NCCL runs it, ``hier`` (Jia et al. 2018), ``torus2d`` (Mikami et al. 2018), with the wire dtype,
top-k compression and chunk pipelining. The derivations are in ``docs/planner.md`` ("The cost
model in full"), its accuracy against measurement in ``benchmarks/README.md``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from lightning_fastscale.strategies.options import (
    ALGORITHMS,
    CommSetting,
    check_algorithm,
    wire_bytes_per_element,
)
from lightning_fastscale.strategies.topology import Topology

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "CommParams",
    "CommSetting",
    "FlatMeasurement",
    "Topology",
    "allgather_time",
    "allreduce_time",
    "bandwidth_bound",
    "broadcast_time",
    "choose_algorithm",
    "flat_allreduce_detail",
    "nccl_ring_time",
    "nccl_tree_time",
    "predict_allreduce",
    "reduce_scatter_time",
    "reduce_time",
    "ring_allreduce_time",
    "stage_times",
    "wire_bytes_per_element",
]

_INDEX_BYTES = 4  # top-k sends an int32 index with every value
_GRAD_BYTES = 4  # gradients (and the sums inside a node) are fp32

BACKENDS: tuple[str, ...] = ("nccl", "gloo")
"""The torch.distributed backends whose flat all-reduce the model prices (``CommParams.backend``)."""


def _check_backend(backend: str, setting: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{setting}={backend!r}: choose one of {list(BACKENDS)} (nccl on GPUs, gloo on CPUs).")
    return backend


@dataclass(frozen=True)
class FlatMeasurement:
    """The flat all-reduce as DDP runs it, timed on a cluster: seconds per message size.

    ``sizes`` are bytes on the wire (elements x ``wire_dtype`` bytes), ``seconds`` the slowest
    rank's median time of a plain ``all_reduce`` on the world group with ``backend``, on
    ``nodes x ranks_per_node`` ranks. [`time`][lightning_fastscale.planner.FlatMeasurement.time] interpolates linearly between the measured
    sizes and extrapolates beyond them with a latency + bandwidth line fitted to all of them
    (both terms >= 0), so a measurement at the gradient's size prices exactly that size.
    """

    nodes: int
    ranks_per_node: int
    backend: str
    sizes: tuple[float, ...]
    seconds: tuple[float, ...]
    wire_dtype: str = "fp32"

    def __post_init__(self) -> None:
        _check_backend(self.backend, "FlatMeasurement.backend")
        wire_bytes_per_element(self.wire_dtype)
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"FlatMeasurement on {self.nodes} x {self.ranks_per_node} ranks: both must be >= 1")
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError(f"FlatMeasurement needs one time per size, got sizes={self.sizes!r}, seconds={self.seconds!r}")
        values = [*self.sizes, *self.seconds]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"FlatMeasurement sizes and seconds must be finite numbers > 0, got {values!r}")
        # Sorted by size, so interpolation works on any input order.
        order = sorted(range(len(self.sizes)), key=lambda i: self.sizes[i])
        object.__setattr__(self, "sizes", tuple(float(self.sizes[i]) for i in order))
        object.__setattr__(self, "seconds", tuple(float(self.seconds[i]) for i in order))

    @property
    def topology(self) -> Topology:
        """The topology the measurement was taken on."""
        return Topology(self.nodes, self.ranks_per_node)

    def applies_to(self, topology: Topology, wire_dtype: str = "fp32") -> bool:
        """True where this measurement, not the model, prices the flat all-reduce."""
        return topology == self.topology and wire_dtype == self.wire_dtype

    def line(self) -> tuple[float, float]:
        """``(alpha, beta)`` of the least-squares line ``alpha + beta * bytes`` through the samples (both >= 0)."""
        x, t = np.asarray(self.sizes), np.asarray(self.seconds)
        if len(x) == 1 or np.ptp(x) == 0:
            return 0.0, float(np.mean(t / x))
        beta, alpha = np.polyfit(x, t, 1)
        if alpha < 0 or beta <= 0:  # noise: keep a pure bandwidth term, or a pure latency one
            return (0.0, float(np.dot(x, t) / np.dot(x, x))) if beta > 0 else (float(np.mean(t)), 0.0)
        return float(alpha), float(beta)

    def time(self, nbytes):
        """Seconds for ``nbytes`` on the wire (a number or a numpy array)."""
        x = np.asarray(nbytes, dtype=float)
        alpha, beta = self.line()
        inside = np.interp(x, self.sizes, self.seconds)
        outside = alpha + beta * x
        result = np.where((x >= self.sizes[0]) & (x <= self.sizes[-1]), inside, outside)
        return _scalar(np.where(x > 0, result, 0.0))

    def as_dict(self) -> dict:
        """The measurement as plain data (the ``flat_allreduce`` section of a cluster file)."""
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "backend": self.backend,
                "wire_dtype": self.wire_dtype, "sizes_bytes": list(self.sizes), "seconds": list(self.seconds)}


@dataclass(frozen=True)
class CommParams:
    """Link parameters in SI units: seconds per message (alpha), per byte (beta), per byte reduced (gamma).

    ``beta_inter``: one node's inter-node link as one flow sees it; ``beta_inter_shared``: the
    same link when each of the node's ranks drives its own flow (the torus stage; ``None``: fair
    sharing); ``beta_flow``: the least seconds per byte one flow reaches (0: no limit);
    ``gamma_inter``: the reduction cost left visible between nodes (default ``gamma``; 0 where
    it overlaps the transfer). ``backend`` prices the flat all-reduce: ``"gloo"`` one ring over
    all ranks, ``"nccl"`` the better of NCCL's ring and tree; ``flat_measured``, where it
    applies, replaces that model. Field by field in ``docs/planner.md``.
    """

    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    gamma: float = 0.0
    beta_inter_shared: float | None = None
    beta_flow: float = 0.0
    gamma_inter: float | None = None
    backend: str = "gloo"
    flat_measured: FlatMeasurement | None = None

    def __post_init__(self) -> None:
        _check_backend(self.backend, "CommParams.backend")
        if self.flat_measured is not None and not isinstance(self.flat_measured, FlatMeasurement):
            raise ValueError(f"CommParams.flat_measured={self.flat_measured!r} must be a FlatMeasurement or None")
        for name in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma", "beta_flow", "gamma_inter",
                     "beta_inter_shared"):
            value, optional = getattr(self, name), name in ("gamma_inter", "beta_inter_shared")
            if not (optional and value is None or isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CommParams.{name}={value!r} must be a finite number >= 0" + (" or None" * optional))
            if value == 0 and name.startswith("beta_in"):
                raise ValueError(f"CommParams.{name}=0 means infinite bandwidth; give the link's real bandwidth")

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

    def as_dict(self) -> dict:
        """The parameters as a plain dict (for JSON output and logging)."""
        out = asdict(self)
        out["flat_measured"] = None if self.flat_measured is None else self.flat_measured.as_dict()
        return out


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


def _nccl_time(topology: Topology, nbytes, params: CommParams, latency: float, node_load: float, chain_load: float):
    """Pipelined, so the slowest link sets the rate: a node's NIC carries ``node_load`` bytes per
    byte all-reduced, each in-node link ``chain_load``."""
    x, world = np.asarray(nbytes, dtype=float), topology.world_size
    if world <= 1:
        return 0.0 * x
    beta = node_load * params.beta_inter
    if topology.ranks_per_node > 1:
        beta = max(beta, chain_load * params.beta_intra)
    return _scalar(latency + x * beta + (world - 1) / world * x * params.inter_gamma)


def nccl_ring_time(topology: Topology, nbytes, params: CommParams):
    """NCCL's ring all-reduce of ``nbytes`` (on the wire) across ``topology``.

    The ring leaves and enters every node once; every link carries ``2(P-1)/P * nbytes`` each
    way (nccl-tests' bus bandwidth factor); ``2(N-1)`` of its ``2(P-1)`` steps cross a node
    boundary (NCCL's tuning model). ``beta_inter`` is the node link under NCCL's channels.
    """
    world, nodes = topology.world_size, topology.num_nodes
    steps, inter_steps = 2 * (world - 1), 2 * (nodes - 1)
    latency = (steps - inter_steps) * params.alpha_intra + inter_steps * params.alpha_inter
    load = 2 * (world - 1) / world
    return _nccl_time(topology, nbytes, params, latency, load if nodes > 1 else 0.0, load)


def _tree_link_load(nodes: int) -> float:
    """Bytes each way on the busiest node link per byte all-reduced by NCCL's double binary tree.

    Each tree carries half the data; a node is an inner node in at most one tree and a leaf in
    the other: ``(3 + 1) / 2 = 2`` from 4 nodes on, 1 on 2 nodes, 1.5 on 3.
    """
    if nodes <= 1:
        return 0.0
    return {2: 1.0, 3: 1.5}.get(nodes, 2.0)


def nccl_tree_time(topology: Topology, nbytes, params: CommParams):
    """NCCL's tree all-reduce of ``nbytes`` (on the wire) across ``topology``.

    Reduce along a chain inside each node, double binary tree between nodes, broadcast along the
    chain (NCCL user guide); latency ``2 ((G-1) alpha_intra + floor(log2 N) alpha_inter)``.
    """
    nodes = topology.num_nodes
    hops = int(math.log2(nodes)) if nodes > 1 else 0
    latency = 2 * ((topology.ranks_per_node - 1) * params.alpha_intra + hops * params.alpha_inter)
    return _nccl_time(topology, nbytes, params, latency, _tree_link_load(nodes), 1.0)


def flat_allreduce_detail(numel: float, topology: Topology, params: CommParams, wire_dtype: str = "fp32") -> dict:
    """How the flat all-reduce of ``numel`` elements is priced: plain data for reports.

    ``{"backend", "seconds", "source" ("measured" or "model"), "model_s", "measured_s",
    "nccl_ring_s", "nccl_tree_s"}``; the NCCL entries are ``None`` on gloo, ``measured_s`` is
    ``None`` without an applicable measurement.
    """
    nbytes = float(numel) * wire_bytes_per_element(wire_dtype)
    model = replace(params, flat_measured=None)
    model_s = float(allreduce_time("flat", numel, topology, model, wire_dtype))
    measured = params.flat_measured
    measured_s = float(measured.time(nbytes)) if measured is not None and measured.applies_to(topology, wire_dtype) else None
    nccl = params.backend == "nccl" and topology.world_size > 1
    return {
        "backend": params.backend,
        "seconds": model_s if measured_s is None else measured_s,
        "source": "model" if measured_s is None else "measured",
        "model_s": model_s,
        "measured_s": measured_s,
        "nccl_ring_s": float(nccl_ring_time(topology, nbytes, params)) if nccl else None,
        "nccl_tree_s": float(nccl_tree_time(topology, nbytes, params)) if nccl else None,
    }


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
    algorithm = check_algorithm(algorithm)
    if topk_ratio is not None and not 0 < topk_ratio <= 1:
        raise ValueError(f"topk_ratio={topk_ratio!r} must be in (0, 1]")
    wire = wire_bytes_per_element(wire_dtype)
    ranks_per_node, nodes, world = topology.ranks_per_node, topology.num_nodes, topology.world_size
    elements = np.asarray(numel, dtype=float) if np.ndim(numel) else float(numel)
    if world <= 1:
        return [0.0 * elements]
    on_wire, in_node = elements * wire, elements * _GRAD_BYTES
    ai, bi, g = params.alpha_intra, params.beta_intra, params.gamma
    measured = params.flat_measured
    if algorithm == "flat" and measured is not None and measured.applies_to(topology, wire_dtype):
        return [measured.time(on_wire)]
    if nodes == 1:  # one all-reduce inside the node, all of it in the wire dtype
        return [ring_allreduce_time(ranks_per_node, on_wire, ai, bi, g)]
    if algorithm == "flat" and params.backend == "nccl":
        return [np.minimum(nccl_ring_time(topology, on_wire, params), nccl_tree_time(topology, on_wire, params))]
    if algorithm == "flat":
        # Every step moves n/P bytes on every edge at once: the slowest edge, its own latency
        # plus its own transfer, sets the step's length.
        step_bytes = on_wire / world
        step = params.alpha_inter + step_bytes * params.flow_beta(1)
        if ranks_per_node > 1:
            step = np.maximum(step, ai + step_bytes * bi)
        return [2 * (world - 1) * step + (world - 1) / world * on_wire * params.inter_gamma]
    if ranks_per_node == 1:  # one rank per node: only the inter-node all-reduce
        return [_inter_stage(nodes, on_wire, 1, params, wire, topk_ratio)]
    if algorithm == "hier":
        return [
            reduce_time(ranks_per_node, in_node, ai, bi, g),
            _inter_stage(nodes, on_wire, 1, params, wire, topk_ratio),
            broadcast_time(ranks_per_node, in_node, ai, bi),
        ]
    return [  # torus2d
        reduce_scatter_time(ranks_per_node, in_node, ai, bi, g),
        _inter_stage(nodes, on_wire / ranks_per_node, ranks_per_node, params, wire, topk_ratio),
        allgather_time(ranks_per_node, in_node, ai, bi),
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

    ``topk_ratio`` (0 < ratio <= 1) compresses the inter-node stage of ``hier`` / ``torus2d``;
    ``chunk_numel`` pipelines the stages in chunks of that many elements (``None``: one piece).
    The closed forms are in ``docs/planner.md`` ("The cost model in full").
    """
    algorithm = check_algorithm(algorithm)
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
    numel: float, topology: Topology, params: CommParams, setting: CommSetting = CommSetting(),
) -> dict[str, float]:
    """Predicted seconds to all-reduce ``numel`` elements with each of ``setting.candidates``."""
    chunk = setting.chunk_numel(topology.num_nodes)
    return {a: allreduce_time(a, numel, topology, params, setting.wire_dtype, setting.topk_ratio, chunk)
            for a in setting.candidates}


def choose_algorithm(
    params: "CommParams | object", message_bytes: float, topology: Topology | None = None,
    setting: CommSetting = CommSetting(),
) -> str:
    """The algorithm with the smallest predicted all-reduce time for ``message_bytes`` under ``setting``.

    ``params`` is a [`CommParams`][lightning_fastscale.planner.CommParams] (then ``topology`` is required) or a
    [`Cluster`][lightning_fastscale.planner.Cluster] (its own topology and parameters
    are used unless ``topology`` is given). ``message_bytes`` counts fp32 gradient bytes as
    held by the model (4 per element); the wire dtype is applied on top. Ties go to the
    simpler algorithm in the order flat, hier, torus2d. On a single node all three are the
    same in-node all-reduce and ``flat`` is returned.
    """
    if not isinstance(params, CommParams):
        cluster = params
        params = cluster.comm_params()  # type: ignore[attr-defined]
        topology = topology or cluster.topology()  # type: ignore[attr-defined]
    if topology is None:
        raise ValueError("choose_algorithm needs `topology` when given bare CommParams")
    if topology.num_nodes == 1:
        return "flat"
    times = predict_allreduce(message_bytes / 4, topology, params, setting)
    algorithms = setting.candidates
    return min(algorithms, key=lambda a: (times[a], algorithms.index(a)))
