"""Cluster descriptions for the planner: nodes x ranks, link speeds, device speed, workload.

More in ``docs/planner.md`` ("Cluster files").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_fastscale.planner.cost_model import (
    BACKENDS,
    CommParams,
    FlatMeasurement,
    Topology,
    wire_bytes_per_element,
)

CLUSTER_DIR = Path(__file__).with_name("clusters")


class ClusterConfigError(ValueError):
    """A cluster description is malformed; the message names the field and the fix."""


@dataclass(frozen=True)
class Link:
    """One link level: bandwidth in Gbit/s and per-message latency in microseconds (fields in ``docs/planner.md``)."""

    bandwidth_gbit_s: float
    latency_us: float
    per_flow_gbit_s: float | None = None
    shared_gbit_s: float | None = None
    reduction_hidden: bool = False

    @property
    def alpha(self) -> float:
        """Seconds per message."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 8.0 / (self.bandwidth_gbit_s * 1e9)


@dataclass(frozen=True)
class Device:
    """The accelerator: a name and the training FLOP/s (1e12) one rank sustains on the model."""

    name: str
    sustained_tflops: float


@dataclass(frozen=True)
class Workload:
    """What is trained: model name, per-rank batch, input size (pixels or tokens), wire dtype, top-k."""

    model: str = "resnet50"
    per_gpu_batch: int = 32
    input_size: int = 224
    wire_dtype: str = "fp32"
    topk_ratio: float | None = None


@dataclass(frozen=True)
class Cluster:
    """A cluster description (the YAML form is in ``docs/planner.md``, "Cluster files")."""

    name: str
    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    device: Device
    workload: Workload = field(default_factory=Workload)
    reduce_gbyte_s: float | None = None
    description: str = ""
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    published: tuple[dict, ...] = ()
    backend: str = "nccl"
    flat_allreduce: FlatMeasurement | None = None

    def topology(self, nodes: int | None = None) -> Topology:
        """The topology, optionally with another node count (for scaling curves)."""
        return Topology(self.nodes if nodes is None else nodes, self.ranks_per_node)

    def comm_params(self) -> CommParams:
        """The alpha-beta-gamma parameters in SI units."""
        gamma = 0.0 if self.reduce_gbyte_s is None else 1.0 / (self.reduce_gbyte_s * 1e9)
        flow = 0.0 if self.inter.per_flow_gbit_s is None else 8.0 / (self.inter.per_flow_gbit_s * 1e9)
        shared = None if self.inter.shared_gbit_s is None else 8.0 / (self.inter.shared_gbit_s * 1e9)
        return CommParams(self.intra.alpha, self.intra.beta, self.inter.alpha, self.inter.beta, gamma,
                          beta_inter_shared=shared, beta_flow=flow,
                          gamma_inter=0.0 if self.inter.reduction_hidden else None,
                          backend=self.backend, flat_measured=self.flat_allreduce)

    @classmethod
    def from_dict(cls, raw: Any, origin: str = "<dict>") -> "Cluster":
        """Validate ``raw`` (a parsed YAML mapping) and build a `Cluster`."""
        return _parse(raw, origin)


_TOP_KEYS = {
    "name", "description", "nodes", "gpus", "ranks_per_node", "intra", "inter", "reduce_gbyte_s",
    "device", "workload", "sources", "assumptions", "published", "backend", "flat_allreduce",
}
_FLAT_KEYS = {"nodes", "ranks_per_node", "backend", "wire_dtype", "sizes_bytes", "seconds"}
_LINK_KEYS = {"bandwidth_gbit_s", "latency_us"}
_INTER_KEYS = _LINK_KEYS | {"per_flow_gbit_s", "shared_gbit_s", "reduction_hidden"}
_DEVICE_KEYS = {"name", "sustained_tflops"}
_WORKLOAD_KEYS = {"model", "per_gpu_batch", "input_size", "wire_dtype", "topk_ratio"}


def _fail(origin: str, path: str, message: str) -> ClusterConfigError:
    return ClusterConfigError(f"cluster description {origin}: `{path}` {message}")


def _mapping(raw: Any, origin: str, path: str, allowed: set[str]) -> dict:
    if not isinstance(raw, dict):
        raise _fail(origin, path, f"must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise _fail(origin, path, f"has unknown keys {unknown}; allowed keys are {sorted(allowed)}")
    return raw


def _positive(raw: dict, key: str, origin: str, path: str, what: str, allow_zero: bool = False) -> float:
    if key not in raw:
        raise _fail(origin, f"{path}{key}", f"is missing: give {what}")
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(origin, f"{path}{key}", f"={value!r} must be a number ({what})")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise _fail(origin, f"{path}{key}", f"={value!r} must be {bound} ({what})")
    return float(value)


def _count(raw: dict, key: str, origin: str, path: str = "") -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(origin, f"{path}{key}", f"={value!r} must be an integer >= 1")
    return value


def _link(raw: Any, origin: str, key: str) -> Link:
    raw = _mapping(raw, origin, key, _INTER_KEYS if key == "inter" else _LINK_KEYS)
    optional = {
        name: _positive(raw, name, origin, f"{key}.", what)
        for name, what in (("per_flow_gbit_s", "the most one flow reaches, in Gbit/s"),
                           ("shared_gbit_s", "the link's total under one flow per rank, in Gbit/s"))
        if raw.get(name) is not None
    }
    if "reduction_hidden" in raw:
        if not isinstance(raw["reduction_hidden"], bool):
            raise _fail(origin, f"{key}.reduction_hidden", f"={raw['reduction_hidden']!r} must be true or false")
        optional["reduction_hidden"] = raw["reduction_hidden"]
    return Link(
        _positive(raw, "bandwidth_gbit_s", origin, f"{key}.", "the link bandwidth in Gbit/s"),
        _positive(raw, "latency_us", origin, f"{key}.", "the per-message latency in microseconds", allow_zero=True),
        **optional,
    )


def _strings(raw: Any, origin: str, key: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, str) for s in raw):
        raise _fail(origin, key, "must be a list of strings")
    return tuple(raw)


