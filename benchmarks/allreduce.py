"""All-reduce of a ResNet-50-sized gradient on an emulated 2-node cluster: flat vs hier vs torus.

Builds 2 emulated nodes (network namespaces, each node's link capped with ``tbf``), launches
``torchrun --nnodes 2 --node_rank i --nproc_per_node 4`` on each, and times every algorithm on
a 25.6M-element fp32 tensor (ResNet-50's gradient). Prints, per cap: median time, speed-up
over the flat all-reduce measured in the same run, and the fraction of the bandwidth bound
2(N-1)/N * M / B reached (M = fp32 bytes, so fp16/top-k on the wire can exceed 100%).

Needs root (network namespaces). Example::

    sudo .venv/bin/python benchmarks/allreduce.py --caps 500 200
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results_file  # noqa: E402

from lightning_fastscale.emulation.collectives import measure_allreduce  # noqa: E402

DEFAULT_ALGORITHMS = [
    "flat", "hier@1", "torus2d@1", "hier@4mb", "torus2d@4mb", "hier:fp16@4mb", "torus2d:fp16@4mb",
    "hier_topk@4mb",
]


def format_table(report: dict) -> str:
    """Markdown table of a :func:`measure_allreduce` report."""
    lines = [
        "| cap Mbit/s | numel | algorithm | median s | reps s | x flat | % of bound | rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        ratio = "-" if r["ratio_vs_flat"] is None else f"{r['ratio_vs_flat']:.2f}"
        frac = "-" if r["bound_fraction"] is None else f"{100 * r['bound_fraction']:.0f}%"
        reps = " ".join(f"{t:.2f}" for t in r["times_s"])
        lines.append(
            f"| {r['cap_mbit']} | {r['numel']} | {r['algorithm']} | {r['median_s']:.3f} | {reps} "
            f"| {ratio} | {frac} | {r['rel_error']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, print the table and write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", type=float, nargs="+", default=[500.0, 200.0],
                        help="per-node link caps in Mbit/s (each direction)")
    parser.add_argument("--numel", type=int, default=25_600_000, help="elements (fp32) to all-reduce")
    parser.add_argument("--algorithms", nargs="+", default=DEFAULT_ALGORITHMS,
                        help="name[:fp32|fp16|bf16][@chunks|@<MiB>mb]; names: flat hier torus2d hier_topk "
                        "torus2d_topk (see lightning_fastscale.emulation.collectives); 4mb is the "
                        "strategy's default pipeline_chunk_mb")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per cap")
    results_file.add_option(parser, "allreduce")
    args = parser.parse_args(argv)
    report = measure_allreduce(
        [args.numel], args.algorithms, args.caps, num_nodes=args.nodes,
        ranks_per_node=args.ranks_per_node, reps=args.reps,
        topk_ratio=args.topk_ratio, timeout_s=args.timeout,
    )
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs; "
          f"{args.nodes} nodes x {args.ranks_per_node} ranks, gloo; bound = 2(N-1)/N*M/B, M = {4 * args.numel / 1e6:.1f} MB")
    print(format_table(report))
    results_file.write(args.results, report)


if __name__ == "__main__":
    main()
