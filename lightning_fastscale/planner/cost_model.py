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

from lightning_fastscale.strategies.options import ALGORITHMS as ALGORITHMS  # re-exported for the planner
from lightning_fastscale.strategies.options import CommSetting, check_algorithm, wire_bytes_per_element
from lightning_fastscale.strategies.topology import Topology

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
    """The flat all-reduce as DDP runs it, timed on a cluster: seconds per size in bytes on the wire.

    Interpolated between the sizes, extrapolated with a fitted latency + bandwidth line.
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

    Field by field in ``docs/planner.md`` ("The cost model in full").
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
        """Seconds per byte of each of ``flows`` concurrent flows leaving one node (at most ``beta_flow``)."""
        share = self.beta_inter if flows <= 1 or self.beta_inter_shared is None else self.beta_inter_shared
        return max(flows * share, self.beta_flow)

    def as_dict(self) -> dict:
        """The parameters as a plain dict (for JSON output and logging)."""
        out = asdict(self)
        out["flat_measured"] = None if self.flat_measured is None else self.flat_measured.as_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> CommParams:
        """The parameters back from `as_dict` (e.g. the doctor's JSON measurements).

        Examples:
            >>> flat = FlatMeasurement(2, 1, "gloo", (1e6, 4e6), (0.1, 0.3))
            >>> params = CommParams(1e-5, 1e-9, 2e-5, 8e-9, flat_measured=flat)
            >>> CommParams.from_dict(params.as_dict()) == params
            True
        """
        flat = data.get("flat_measured")
        return cls(**{**data, "flat_measured": flat and FlatMeasurement(
            flat["nodes"], flat["ranks_per_node"], flat["backend"], tuple(flat["sizes_bytes"]), tuple(flat["seconds"]),
            flat["wire_dtype"])})


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
    """Pipelined NCCL all-reduce: the busier of the NIC (``node_load``) and in-node links sets the rate."""
    x, world = np.asarray(nbytes, dtype=float), topology.world_size
    if world <= 1:
        return 0.0 * x
    beta = node_load * params.beta_inter
    if topology.ranks_per_node > 1:
        beta = max(beta, chain_load * params.beta_intra)
    return _scalar(latency + x * beta + (world - 1) / world * x * params.inter_gamma)


def nccl_ring_time(topology: Topology, nbytes, params: CommParams):
    """NCCL's topology-aware ring all-reduce of ``nbytes`` (on the wire) across ``topology``."""
    world, nodes = topology.world_size, topology.num_nodes
    steps, inter_steps = 2 * (world - 1), 2 * (nodes - 1)
    latency = (steps - inter_steps) * params.alpha_intra + inter_steps * params.alpha_inter
    load = 2 * (world - 1) / world
    return _nccl_time(topology, nbytes, params, latency, load if nodes > 1 else 0.0, load)


def nccl_tree_time(topology: Topology, nbytes, params: CommParams):
    """NCCL's tree all-reduce (chain in node, double binary tree between nodes) of ``nbytes`` on the wire."""
    nodes = topology.num_nodes
    hops = int(math.log2(nodes)) if nodes > 1 else 0
    latency = 2 * ((topology.ranks_per_node - 1) * params.alpha_intra + hops * params.alpha_inter)
    node_load = {1: 0.0, 2: 1.0, 3: 1.5}.get(nodes, 2.0)  # busiest node link, bytes per byte (docs/planner.md)
    return _nccl_time(topology, nbytes, params, latency, node_load, 1.0)


def flat_allreduce_detail(numel: float, topology: Topology, params: CommParams, wire_dtype: str = "fp32") -> dict:
    """How the flat all-reduce of ``numel`` elements is priced (model, measurement, NCCL ring and tree)."""
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
    """Seconds of each stage of ``algorithm`` on ``numel`` elements (a number or array), in the order they run."""
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
        # gloo's ring: the slowest edge sets each step's length
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

    ``chunk_numel`` pipelines the stages in chunks (``None``: one piece); the closed forms are in
    ``docs/planner.md`` ("The cost model in full").
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
    """The algorithm with the smallest predicted all-reduce time for ``message_bytes`` (fp32) under ``setting``.

    ``params`` is a `CommParams` (then ``topology`` is required) or a `Cluster`. Ties go to the
    simpler algorithm (flat, hier, torus2d); on one node ``flat`` is returned.
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
