"""Predicted vs measured all-reduce times: the verdicts of the planner validation.

Rows come from ``planner_validation.py`` (one per configuration, size, chunking and
algorithm, each with its calibrated parameters and the interleaved repetitions of
`lightning_fastscale.emulation.collectives`). This module fills in the predictions and
says whether the planner's pick was the measured fastest, and whether a miss is more than noise:

- beyond the spread of the repetitions: the picked algorithm's fastest repetition is slower
  than the fastest algorithm's slowest one;
- beyond noise, paired: round ``i`` of every algorithm was taken under nearly the same load,
  so a miss is beyond noise when the measured fastest beat the pick in every round (a sign
  test, passed by two equally fast algorithms with probability ``0.5**rounds``).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from lightning_fastscale.planner.calibrate import INTER_PRIMITIVES, fit_calibration, intra_primitives
from lightning_fastscale.planner.cost_model import CommParams, CommSetting, Topology, predict_allreduce
from lightning_fastscale.strategies.options import MB


def refit_rows(rows: list[dict]) -> list[dict]:
    """Refit each configuration's parameters from its stored calibration samples with the
    current `fit_calibration` and primitive
    selection (gloo): the same measurements, the current fitting rules."""
    keep = {"intra": intra_primitives("gloo"), "inter": INTER_PRIMITIVES, "shared": ("allreduce",)}
    refitted: dict[tuple, dict] = {}
    for r in rows:
        key = (r["nodes"], r["ranks_per_node"], r["cap_mbit"], r.get("wire_dtype", "fp32"))
        if key not in refitted:
            fits = r["fits"] or {}
            samples = {
                level: {name: (fit["samples"][name]["sizes"], fit["samples"][name]["seconds"])
                        for name in keep[level] if name in fit["samples"]}
                for level, fit in fits.items() if fit
            }
            result = fit_calibration(r["ranks_per_node"], r["nodes"], samples.get("intra"), samples.get("inter"),
                                     samples.get("shared"))
            refitted[key] = result.params.as_dict()
        r["params"] = refitted[key]
    return rows


def case_key(row: dict) -> tuple:
    """The case a row belongs to: (nodes, ranks per node, cap, numel, chunks, wire dtype)."""
    return (row["nodes"], row["ranks_per_node"], row["cap_mbit"], row["numel"], row["chunks"],
            row.get("wire_dtype", "fp32"))


def predict_rows(rows: list[dict]) -> list[dict]:
    """Fill in each row's prediction (from its calibrated ``params``) and the pick per case."""
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault(case_key(r), []).append(r)
    for (nodes, ranks_per_node, _, numel, _, wire), case in cases.items():
        params = CommParams(**case[0]["params"])
        chunk = case[0]["chunk_numel"]  # as the strategy's option: elements of fp32 in MiB
        setting = CommSetting(None, wire, None, None if chunk is None else chunk * 4 / MB)
        predicted = predict_allreduce(numel, Topology(nodes, ranks_per_node), params, setting)
        times = {r["algorithm"]: r["measured_s"] for r in case}
        reps = {r["algorithm"]: r["times_s"] for r in case}
        picked = min(predicted, key=predicted.get)
        fastest = min(times, key=times.get)
        # A miss is clear only if the repetitions do not overlap: the picked algorithm's
        # fastest repetition is slower than the fastest algorithm's slowest one.
        clear_miss = picked != fastest and min(reps[picked]) > max(reps[fastest])
        paired = paired_stats(reps, picked, fastest) if all(r.get("interleaved") for r in case) else {}
        for r in case:
            r.update(
                predicted_s=predicted[r["algorithm"]],
                rel_error=predicted[r["algorithm"]] / r["measured_s"] - 1.0,
                picked=picked, measured_fastest=fastest, picked_is_fastest=picked == fastest,
                # Within measurement noise the "fastest" is not meaningful: report the margin.
                picked_vs_fastest=times[picked] / times[fastest],
                miss_beyond_spread=clear_miss,
                **paired,
            )
    return rows


def paired_stats(reps: dict[str, list[float]], picked: str, fastest: str) -> dict:
    """Round-by-round comparison of interleaved repetitions (``reps[a][i]``: round ``i``).

    ``round_wins``: rounds each algorithm was the fastest in; ``picked_vs_round_best``: median
    over rounds of the picked algorithm's time over that round's fastest; ``miss_beyond_noise``:
    the picked algorithm is not the measured fastest and lost to it in every round (sign test).
    """
    rounds = list(zip(*reps.values()))
    names = list(reps)
    wins = dict.fromkeys(names, 0)
    for times in rounds:
        wins[names[int(np.argmin(times))]] += 1
    ratios = [t[names.index(picked)] / min(t) for t in rounds]
    lost_every_round = all(p > f for p, f in zip(reps[picked], reps[fastest]))
    return dict(rounds=len(rounds), round_wins=wins, picked_vs_round_best=float(np.median(ratios)),
                miss_beyond_noise=picked != fastest and lost_every_round)


def format_across(runs: list[list[dict]]) -> str:
    """Across several runs of one grid: per case, how often each algorithm was the measured
    fastest and was picked; then in how many cases the fastest changed between runs, and how
    many (case, run) pairs the best fixed choice per case (the algorithm most often fastest,
    known only after all the runs) and the planner got right. Unchunked and default chunking."""
    fastest: dict[tuple, Counter] = {}
    picked: dict[tuple, Counter] = {}
    planner = pairs = 0
    for rows in runs:
        for key, r in {case_key(r): r for r in predict_rows(rows) if r["chunks"] == 1 or r["default_chunking"]}.items():
            fastest.setdefault(key, Counter())[r["measured_fastest"]] += 1
            picked.setdefault(key, Counter())[r["picked"]] += 1
            planner += r["picked_is_fastest"]
            pairs += 1
    lines = [f"{n}x{ranks_per_node} {cap:g} Mbit/s {wire} {numel / 1e6:g}M chunks {chunks}: fastest {dict(fastest[key])}, "
             f"picked {dict(picked[key])}" for key in fastest for n, ranks_per_node, cap, numel, chunks, wire in [key]]
    changed = sum(len(c) > 1 for c in fastest.values())
    best_fixed = sum(c.most_common(1)[0][1] for c in fastest.values())
    lines.append(f"{len(runs)} runs, {len(fastest)} cases: the measured fastest changed between runs in {changed}; "
                 f"(case, run) pairs right: best fixed choice per case {best_fixed}/{pairs}, planner {planner}/{pairs}")
    return "\n".join(lines)
