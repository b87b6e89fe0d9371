"""What the planner predicts for the published large-scale settings, beside the published figures.

The cluster descriptions are the shipped ones (``lightning_fastscale/planner/clusters``), whose
figures are from the papers or marked as assumptions; nothing here is fitted to the published
results. Run::

    .venv/bin/python benchmarks/planner_literature.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_fastscale.planner.cluster import load_cluster  # noqa: E402
from lightning_fastscale.planner.cost_model import predict_allreduce  # noqa: E402
from lightning_fastscale.planner.profile import profile_model  # noqa: E402
from lightning_fastscale.planner.scaling import predict_step, topology_for  # noqa: E402


def efficiency_rows(cluster_name: str, algorithm: str, settings: list[tuple[int, int, float]]) -> list[str]:
    """Rows for (gpus, per-GPU batch, published efficiency) with the paper's algorithm."""
    cluster = load_cluster(cluster_name)
    w = cluster.workload
    rows = []
    for gpus, batch, published in settings:
        profile = profile_model(w.model, batch, w.input_size, cluster.device.sustained_tflops)
        cells = []
        for fusion in ("auto", "two", "ddp25", "single"):
            step = predict_step(profile, gpus, cluster.ranks_per_node, cluster.comm_params(), algorithm,
                                w.wire_dtype, w.topk_ratio, fusion)
            cells.append(f"{100 * step.efficiency:.2f}%")
        rows.append(f"| {cluster_name} | {w.model} | {gpus} | {batch} | {algorithm} | {100 * published:.2f}% | "
                    + " | ".join(cells) + " |")
    return rows


def horovod_rows() -> list[str]:
    """Torus vs flat ring on 32 nodes x 6 V100 with one 10 GbE NIC (BERT-Large)."""
    cluster = load_cluster("horovod_torus_10gbe")
    w = cluster.workload
    profile = profile_model(w.model, w.per_gpu_batch, w.input_size, cluster.device.sustained_tflops)
    gpus = cluster.nodes * cluster.ranks_per_node
    params = cluster.comm_params()
    one = predict_allreduce(profile.numel, topology_for(gpus, cluster.ranks_per_node), params, w.wire_dtype)
    steps = {a: predict_step(profile, gpus, cluster.ranks_per_node, params, a, w.wire_dtype, None, "auto").step_s
             for a in ("ring", "torus2d")}
    return [
        f"| horovod_torus_10gbe | bert_large | {gpus} | all-reduce of the whole gradient | 2.4x | "
        f"{one['ring'] / one['torus2d']:.2f}x |",
        f"| horovod_torus_10gbe | bert_large | {gpus} | training step (auto fusion) | 2.4x | "
        f"{steps['ring'] / steps['torus2d']:.2f}x |",
    ]


def main() -> None:
    """Print both tables."""
    print("| cluster | model | GPUs | per-GPU batch | algorithm | published | predicted (auto fusion) "
          "| two segments | DDP 25 MiB | one bucket |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in (efficiency_rows("tencent_p40_100g", "hier", [(1024, 64, 0.99), (2048, 32, 0.97)])
                + efficiency_rows("sony_v100_abci", "torus2d", [(1088, 32, 0.9162)])):
        print(row)
    print()
    print("| cluster | model | GPUs | what | published torus/ring | predicted torus/ring |")
    print("|---|---|---|---|---|---|")
    for row in horovod_rows():
        print(row)


if __name__ == "__main__":
    main()