def _backend(raw: dict, origin: str) -> str:
    if "backend" not in raw:
        raise _fail(origin, "backend", f"is missing: give {' or '.join(BACKENDS)} (what the flat all-reduce "
                    "of plain DDP runs on: nccl on GPUs, gloo on CPUs)")
    if raw["backend"] not in BACKENDS:
        raise _fail(origin, "backend", f"={raw['backend']!r} must be one of {list(BACKENDS)}")
    return raw["backend"]


def _flat(raw: Any, origin: str, backend: str, nodes: int, ranks_per_node: int) -> FlatMeasurement | None:
    if raw is None:
        return None
    raw = _mapping(raw, origin, "flat_allreduce", _FLAT_KEYS)
    missing = sorted({"sizes_bytes", "seconds"} - set(raw))
    if missing:
        raise _fail(origin, "flat_allreduce", f"is missing {missing}: give the measured sizes in bytes and seconds "
                    "(the calibration's flat_allreduce output)")
    if raw.get("backend", backend) != backend:
        raise _fail(origin, "flat_allreduce.backend", f"={raw['backend']!r} differs from backend={backend!r}: "
                    "the measurement belongs to another backend")
    try:
        return FlatMeasurement(
            int(raw.get("nodes", nodes)), int(raw.get("ranks_per_node", ranks_per_node)), backend,
            tuple(raw["sizes_bytes"]), tuple(raw["seconds"]), raw.get("wire_dtype", "fp32"),
        )
    except (TypeError, ValueError) as err:
        raise _fail(origin, "flat_allreduce", str(err)) from None


def _parse(raw: Any, origin: str) -> Cluster:
    raw = _mapping(raw, origin, "<top level>", _TOP_KEYS)
    for key in ("intra", "inter", "device"):
        if key not in raw:
            raise _fail(origin, key, "is missing")
    backend = _backend(raw, origin)
    ranks_per_node = _count(raw, "ranks_per_node", origin)
    if "gpus" in raw:
        gpus = _count(raw, "gpus", origin)
        if gpus % ranks_per_node:
            raise _fail(
                origin, "gpus",
                f"={gpus} is not a multiple of ranks_per_node={ranks_per_node}: every node must "
                "hold the same number of ranks (change gpus or ranks_per_node)",
            )
        nodes = gpus // ranks_per_node
        if "nodes" in raw and _count(raw, "nodes", origin) != nodes:
            raise _fail(
                origin, "nodes",
                f"={raw['nodes']} disagrees with gpus={gpus} / ranks_per_node={ranks_per_node} = {nodes}; give one of them",
            )
    else:
        nodes = _count(raw, "nodes", origin)
    device_raw = _mapping(raw["device"], origin, "device", _DEVICE_KEYS)
    device = Device(
        str(device_raw.get("name", "")),
        _positive(device_raw, "sustained_tflops", origin, "device.", "the training TFLOP/s one rank sustains"),
    )
    work_raw = _mapping(raw.get("workload", {}) or {}, origin, "workload", _WORKLOAD_KEYS)
    workload = Workload(**work_raw)
    if not isinstance(workload.model, str) or not workload.model:
        raise _fail(origin, "workload.model", f"={workload.model!r} must be a model name")
    for key in ("per_gpu_batch", "input_size"):
        if key in work_raw:
            _count(work_raw, key, origin, "workload.")
    try:
        wire_bytes_per_element(workload.wire_dtype)
    except ValueError as err:
        raise _fail(origin, "workload.wire_dtype", str(err)) from None
    if workload.topk_ratio is not None:
        ratio = workload.topk_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise _fail(origin, "workload.topk_ratio", f"={ratio!r} must be in (0, 1] or null")
    reduce = None
    if raw.get("reduce_gbyte_s") is not None:
        reduce = _positive(raw, "reduce_gbyte_s", origin, "", "the reduction speed in GB/s")
    published = raw.get("published") or []
    if not isinstance(published, list) or not all(isinstance(p, dict) for p in published):
        raise _fail(origin, "published", "must be a list of mappings")
    return Cluster(
        name=str(raw.get("name", Path(origin).stem)),
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        intra=_link(raw["intra"], origin, "intra"),
        inter=_link(raw["inter"], origin, "inter"),
        device=device,
        workload=workload,
        reduce_gbyte_s=reduce,
        description=str(raw.get("description", "")),
        sources=_strings(raw.get("sources"), origin, "sources"),
        assumptions=_strings(raw.get("assumptions"), origin, "assumptions"),
        published=tuple(published),
        backend=backend,
        flat_allreduce=_flat(raw.get("flat_allreduce"), origin, backend, nodes, ranks_per_node),
    )


def available_clusters() -> list[str]:
    """Names of the cluster descriptions shipped with the package."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """Load a cluster description by shipped name (``"tencent_p40_100g"``) or YAML path."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = CLUSTER_DIR / f"{name_or_path}.yaml"
        if not shipped.is_file():
            raise ClusterConfigError(
                f"cluster {str(name_or_path)!r} is neither a YAML file nor a shipped description; "
                f"shipped: {available_clusters()}"
            )
        path = shipped
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ClusterConfigError(f"cluster description {path}: not valid YAML: {err}") from None
    return _parse(raw, str(path))
