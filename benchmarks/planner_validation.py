"""Planner validation: predicted vs measured all-reduce times on the emulated cluster.

For each (nodes x ranks per node, link cap): build the emulated cluster, calibrate the
alpha-beta-gamma parameters from primitive collectives only (all-gather and all-reduce inside
a node and among node leaders: ``lightning_fastscale.planner.calibrate``), then, on a fresh
emulated cluster with the same cap, time the flat ring (``dist.all_reduce``), ``hier`` and
``torus2d`` of the strategy on several sizes (``lightning_fastscale.emulation.collectives``).
The composite algorithms are never used for fitting: their times are predictions.

Prints a markdown table (measured, predicted, relative error) and whether the algorithm the
planner picks is the measured fastest. Needs root (network namespaces). Example::

    .venv/bin/python benchmarks/planner_validation.py --configs 2x4:500 2x4:200 4x2:500 \
        --numels 1000000 4000000 16000000
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_fastscale.emulation.collectives import measure_allreduce  # noqa: E402
from lightning_fastscale.emulation.netns_cluster import EmulatedCluster  # noqa: E402
from lightning_fastscale.planner.calibrate import DEFAULT_SIZES  # noqa: E402
from lightning_fastscale.planner.cost_model import CommParams, Topology, predict_allreduce  # noqa: E402

# The measured name of each modelled algorithm: "flat" is plain dist.all_reduce (gloo's ring).
MEASURED = {"ring": "flat", "hier": "hier", "torus2d": "torus2d"}
_PORT = 29511


def calibrate_on_emulated(nodes: int, ranks_per_node: int, cap_mbit: float, sizes: list[int], reps: int) -> dict:
    """Run ``lightning_fastscale.planner.calibrate`` under torchrun on a fresh emulated cluster."""
    with tempfile.TemporaryDirectory(prefix="fastscale-calib-") as tmp:
        out = Path(tmp) / "calib.json"
        with EmulatedCluster(nodes, bandwidth_mbit=cap_mbit) as cluster:
            commands = [
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(i),
                 "--nproc_per_node", str(ranks_per_node), "--master_addr", cluster.nodes[0].address,
                 "--master_port", str(_PORT), "-m", "lightning_fastscale.planner.calibrate",
                 "--ranks-per-node", str(ranks_per_node), "--reps", str(reps), "--output", str(out),
                 "--sizes", *map(str, sizes)]
                for i in range(nodes)
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            ran = cluster.run(commands, timeout=900, env=env)
        if any(r.returncode for r in ran) or not out.exists():
            detail = "\n".join(f"--- node {r.node} rc={r.returncode}\n{(r.stderr or '')[-2000:]}" for r in ran)
            raise RuntimeError(f"calibration failed\n{detail}")
        return json.loads(out.read_text())


def validate(nodes: int, ranks_per_node: int, cap_mbit: float, numels: list[int], reps: int, calib_sizes: list[int]) -> list[dict]:
    """Calibrate, measure and predict one configuration; one row per (size, algorithm)."""
    calib = calibrate_on_emulated(nodes, ranks_per_node, cap_mbit, calib_sizes, reps)
    params = CommParams(**calib["params"])
    print(f"[{nodes}x{ranks_per_node} @ {cap_mbit} Mbit/s] calibrated: {params}", flush=True)
    measured = measure_allreduce(numels, list(MEASURED.values()), [cap_mbit], num_nodes=nodes,
                                 ranks_per_node=ranks_per_node, reps=reps)
    by_key = {(r["numel"], r["algorithm"]): r for r in measured["results"]}
    topology = Topology(nodes, ranks_per_node)
    rows = []
    for numel in numels:
        predicted = predict_allreduce(numel, topology, params)
        times = {a: by_key[(numel, MEASURED[a])]["median_s"] for a in MEASURED}
        picked = min(predicted, key=predicted.get)
        fastest = min(times, key=times.get)
        for algorithm in MEASURED:
            rows.append({
                "nodes": nodes, "ranks_per_node": ranks_per_node, "cap_mbit": cap_mbit, "numel": numel,
                "algorithm": algorithm, "measured_s": times[algorithm], "predicted_s": predicted[algorithm],
                "rel_error": predicted[algorithm] / times[algorithm] - 1.0,
                "picked": picked, "measured_fastest": fastest,
                "picked_is_fastest": picked == fastest,
                # Within measurement noise the "fastest" is not meaningful: report the margin.
                "picked_vs_fastest": times[picked] / times[fastest],
                "params": calib["params"],
            })
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table of :func:`validate` rows."""
    lines = ["| nodes x ranks | cap Mbit/s | numel | algorithm | measured s | predicted s | error | picked | measured fastest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['nodes']}x{r['ranks_per_node']} | {r['cap_mbit']:g} | {r['numel']} | {r['algorithm']} "
            f"| {r['measured_s']:.3f} | {r['predicted_s']:.3f} | {100 * r['rel_error']:+.0f}% | {r['picked']} "
            f"| {r['measured_fastest']} ({r['picked_vs_fastest']:.2f}x of it) |"
        )
    within = sum(abs(r["rel_error"]) <= 0.25 for r in rows)
    cases = {(r["nodes"], r["ranks_per_node"], r["cap_mbit"], r["numel"]): r for r in rows}
    right = sum(r["picked_is_fastest"] for r in cases.values())
    lines.append("")
    lines.append(f"within 25%: {within}/{len(rows)} predictions; picked = measured fastest: {right}/{len(cases)} cases")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse ``NODESxRANKS:CAP`` configurations, run them, print the table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["2x4:500", "2x4:200", "4x2:500"],
                        help="NODESxRANKS_PER_NODE:CAP_MBIT entries")
    parser.add_argument("--numels", type=int, nargs="+", default=[1_000_000, 4_000_000, 16_000_000])
    parser.add_argument("--calib-sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="calibration message sizes in bytes")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    rows = []
    for spec in args.configs:
        shape, _, cap = spec.partition(":")
        nodes, _, rpn = shape.partition("x")
        rows += validate(int(nodes), int(rpn), float(cap), args.numels, args.reps, args.calib_sizes)
        print(format_table(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
