"""Step breakdown's pure core (no Lightning, no process group): part totals to a summary and a verdict.

[`summarize`][lightning_fastscale.diagnostics.step_breakdown.summarize] turns each rank's seconds
in the parts of a step (`PHASES`) into the median over ranks, the slowest rank, the straggler
share and the bottleneck (`VERDICTS`); `breakdown_table`, `plot_breakdown` and `write_report`
render it. What each part and verdict means: ``docs/step_breakdown.md``.

Example:
    >>> ranks = [RankTotals(0, steps=10, seconds={"input": 0.5, "compute": 2.0, "communication": 0.3}),
    ...          RankTotals(1, steps=10, seconds={"input": 0.5, "compute": 2.1, "communication": 0.2})]
    >>> s = summarize(ranks)
    >>> s.bottleneck, round(s.step_s, 3), s.slowest_rank
    ('compute', 0.28, 1)
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PHASES: tuple[str, ...] = ("input", "compute", "communication", "optimizer", "rest")
VERDICTS: tuple[str, ...] = ("input", "compute", "communication", "straggler")

# one colour per part in every plot (the step breakdown's and the doctor's)
PHASE_COLORS: dict[str, str] = {"input": "#d62728", "compute": "#1f77b4", "communication": "#ff7f0e",
                                "optimizer": "#2ca02c", "rest": "#7f7f7f"}


@dataclass
class RankTotals:
    """Seconds one rank spent in each part over ``steps`` optimizer steps (sums), with its samples and images."""

    rank: int
    steps: int
    seconds: dict[str, float]
    samples: float = 0.0
    images: float | None = None
    first_step: int | None = None
    last_step: int | None = None

    @classmethod
    def empty(cls, rank: int = 0) -> RankTotals:
        """No step yet: every part at 0 s."""
        return cls(rank, 0, dict.fromkeys(PHASES, 0.0))

    def add(self, seconds: dict[str, float], samples: float, images: float | None, step: int) -> None:
        """Fold one optimizer step in (``images=None``: its batches held no images, so neither do the totals)."""
        self.merge(RankTotals(self.rank, 1, seconds, samples, images, step, step))

    def merge(self, other: RankTotals) -> None:
        """Fold ``other`` (the same rank, later steps) in."""
        for p in PHASES:
            self.seconds[p] += other.seconds.get(p, 0.0)
        if other.steps:
            self.images = None if other.images is None or (self.steps and self.images is None) else \
                (self.images or 0.0) + other.images
            self.first_step = other.first_step if self.first_step is None else min(self.first_step, other.first_step)
            self.last_step = other.last_step if self.last_step is None else max(self.last_step, other.last_step)
        self.steps += other.steps
        self.samples += other.samples

    def to_row(self) -> list[float]:
        """The fields as floats, to gather across ranks in one tensor (`from_row` reads them back)."""
        return [float(self.steps), *(self.seconds[p] for p in PHASES), self.samples,
                -1.0 if self.images is None else self.images,
                -1.0 if self.first_step is None else float(self.first_step),
                -1.0 if self.last_step is None else float(self.last_step)]

    @classmethod
    def from_row(cls, rank: int, row: Sequence[float]) -> RankTotals:
        """Inverse of `to_row`."""
        n = len(PHASES)
        steps, samples, images, first, last = int(row[0]), row[1 + n], row[2 + n], row[3 + n], row[4 + n]
        return cls(rank, steps, dict(zip(PHASES, row[1:1 + n])), samples, None if images < 0 else images,
                   None if first < 0 else int(first), None if last < 0 else int(last))

    def per_step(self) -> dict[str, float]:
        """Mean seconds per step of every part in `PHASES` (missing parts are 0)."""
        n = max(self.steps, 1)
        return {p: float(self.seconds.get(p, 0.0)) / n for p in PHASES}

    def step_s(self) -> float:
        """Mean seconds per step (the sum of the parts)."""
        return sum(self.per_step().values())


@dataclass
class BreakdownSummary:
    """The breakdown of ``steps`` optimizer steps on ``world_size`` ranks (plain data).

    Seconds are per step, medians over ranks; ``busy_s`` is a rank's step minus its exposed
    communication, the slowest rank has the largest, ``straggler_s`` is its excess over the
    others' median; ``scores`` are the seconds charged to each verdict. Every field is
    described in ``docs/step_breakdown.md``.
    """

    steps: int
    world_size: int
    step_s: float
    phases: dict[str, float]
    shares: dict[str, float]
    per_rank: list[dict[str, Any]]
    slowest_rank: int
    straggler_s: float
    straggler_share: float
    straggler_phase: str | None
    scores: dict[str, float]
    bottleneck: str
    samples_per_s: float | None
    images_per_s: float | None
    first_step: int | None = None
    last_step: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        return asdict(self)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarize(ranks: Sequence[RankTotals], first_step: int | None = None, last_step: int | None = None) -> BreakdownSummary:
    """Median, slowest rank, straggler share and verdict of per-rank part totals.

    The scores are medians over the ranks other than the slowest (over all ranks on one rank); ``communication`` less the
    straggler's excess, which the others spend waiting for it, not for the network.
    """
    if not ranks:
        raise ValueError("summarize() needs the totals of at least one rank")
    ranks = sorted(ranks, key=lambda r: r.rank)
    per_step = {r.rank: r.per_step() for r in ranks}
    step = {r.rank: sum(per_step[r.rank].values()) for r in ranks}
    busy = {k: step[k] - per_step[k]["communication"] for k in step}
    step_s = _median(list(step.values()))
    phases = {p: _median([per_step[k][p] for k in per_step]) for p in PHASES}
    shares = {p: (phases[p] / step_s if step_s > 0 else 0.0) for p in PHASES}

    slowest = max(busy, key=lambda k: (busy[k], -k))
    others = [k for k in busy if k != slowest] or [slowest]
    straggler_s = max(0.0, busy[slowest] - _median([busy[k] for k in others])) if len(busy) > 1 else 0.0
    straggler_phase = None
    if straggler_s > 0:
        excess = {
            p: per_step[slowest][p] - _median([per_step[k][p] for k in others])
            for p in PHASES if p != "communication"
        }
        straggler_phase = max(excess, key=excess.get)
    scores = {
        "input": _median([per_step[k]["input"] for k in others]),
        "compute": _median([per_step[k]["compute"] + per_step[k]["optimizer"] for k in others]),
        "communication": max(0.0, _median([per_step[k]["communication"] for k in others]) - straggler_s),
        "straggler": straggler_s,
    }
    bottleneck = max(VERDICTS, key=lambda v: scores[v])  # ties: the earlier verdict in VERDICTS

    steps = min(r.steps for r in ranks)
    samples = sum(r.samples for r in ranks)
    has_images = all(r.images is not None for r in ranks)
    images = sum(r.images for r in ranks) if has_images else None  # type: ignore[misc]
    total_s = step_s * steps
    samples_per_s = samples / total_s if total_s > 0 and samples > 0 else None
    images_per_s = images / total_s if total_s > 0 and images else None
    return BreakdownSummary(
        steps=steps,
        world_size=len(ranks),
        step_s=step_s,
        phases=phases,
        shares=shares,
        per_rank=[
            {"rank": r.rank, "steps": r.steps, "step_s": step[r.rank], "busy_s": busy[r.rank],
             "phases": per_step[r.rank]}
            for r in ranks
        ],
        slowest_rank=slowest,
        straggler_s=straggler_s,
        straggler_share=straggler_s / step_s if step_s > 0 else 0.0,
        straggler_phase=straggler_phase,
        scores=scores,
        bottleneck=bottleneck,
        samples_per_s=samples_per_s,
        images_per_s=images_per_s,
        first_step=first_step,
        last_step=last_step,
    )


def summarize_steps(per_rank_steps: Sequence[Sequence[Mapping[str, float]]],
                    samples_per_step: Sequence[float] | None = None) -> BreakdownSummary:
    """`summarize` from per-step seconds ``per_rank_steps[rank][i][part]`` (``samples_per_step[rank]``: per step).

    Example:
        >>> steps = [[{"input": 0.01, "compute": 0.1}] * 4, [{"input": 0.01, "compute": 0.3}] * 4]
        >>> s = summarize_steps(steps)
        >>> s.bottleneck, s.slowest_rank
        ('straggler', 1)
    """
    ranks = []
    for rank, steps in enumerate(per_rank_steps):
        seconds = {p: math.fsum(float(s.get(p, 0.0)) for s in steps) for p in PHASES}
        samples = float(samples_per_step[rank]) * len(steps) if samples_per_step is not None else 0.0
        ranks.append(RankTotals(rank, len(steps), seconds, samples))
    return summarize(ranks)


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def breakdown_table(summary: BreakdownSummary | Mapping[str, Any]) -> str:
    """The summary as a Markdown table (ms per step, share of the step) plus a verdict line."""
    s = summary.to_dict() if isinstance(summary, BreakdownSummary) else dict(summary)
    ranks = s["per_rank"]
    slow = next(r for r in ranks if r["rank"] == s["slowest_rank"])
    lines = [
        f"| part | median ms/step | share | slowest rank ({s['slowest_rank']}) ms/step |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {p} | {_fmt_ms(s['phases'][p])} | {100 * s['shares'][p]:.1f} % | {_fmt_ms(slow['phases'][p])} |"
              for p in PHASES]
    lines.append(f"| **step** | **{_fmt_ms(s['step_s'])}** | 100 % | {_fmt_ms(slow['step_s'])} |")
    rate = [f"{s[f'{what}_per_s']:.1f} {what}/s" for what in ("samples", "images") if s.get(f"{what}_per_s")]
    steps = f"steps {s['first_step']}-{s['last_step']}" if s.get("first_step") is not None else f"{s['steps']} steps"
    lines += [
        "",
        f"{steps} on {s['world_size']} rank(s){', ' + ', '.join(rate) if rate else ''}; "
        f"straggler: rank {s['slowest_rank']}, {_fmt_ms(s['straggler_s'])} ms/step "
        f"({100 * s['straggler_share']:.1f} % of the step"
        f"{', in ' + s['straggler_phase'] if s.get('straggler_phase') else ''}); "
        f"bottleneck: **{s['bottleneck']}**",
    ]
    return "\n".join(lines)


def breakdown_report(total: BreakdownSummary, windows: Sequence[BreakdownSummary], **extra: Any) -> dict[str, Any]:
    """The JSON document written to ``step_breakdown.json``: ``summary``, ``windows`` (in step order) and ``extra``."""
    return {"phases": list(PHASES), "verdicts": list(VERDICTS), "summary": total.to_dict(),
            "windows": [w.to_dict() for w in windows], **extra}


def _merge_windows(windows: Sequence[BreakdownSummary], max_bars: int) -> list[tuple[str, dict[str, float]]]:
    """Step-weighted mean parts of consecutive windows, at most ``max_bars`` groups."""
    group = max(1, math.ceil(len(windows) / max_bars))
    bars = []
    for i in range(0, len(windows), group):
        chunk = windows[i:i + group]
        n = sum(w.steps for w in chunk) or 1
        phases = {p: sum(w.phases[p] * w.steps for w in chunk) / n for p in PHASES}
        first, last = chunk[0].first_step, chunk[-1].last_step
        label = f"{first}-{last}" if first is not None else str(i)
        bars.append((label, phases))
    return bars


def free_stem(directory: Path, stem: str, exts: Sequence[str]) -> str:
    """``stem``, or ``stem-1``, ``stem-2``, ... : the first with no file of ``exts`` in ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    base, n = stem, 0
    while any((directory / f"{base}.{ext}").exists() for ext in exts):
        n += 1
        base = f"{stem}-{n}"
    return base


