"""Planner validation: predicted vs measured all-reduce times on the emulated cluster.

For each (nodes x ranks per node, link cap): build the emulated cluster, calibrate the
alpha-beta-gamma parameters from primitive collectives only (all-gather, all-reduce, reduce,
broadcast inside a node and among node leaders, and every rank's inter-node all-reduce at
once for the torus's concurrent flows: ``lightning_fastscale.planner.calibrate``), then, on a
fresh emulated cluster with the same cap, time ``flat``, ``hier`` and ``torus2d`` of the
strategy on several sizes (``lightning_fastscale.emulation.collectives``), unchunked and
pipelined in chunks (``flat@k``, ``hier@k``, ``torus2d@k``: the strategy's functions with
``chunk_numel``). The composite algorithms are never used for fitting: their
times are predictions.

Chunk counts: for every size, the count the strategy's default ``pipeline_chunk_mb`` gives
(``--chunk-mb``); every count is measured on every size, so the other (size, count) pairs are
extra checks of the pipelining formula at other chunk sizes. Predictions use the chunk size
actually measured (``ceil(numel / k)`` elements).

Prints a markdown table (measured median and range of the repetitions, predicted, relative
error) and whether the algorithm the planner picks is the measured fastest (by median), per
size and chunking. Two rules say whether a miss is more than noise:

- beyond the spread of the repetitions: the picked algorithm's fastest repetition is slower
  than the fastest algorithm's slowest one;
- beyond noise, paired: the algorithms are timed interleaved (every round runs each once, see
  :mod:`lightning_fastscale.emulation.collectives`), so round ``i`` of each was taken under
  nearly the same load. A miss is beyond noise when the measured fastest beat the picked
  algorithm in every round: a sign test, which two equally fast algorithms pass with
  probability ``0.5**rounds`` (3 % at 5 rounds; it cannot reject anything below 5 rounds at
  the 5 % level).

Per case it also reports the round wins of each algorithm and the median over rounds of the
picked algorithm's time over the round's fastest. Needs root (network namespaces). Example::

    .venv/bin/python benchmarks/planner_validation.py --configs 2x4:500 2x4:200 4x2:500 \
        --numels 1000000 4000000 16000000 --reps 5 --json results.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results_file  # noqa: E402
from planner_verdicts import case_key, format_across, predict_rows, refit_rows  # noqa: E402, F401  (format_across: --across)

from lightning_fastscale.emulation.collectives import measure_allreduce  # noqa: E402
from lightning_fastscale.emulation.netns_cluster import EmulatedCluster  # noqa: E402
from lightning_fastscale.planner.calibrate import DEFAULT_SIZES  # noqa: E402
from lightning_fastscale.planner.cost_model import CommParams  # noqa: E402
from lightning_fastscale.strategies.options import ALGORITHMS, WIRE_DTYPES, chunk_numel_for  # noqa: E402

CHUNK_MB = 4.0  # the strategy's "auto" chunk on 2 nodes; kept fixed across configs so runs compare
_PORT = 29511


def calibrate_on_emulated(nodes: int, ranks_per_node: int, cap_mbit: float, sizes: list[int], reps: int,
                          wire_dtype: str = "fp32") -> dict:
    """Run ``lightning_fastscale.planner.calibrate`` under torchrun on a fresh emulated cluster
    (inter-node level timed in ``wire_dtype``, as the planner calibrates for that dtype)."""
    with tempfile.TemporaryDirectory(prefix="fastscale-calib-") as tmp:
        out = Path(tmp) / "calib.json"
        with EmulatedCluster(nodes, bandwidth_mbit=cap_mbit) as cluster:
            commands = [
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(i),
                 "--nproc_per_node", str(ranks_per_node), "--master_addr", cluster.nodes[0].address,
                 "--master_port", str(_PORT), "-m", "lightning_fastscale.planner.calibrate",
                 "--ranks-per-node", str(ranks_per_node), "--reps", str(reps), "--output", str(out),
                 "--wire-dtype", wire_dtype,
                 "--sizes", *map(str, sizes)]
                for i in range(nodes)
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            ran = cluster.run(commands, timeout=900, env=env)
        if any(r.returncode for r in ran) or not out.exists():
            detail = "\n".join(f"--- node {r.node} rc={r.returncode}\n{(r.stderr or '')[-2000:]}" for r in ran)
            raise RuntimeError(f"calibration failed\n{detail}")
        return json.loads(out.read_text())


def chunk_counts(numels: list[int], chunk_mb: float | None) -> dict[int, int]:
    """Chunks the strategy's ``pipeline_chunk_mb`` splits each size into (only sizes > 1 chunk)."""
    if chunk_mb is None:
        return {}
    per_chunk = chunk_numel_for(chunk_mb)
    return {n: -(-n // per_chunk) for n in numels if n > per_chunk}


def validate(nodes: int, ranks_per_node: int, cap_mbit: float, numels: list[int], reps: int, calib_sizes: list[int],
             chunk_mb: float | None = CHUNK_MB, wire_dtype: str = "fp32") -> list[dict]:
    """Calibrate, measure and predict one configuration; one row per (size, chunks, algorithm).

    ``wire_dtype`` other than fp32 measures the strategy's functions with that ``wire_dtype``.
    """
    calib = calibrate_on_emulated(nodes, ranks_per_node, cap_mbit, calib_sizes, reps, wire_dtype)
    params = CommParams(**calib["params"])
    print(f"[{nodes}x{ranks_per_node} @ {cap_mbit} Mbit/s] calibrated: {params}", flush=True)
    default_chunks = chunk_counts(numels, chunk_mb)
    counts = sorted(set(default_chunks.values()))
    cast = "" if wire_dtype == "fp32" else f":{wire_dtype}"
    specs = {(a, 1): f"{a}{cast}" for a in ALGORITHMS}
    specs.update({(a, k): f"{a}{cast}@{k}" for a in ALGORITHMS for k in counts})
    measured = measure_allreduce(numels, list(specs.values()), [cap_mbit], num_nodes=nodes,
                                 ranks_per_node=ranks_per_node, reps=reps)
    by_key = {(r["numel"], r["algorithm"]): r for r in measured["results"]}
    rows = []
    for numel in numels:
        for k in [1, *counts]:
            for algorithm in ALGORITHMS:
                run = by_key[(numel, specs[(algorithm, k)])]
                rows.append({
                    "nodes": nodes, "ranks_per_node": ranks_per_node, "cap_mbit": cap_mbit, "numel": numel,
                    "chunks": k, "chunk_numel": None if k == 1 else -(-numel // k), "wire_dtype": wire_dtype,
                    "default_chunking": default_chunks.get(numel, 1) == k,
                    "algorithm": algorithm, "measured_as": specs[(algorithm, k)],
                    "measured_s": run["median_s"], "times_s": run["times_s"],
                    "interleaved": measured["config"].get("schedule") == "interleaved",
                    "params": calib["params"], "fits": calib.get("fits"),
                })
    return predict_rows(rows)


def format_table(rows: list[dict]) -> str:
    """Markdown table of :func:`validate` rows, then the within-25% and pick counts.

    Counts are given for all rows, for unchunked runs and for the strategy's default chunking
    (one chunk where the size is below the chunk size: those runs are the unchunked ones).
    """
    lines = ["| nodes x ranks | cap Mbit/s | wire | numel | chunks | algorithm | measured s (rep range) | predicted s "
             "| error | picked | measured fastest | round wins | picked / round's best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        chunks = f"{r['chunks']}" + (" (default)" if r["default_chunking"] and r["chunks"] > 1 else "")
        spread = ", beyond rep spread" if r["miss_beyond_spread"] else ""
        spread += ", beyond noise (paired)" if r.get("miss_beyond_noise") else ""
        lines.append(
            f"| {r['nodes']}x{r['ranks_per_node']} | {r['cap_mbit']:g} | {r.get('wire_dtype', 'fp32')} | {r['numel']} "
            f"| {chunks} | {r['algorithm']} "
            f"| {r['measured_s']:.3f} ({min(r['times_s']):.3f}-{max(r['times_s']):.3f}) | {r['predicted_s']:.3f} "
            f"| {100 * r['rel_error']:+.0f}% | {r['picked']} "
            f"| {r['measured_fastest']} ({r['picked_vs_fastest']:.2f}x of it{spread}) "
            f"| {_wins(r)} | {_round_ratio(r)} |"
        )
    lines.append("")
    subsets = {
        "all": rows,
        "unchunked": [r for r in rows if r["chunks"] == 1],
        "default chunking": [r for r in rows if r["default_chunking"]],
        "unchunked or default chunking": [r for r in rows if r["chunks"] == 1 or r["default_chunking"]],
        "other chunk sizes (smaller chunks than the default)": [
            r for r in rows if not (r["chunks"] == 1 or r["default_chunking"])],
    }
    for name, subset in subsets.items():
        if not subset:
            continue
        within = sum(abs(r["rel_error"]) <= 0.25 for r in subset)
        cases = {case_key(r): r for r in subset}
        right = sum(r["picked_is_fastest"] for r in cases.values())
        close = sum(r["picked_vs_fastest"] <= 1.05 for r in cases.values())
        clear = sum(r["miss_beyond_spread"] for r in cases.values())
        median = 100 * float(np.median([abs(r["rel_error"]) for r in subset]))
        lines.append(f"{name}: within 25%: {within}/{len(subset)} predictions (median |error| {median:.0f}%); "
                     f"picked = measured fastest: {right}/{len(cases)} cases ({close}/{len(cases)} within 5% "
                     f"of the fastest; {clear} misses beyond the spread of the repetitions)")
        if all("rounds" in r for r in cases.values()):
            rounds = sorted({r["rounds"] for r in cases.values()})
            noisy = sum(r["miss_beyond_noise"] for r in cases.values())
            most = sum(r["round_wins"][r["picked"]] == max(r["round_wins"].values()) for r in cases.values())
            paired_close = sum(r["picked_vs_round_best"] <= 1.05 for r in cases.values())
            lines.append(f"  paired ({'/'.join(map(str, rounds))} interleaved rounds): {len(cases) - right} misses, "
                         f"{len(cases) - right - noisy} within noise, {noisy} beyond noise (the fastest beat the "
                         f"pick in every round: p = {0.5 ** min(rounds):.0%} for two equally fast); picked won the most rounds (ties count): {most}/{len(cases)}; "
                         f"median picked / round's best <= 1.05: {paired_close}/{len(cases)}")
    return "\n".join(lines)


def _wins(row: dict) -> str:
    if "round_wins" not in row:
        return "n/a (not interleaved)"
    return " ".join(f"{a} {n}" for a, n in row["round_wins"].items()) + f" of {row['rounds']}"


def _round_ratio(row: dict) -> str:
    return f"{row['picked_vs_round_best']:.3f}x" if "picked_vs_round_best" in row else "n/a"


def format_compact(rows: list[dict], default_only: bool = True) -> str:
    """One line per case: measured / predicted seconds (error) per algorithm, pick and fastest.

    ``default_only``: only unchunked runs and the strategy's default chunking.
    """
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if default_only and not (r["chunks"] == 1 or r["default_chunking"]):
            continue
        cases.setdefault(case_key(r), {})[r["algorithm"]] = r
    lines = ["| nodes x ranks | Mbit/s | wire | numel | chunks | " + " | ".join(f"{a} meas / pred" for a in ALGORITHMS)
             + " | picked | measured fastest | round wins | picked / round's best |",
             "|---|---|---|---|---|" + "---|" * len(ALGORITHMS) + "---|---|---|---|"]
    for (nodes, ranks_per_node, cap, numel, chunks, wire), by_alg in cases.items():
        first = next(iter(by_alg.values()))
        cells = [f"{by_alg[a]['measured_s']:.3f} / {by_alg[a]['predicted_s']:.3f} ({100 * by_alg[a]['rel_error']:+.0f}%)"
                 for a in ALGORITHMS]
        spread = "beyond rep spread" if first["miss_beyond_spread"] else "within rep spread"
        if "miss_beyond_noise" in first:
            spread += ", beyond noise" if first["miss_beyond_noise"] else ", within noise"
        margin = "" if first["picked_is_fastest"] else f" ({first['picked_vs_fastest']:.2f}x faster, {spread})"
        lines.append(f"| {nodes}x{ranks_per_node} | {cap:g} | {wire} | {numel / 1e6:g}M | {chunks} | " + " | ".join(cells)
                     + f" | {first['picked']} | {first['measured_fastest']}{margin} | {_wins(first)} "
                     f"| {_round_ratio(first)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse ``NODESxRANKS:CAP`` configurations, run them, print the table (and JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["2x4:500", "2x4:200", "4x2:500"],
                        help="NODESxRANKS_PER_NODE:CAP_MBIT entries")
    parser.add_argument("--numels", type=int, nargs="+", default=[1_000_000, 4_000_000, 16_000_000])
    parser.add_argument("--calib-sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
                        help="calibration message sizes in bytes")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds (5: the paired sign test's 3 %%)")
    parser.add_argument("--chunk-mb", type=float, default=CHUNK_MB,
                        help="pipeline chunk in MiB whose chunk counts are measured (0: unchunked only)")
    parser.add_argument("--wire-dtype", choices=list(WIRE_DTYPES), default="fp32",
                        help="wire_dtype of the measured algorithms (cast on the inter-node stage)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    results_file.add_option(parser, "planner_validation")
    parser.add_argument("--from-json", help="measure nothing: re-predict the rows of an earlier --json file "
                        "with the current model (same calibrated parameters)")
    parser.add_argument("--refit", action="store_true", help="with --from-json: refit the parameters from the "
                        "stored calibration samples with the current fitting rules first")
    parser.add_argument("--across", nargs="+", metavar="JSON", help="measure nothing: compare several earlier "
                        "--json runs of one grid case by case (how often the measured fastest changed)")
    parser.add_argument("--compact", action="store_true", help="with --from-json: one line per case, unchunked "
                        "and default chunking only, then the counts")
    args = parser.parse_args(argv)
    if args.across:
        print(format_across([json.loads(Path(f).read_text()) for f in args.across]))
        return
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
        if args.refit:
            rows = refit_rows(rows)
            for key in sorted({(r["nodes"], r["ranks_per_node"], r["cap_mbit"]) for r in rows}):
                print(f"{key[0]}x{key[1]} @ {key[2]:g} Mbit/s refitted:",
                      next(r["params"] for r in rows if (r["nodes"], r["ranks_per_node"], r["cap_mbit"]) == key))
        rows = predict_rows(rows)
        table = format_table(rows)
        if args.compact:
            table = format_compact(rows) + "\n" + table[table.index("\n\n"):]
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    rows = []
    for spec in args.configs:
        shape, _, cap = spec.partition(":")
        nodes, _, ranks_per_node = shape.partition("x")
        rows += validate(int(nodes), int(ranks_per_node), float(cap), args.numels, args.reps, args.calib_sizes,
                         args.chunk_mb or None, args.wire_dtype)
        print(format_table(rows), flush=True)
        if args.json:  # after every configuration, so a later failure keeps the earlier ones
            Path(args.json).write_text(json.dumps(rows, indent=2))
    results_file.write(args.results, rows, [format_compact(rows).splitlines()])


if __name__ == "__main__":
    main()
