"""What the planner predicts for the published large-scale settings, beside the published figures.

The cluster descriptions are the shipped ones (``lightning_fastscale/planner/clusters``), whose
figures are from the papers or marked as assumptions; nothing here is fitted to the published
results. Predictions are for buckets pipelined in the strategy's default chunks, and without
chunking for comparison. The Horovod table adds what a per-flow bandwidth limit (one flow not
filling the 10 GbE NIC; the shipped description has none, as no source gives it) would change:
a sensitivity, not a fit. Run::

    .venv/bin/python benchmarks/planner_literature.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
from dataclasses import replace  # noqa: E402

import results_file  # noqa: E402

from lightning_fastscale.planner.cluster import load_cluster  # noqa: E402
from lightning_fastscale.planner.cost_model import predict_allreduce  # noqa: E402
from lightning_fastscale.planner.profile import profile_model  # noqa: E402
from lightning_fastscale.planner.scaling import predict_step, topology_for  # noqa: E402
from lightning_fastscale.strategies.options import DEFAULT_PIPELINE_CHUNK_MB, CommSetting  # noqa: E402

CHUNK = DEFAULT_PIPELINE_CHUNK_MB


def efficiency_rows(cluster_name: str, algorithm: str, settings: list[tuple[int, int, float]]) -> list[str]:
    """Rows for (gpus, per-GPU batch, published efficiency) with the paper's algorithm."""
    cluster = load_cluster(cluster_name)
    w = cluster.workload
    rows = []
    for gpus, batch, published in settings:
        profile = profile_model(w.model, batch, w.input_size, cluster.device.sustained_tflops)
        cells = []
        for fusion, chunk in (("auto", CHUNK), ("auto", None), ("two", CHUNK), ("ddp25", CHUNK), ("single", CHUNK)):
            setting = CommSetting(None, w.wire_dtype, w.topk_ratio, chunk)
            step = predict_step(profile, gpus, cluster.ranks_per_node, cluster.comm_params(), algorithm, setting, fusion)
            cells.append(f"{100 * step.efficiency:.2f}%")
        rows.append(f"| {cluster_name} | {w.model} | {gpus} | {batch} | {algorithm} | {100 * published:.2f}% | "
                    + " | ".join(cells) + " |")
    return rows


def horovod_rows(per_flow_gbit_s: tuple[float | None, ...] = (None, 7.5, 5.0, 2.5)) -> list[str]:
    """Torus vs flat all-reduce on 32 nodes x 6 V100 with one 10 GbE NIC (BERT-Large).

    ``per_flow_gbit_s``: the shipped description (``None``: no per-flow limit), then the same
    cluster with one flow capped at each given rate (sensitivity of the per-flow model). The
    published 2.4x is against a flat ring: the first columns price that (one ring over all
    ranks, as gloo runs it); the last two hold the torus against NCCL's own ring or tree, which
    plain DDP runs on this cluster.
    """
    cluster = load_cluster("horovod_torus_10gbe")
    w = cluster.workload
    profile = profile_model(w.model, w.per_gpu_batch, w.input_size, cluster.device.sustained_tflops)
    gpus = cluster.nodes * cluster.ranks_per_node
    topology = topology_for(gpus, cluster.ranks_per_node)
    rows = []
    for limit in per_flow_gbit_s:
        params = cluster.comm_params()
        if limit is not None:
            params = replace(params, beta_flow=8.0 / (limit * 1e9))
        label = "none (shipped file)" if limit is None else f"{limit:g} Gbit/s (sensitivity)"
        cells = []
        for chunk, flat_params in ((CHUNK, replace(params, backend="gloo")), (None, replace(params, backend="gloo")),
                                   (CHUNK, params)):
            setting = CommSetting(None, w.wire_dtype, None, chunk)
            one = predict_allreduce(profile.numel, topology, flat_params, setting)
            steps = {a: predict_step(profile, gpus, cluster.ranks_per_node, flat_params, a, setting).step_s
                     for a in ("flat", "torus2d")}
            cells += [f"{one['flat'] / one['torus2d']:.2f}x", f"{steps['flat'] / steps['torus2d']:.2f}x"]
        rows.append(f"| horovod_torus_10gbe | bert_large | {gpus} | {label} | 2.4x | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    """Print both tables and write them to the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    results_file.add_option(parser, "planner_literature")
    args = parser.parse_args()
    first = [f"| cluster | model | GPUs | per-GPU batch | algorithm | published | predicted (auto fusion, {CHUNK} "
          "chunks: 2 MiB x nodes) | auto fusion, unchunked | two segments | DDP 25 MiB | one bucket |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             *efficiency_rows("tencent_p40_100g", "hier", [(1024, 64, 0.99), (2048, 32, 0.97)]),
             *efficiency_rows("sony_v100_abci", "torus2d", [(1088, 32, 0.9162)])]
    second = [f"| cluster | model | GPUs | per-flow limit | published torus/ring | vs flat ring: all-reduce ({CHUNK} chunks) "
          f"| step ({CHUNK} chunks) | all-reduce (unchunked) | step (unchunked) "
              f"| vs NCCL ring/tree: all-reduce ({CHUNK} chunks) | step ({CHUNK} chunks) |",
              "|---|---|---|---|---|---|---|---|---|---|---|", *horovod_rows()]
    print("\n".join(first) + "\n\n" + "\n".join(second))
    results_file.write(args.results, None, [first, second])


if __name__ == "__main__":
    main()