def plot_breakdown(windows: Sequence[BreakdownSummary], path: str | Path, max_bars: int = 40) -> Path:
    """Stacked bars of the median ms per step of each part, one bar per window of steps (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    bars = _merge_windows(windows, max_bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(bars) + 3), 4.0))
    try:
        x = range(len(bars))
        bottom = [0.0] * len(bars)
        for p in PHASES:
            heights = [1e3 * phases[p] for _, phases in bars]
            ax.bar(x, heights, bottom=bottom, label=p, color=PHASE_COLORS[p])
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(list(x))
        ax.set_xticklabels([label for label, _ in bars], rotation=60, ha="right", fontsize=7)
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel("ms per step (median rank)")
        ax.set_title("Step breakdown")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def write_report(directory: str | Path, total: BreakdownSummary, windows: Sequence[BreakdownSummary],
                 stem: str = "step_breakdown", plot: bool = True, **extra: Any) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and (``plot``) ``<stem>.png`` into ``directory``, by kind.

    Existing files are never overwritten: the stem gets ``-1``, ``-2``, ... instead.
    """
    directory = Path(directory)
    base = free_stem(directory, stem, ("json", "md", "png"))
    paths = {"json": directory / f"{base}.json", "md": directory / f"{base}.md"}
    paths["json"].write_text(json.dumps(breakdown_report(total, windows, **extra), indent=2) + "\n")
    md = ["# Step breakdown", "", breakdown_table(total), ""]
    if windows:
        md += ["## Windows", "", "| steps | " + " | ".join(PHASES) + " | step ms | bottleneck |",
               "|---|" + "---:|" * (len(PHASES) + 1) + "---|"]
        md += [f"| {w.first_step}-{w.last_step} | " + " | ".join(_fmt_ms(w.phases[p]) for p in PHASES)
               + f" | {_fmt_ms(w.step_s)} | {w.bottleneck} |" for w in windows]
    paths["md"].write_text("\n".join(md) + "\n")
    if plot and windows:
        paths["png"] = plot_breakdown(windows, directory / f"{base}.png")
    return paths
