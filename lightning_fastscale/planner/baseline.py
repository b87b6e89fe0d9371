"""Every algorithm against the flat all-reduce plain DDP really runs (NCCL's ring or tree, or measured).

More in ``docs/planner.md`` ("The baseline: what plain DDP really runs").
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lightning_fastscale.planner.cost_model import (
    CommParams,
    Topology,
    allreduce_time,
    flat_allreduce_detail,
)
from lightning_fastscale.strategies.options import (
    ALGORITHMS,
    DEFAULT_PIPELINE_CHUNK_MB,
    check_algorithms,
    chunk_numel_for,
    wire_bytes_per_element,
)

PLAIN_DDP_TOLERANCE = 0.05
"""Plain DDP (no hook) is kept where its flat all-reduce is within this fraction of the best."""


def candidate_label(algorithm: str, wire_dtype: str = "fp32", topk_ratio: float | None = None) -> str:
    """The key of one candidate: ``"hier/fp16"``, ``"torus2d/fp32/topk0.01"``."""
    label = f"{algorithm}/{wire_dtype}"
    return label if topk_ratio is None else f"{label}/topk{topk_ratio:g}"


def compare_algorithms(
    numel: float,
    topology: Topology,
    params: CommParams,
    wire_dtypes: Sequence[str] = ("fp32",),
    topk_ratios: Sequence[float | None] = (None,),
    algorithms: Sequence[str] = ALGORITHMS,
    pipeline_chunk_mb: float | str | None = DEFAULT_PIPELINE_CHUNK_MB,
    measured: Mapping[str, float] | None = None,
    tolerance: float = PLAIN_DDP_TOLERANCE,
) -> dict:
    """Each algorithm x wire dtype x top-k ratio's time for one all-reduce of ``numel`` elements against plain DDP's.

    ``measured`` maps `candidate_label` keys to measured seconds, which replace the prediction.
    Returns plain data, each candidate with ``speedup_vs_flat`` (``docs/planner.md``).
    """
    if not tolerance >= 0:
        raise ValueError(f"tolerance={tolerance!r} must be >= 0 (a fraction: 0.05 is 5 %)")
    algorithms = check_algorithms(algorithms)
    for wire in wire_dtypes:
        wire_bytes_per_element(wire)
    measured = dict(measured or {})
    baseline = flat_allreduce_detail(numel, topology, params, "fp32")
    base_s = baseline["seconds"]
    chunk = chunk_numel_for(pipeline_chunk_mb, topology.num_nodes)
    candidates = []
    for algorithm in algorithms:
        for wire in wire_dtypes:
            for ratio in topk_ratios:
                if ratio is not None and algorithm == "flat":
                    continue  # the flat all-reduce has no inter-node stage to compress
                label = candidate_label(algorithm, wire, ratio)
                predicted = float(allreduce_time(algorithm, numel, topology, params, wire, ratio, chunk))
                seen = measured.pop(label, None)
                seconds = predicted if seen is None else float(seen)
                candidates.append({
                    "label": label, "algorithm": algorithm, "wire_dtype": wire, "topk_ratio": ratio,
                    "predicted_s": predicted, "measured_s": None if seen is None else float(seen),
                    "seconds": seconds, "speedup_vs_flat": base_s / seconds if seconds > 0 else math.inf,
                })
    if measured:
        raise ValueError(f"measured times for {sorted(measured)} match no candidate; candidates are "
                         f"{[c['label'] for c in candidates]}")
    best = min(candidates, key=lambda c: c["seconds"]) if candidates else None
    best_s = base_s if best is None else min(best["seconds"], base_s)
    return {
        "nodes": topology.num_nodes, "ranks_per_node": topology.ranks_per_node, "numel": float(numel),
        "backend": params.backend,
        "baseline": {"label": "flat/fp32 (plain DDP)", **baseline},
        "candidates": candidates,
        "best": None if best is None else best["label"],
        "best_speedup_vs_flat": None if best is None else best["speedup_vs_flat"],
        "plain_ddp": base_s <= (1 + tolerance) * best_s,
        "tolerance": tolerance,
    }


CROSSOVER_MODELS: dict[str, int] = {"resnet50": 25_557_032, "bert_large": 340_000_000}
"""Gradient elements (fp32) of the crossover table's models: ResNet-50 (torchvision's
25.6M parameters) and BERT-Large (Devlin et al. 2019, 340M)."""
CROSSOVER_NODES: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
CROSSOVER_GBIT_S: tuple[float, ...] = (10, 25, 100, 400)
CROSSOVER_RANKS_PER_NODE = 8
CROSSOVER_TOPK_RATIO = 0.01

CROSSOVER_ASSUMPTIONS: tuple[str, ...] = (
    "8 GPUs per node joined by NVLink at 1200 Gbit/s (150 GB/s) each way per GPU, 5 us per message",
    "one NIC per node at the given rate, shared by the node's 8 GPUs; 50 us per message at 10 and "
    "25 Gbit/s (TCP over Ethernet), 5 us at 100 and 400 Gbit/s (RDMA)",
    "additions hidden in the transfers (NCCL reduces inside its copy kernels): gamma = 0",
    "one all-reduce of the whole fp32 gradient, no overlap with backward; each algorithm in the better "
    "of the strategy's default chunks (2 MiB per node) and unchunked",
    "the baseline is NCCL's flat all-reduce as plain DDP runs it: the better of NCCL's ring and tree "
    "(no CollNet/SHARP, NVLS or PAT), both driving the NIC at its full rate",
    f"top-k keeps {CROSSOVER_TOPK_RATIO:g} of the elements (fp32 values, int32 indices) between nodes",
)
"""What [`crossover_table`][lightning_fastscale.planner.crossover_table] assumes (printed with the table and in the planner docs)."""


def crossover_params(gbit_s: float) -> CommParams:
    """NCCL link parameters of an 8-GPU NVLink node with one ``gbit_s`` NIC (`CROSSOVER_ASSUMPTIONS`)."""
    alpha_inter = 50e-6 if gbit_s < 100 else 5e-6
    return CommParams(alpha_intra=5e-6, beta_intra=8 / 1200e9, alpha_inter=alpha_inter, beta_inter=8 / (gbit_s * 1e9),
                      gamma=0.0, gamma_inter=0.0, backend="nccl")


def _best(comparison: dict, keep) -> dict:
    chosen = [c for c in comparison["candidates"] if keep(c)]
    return min(chosen, key=lambda c: c["seconds"])


def crossover_table(
    models: Mapping[str, int] = CROSSOVER_MODELS,
    nodes: Sequence[int] = CROSSOVER_NODES,
    gbit_s: Sequence[float] = CROSSOVER_GBIT_S,
    ranks_per_node: int = CROSSOVER_RANKS_PER_NODE,
    topk_ratio: float = CROSSOVER_TOPK_RATIO,
) -> list[dict]:
    """Speed-ups over NCCL's flat all-reduce per model, nodes and NIC rate (`CROSSOVER_ASSUMPTIONS`).

    One row per (model, NIC Gbit/s, nodes): ``hier`` and ``torus2d`` in fp32, the best with a
    16-bit wire and the best with top-k, each in the better of default chunks and unchunked.
    """
    rows = []
    for model, numel in models.items():
        for rate in gbit_s:
            params = crossover_params(rate)
            for n in nodes:
                topology = Topology(n, ranks_per_node)
                chunked, whole = (compare_algorithms(numel, topology, params, ("fp32", "fp16"), (None, topk_ratio),
                                                     pipeline_chunk_mb=chunk)
                                  for chunk in (DEFAULT_PIPELINE_CHUNK_MB, None))
                comparison = {**chunked, "candidates": [min(a, b, key=lambda c: c["seconds"]) for a, b in
                                                        zip(chunked["candidates"], whole["candidates"])]}
                by = {c["label"]: c for c in comparison["candidates"]}
                half = _best(comparison, lambda c: c["wire_dtype"] == "fp16" and c["topk_ratio"] is None)
                sparse = _best(comparison, lambda c: c["wire_dtype"] == "fp32" and c["topk_ratio"] is not None)
                base = comparison["baseline"]
                rows.append({
                    "model": model, "numel": numel, "gbit_s": rate, "nodes": n, "gpus": n * ranks_per_node,
                    "nccl_ring_s": base["nccl_ring_s"], "nccl_tree_s": base["nccl_tree_s"],
                    "baseline_s": base["seconds"],
                    "baseline": "tree" if base["nccl_tree_s"] < base["nccl_ring_s"] else "ring",
                    "hier": by["hier/fp32"]["speedup_vs_flat"],
                    "torus2d": by["torus2d/fp32"]["speedup_vs_flat"],
                    "wire16": half["speedup_vs_flat"], "wire16_algorithm": half["algorithm"],
                    "topk": sparse["speedup_vs_flat"], "topk_algorithm": sparse["algorithm"],
                    "topk_ratio": topk_ratio,
                })
    return rows


def format_crossover(rows: Sequence[dict]) -> str:
    """The crossover rows as a Markdown table (speed-ups against NCCL's flat all-reduce)."""
    lines = [
        "Speed-up over NCCL's flat all-reduce as plain DDP runs it (the better of NCCL's ring and tree; "
        "above 1: faster). Model, not measurement.",
        "",
        "| model | Gbit/s | nodes x 8 | NCCL ring ms | NCCL tree ms | baseline | hier | torus2d | "
        "16-bit wire (best) | top-k (best) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['gbit_s']:g} | {r['nodes']} | {r['nccl_ring_s'] * 1e3:.1f} | "
            f"{r['nccl_tree_s'] * 1e3:.1f} | {r['baseline']} | {r['hier']:.2f}x | {r['torus2d']:.2f}x | "
            f"{r['wire16']:.2f}x ({r['wire16_algorithm']}) | {r['topk']:.2f}x ({r['topk_algorithm']}) |"
        )
    lines += ["", "Assumptions:"] + [f"- {a}" for a in CROSSOVER_ASSUMPTIONS]
    return "\n".join(lines)
