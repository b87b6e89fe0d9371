"""The doctor's report: the console text, the PNG and ``doctor.json`` of a [`Diagnosis`][lightning_fastscale.diagnostics.doctor.Diagnosis]."""
from __future__ import annotations

import json
from pathlib import Path

from lightning_fastscale.diagnostics.doctor import (
    FLAT,
    PLAIN_DDP_TOLERANCE,
    Diagnosis,
    compressed_wire_note,
    large_batch_note,
    plain_ddp_within,
    smaller_images_note,
)
from lightning_fastscale.diagnostics.step_breakdown import PHASE_COLORS, PHASES, VERDICTS

__all__ = ["dumps", "plot_report", "render_report"]


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def render_report(d: Diagnosis) -> str:
    """The console report: verdict, breakdown (median and slowest rank), measurements, fixes."""
    m, v = d.measurements, d.verdict
    slowest = m.breakdown().slowest_rank
    where = f"{m.num_nodes} node(s) x {m.ranks_per_node}, {m.backend}" if m.world_size > 1 else "one process"
    lines = [f"fastscale-doctor: {m.world_size} rank(s) on {where}",
             "", "bottleneck: " + ("INPUT OR COMPUTE: TOO CLOSE TO CALL" if v.too_close_to_call else v.bottleneck.upper()),
             f"  {v.reason}", *(f"  note: {n}" for n in d.notes), ""]
    lines.append(f"step breakdown (per step)        median rank   slowest rank ({slowest})")
    lines += [f"  {part:<30}{_fmt_s(m.median_part(part))}    {_fmt_s(m.parts[slowest].get(part, 0.0))}" for part in PHASES]
    lines.append(f"  {'step':<30}{_fmt_s(m.step_s)}    {_fmt_s(m.rank_step_s(slowest))}")
    lines.append(f"  samples/s (all ranks)         {m.batch_size * m.world_size / m.step_s:10.1f}")
    lines += ["", "seconds per step each cause accounts for:"]
    lines += [f"  {b:<30}{_fmt_s(v.seconds[b])}" for b in VERDICTS]
    lines += ["", "measured:"]
    if m.compute_alone_s is not None:
        runs = m.compute_alone_runs_s
        spread = f" (median of {len(runs)}, {_fmt_s(min(runs)).strip()} to {_fmt_s(max(runs)).strip()})" if len(runs) > 1 else ""
        threads = f", {m.threads} thread(s)" if m.threads else ""
        lines.append(f"  compute alone (device-resident batch of {m.batch_size}{threads}): {_fmt_s(m.compute_alone_s)}{spread}")
        if m.compute_alone_one_thread_s is not None:
            lines.append(f"    on 1 thread: {_fmt_s(m.compute_alone_one_thread_s)}")
        lines += [f"    with {overrides}: {_fmt_s(t)}" for overrides, t in m.compute_variants.items()]
    if m.allreduce_s:
        predicted = (m.planner or {}).get("predicted_s", {})
        lines.append(f"  all-reduce of the {m.grad_bytes / 2**20:.1f} MiB gradient (configured: {m.configured_allreduce})"
                     + (", measured | planner on the calibrated link:" if predicted else ":"))
        for label, t in sorted(m.allreduce_s.items(), key=lambda kv: kv[1]):
            model = f" | {_fmt_s(predicted[label])}" if label in predicted else ""
            lines.append(f"    {label:<28}{_fmt_s(t)}{model}")
        if FLAT in m.allreduce_s:
            within = plain_ddp_within(m)
            tolerance = (m.planner or {}).get("tolerance", PLAIN_DDP_TOLERANCE)
            line = f"    plain DDP ({FLAT}) is {'within' if within else 'not within'} {tolerance:.0%} of the best measured"
            if m.planner is not None:  # hier_auto decides from the planner's prediction, which may differ
                agrees = "and the planner agrees" if m.planner["plain_ddp"] == within else "but the planner predicts otherwise"
                line += (f" ({agrees}: strategy=hier_auto "
                         f"{'installs no hook' if m.planner['plain_ddp'] else 'installs one'})")
            lines.append(line)
    if m.loader_images_per_s:
        need = m.batch_size / max(m.step_s - m.median_part("input"), 1e-12)
        lines.append(f"  loader images/s per rank (the rest of the step consumes {need:.0f}):")
        lines += [f"    {w:>2} workers: {rate:10.1f}{'  (configured)' if w == m.num_workers else ''}"
                  for w, rate in sorted(m.loader_images_per_s.items())]
    lines += ["", f"larger batches: {large_batch_note(m)}", f"compressed wire: {compressed_wire_note(m)}",
              f"smaller images: {smaller_images_note(m)}"]
    lines += ["", "fixes:" if d.fixes else "fixes: none of the measured alternatives is predicted to be faster"]
    for i, f in enumerate(d.fixes, 1):
        what = " ".join(f.overrides) or ("(no override; the command below)" if f.command else "(no override)")
        lines.append(f"  {i}. {what}")
        if f.command:
            lines.append(f"     run: {f.command}")
        measured = "" if f.measured_speedup is None else f", measured {f.measured_speedup:.2f}x"
        lines.append(f"     predicted {f.predicted_speedup:.2f}x{measured}: {f.reason}")
        lines.append(f"     (from: {f.basis})")
    if d.verify_rounds:
        lines.append(f"  measured: {d.verify_rounds} round(s) of baseline and fix runs, interleaved, in this job")
    return "\n".join(lines)


def plot_report(d: Diagnosis, path: str | Path) -> Path:
    """Stacked bars of the step parts: median rank, slowest rank, and each fix (predicted and measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = d.measurements
    slowest = m.breakdown().slowest_rank
    bars = [("median rank", {p: m.median_part(p) for p in PHASES}), (f"slowest (rank {slowest})", m.parts[slowest])]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * (len(bars) + len(d.fixes))), 4.0))
    for i, (_, parts) in enumerate(bars):
        bottom = 0.0
        for p in PHASES:
            ax.bar(i, parts.get(p, 0.0), bottom=bottom, color=PHASE_COLORS[p], label=p if i == 0 else None)
            bottom += parts.get(p, 0.0)
    labels = [name for name, _ in bars]
    for j, f in enumerate(d.fixes):
        x = len(bars) + j
        ax.bar(x, m.step_s / f.predicted_speedup, color="none", edgecolor="black", hatch="//",
               label="predicted" if j == 0 else None)
        if f.verified_step_s is not None:
            ax.plot([x - 0.4, x + 0.4], [f.verified_step_s] * 2, color="black", lw=2,
                    label="measured" if j == 0 else None)
        labels.append("\n".join((" ".join(f.overrides) or "straggler").split(" ")))
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(f"bottleneck: {d.verdict.bottleneck}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)  # beside the bars, never over one
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def dumps(d: Diagnosis) -> str:
    """``doctor.json``'s text."""
    return json.dumps(d.to_json(), indent=2)
