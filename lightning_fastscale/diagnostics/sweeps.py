"""Sweeps ranked by time to accuracy: one table per Hydra multirun, and the Optuna objective.

`sweep_rows` reads and ranks a sweep's job folders, `write_sweep_table` writes
``sweep_summary.csv`` / ``.md`` (the `SweepSummary` Hydra callback, at every multirun's end), and
`time_to_target_objective` is MLPerf's measure as the sweeper's objective
(``hparams_search=time_to_target``). Columns and ranking: ``docs/time_to_accuracy.md``.
"""
from __future__ import annotations

import csv
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_fastscale.config_check import ConfigError
from lightning_fastscale.diagnostics.time_to_accuracy import STEM, format_duration

log = logging.getLogger(__name__)

TABLE = "sweep_summary"
COLUMNS = ("rank", "job", "overrides", "metric", "final", "best", "target", "reached", "seconds", "epochs",
           "steps", "run_seconds", "steps_per_s", "bottleneck", "folder")


def latest_report(folder: str | Path, stem: str) -> dict[str, Any] | None:
    """The newest ``<stem>.json`` / ``<stem>-N.json`` in ``folder`` (a resumed run adds ``-1``), or ``None``."""
    def number(path: Path) -> int:
        match = re.fullmatch(rf"{re.escape(stem)}(?:-(\d+))?", path.stem)
        return -1 if match is None else int(match.group(1) or 0)

    paths = [p for p in Path(folder).glob(f"{stem}*.json") if number(p) >= 0]
    return json.loads(max(paths, key=number).read_text()) if paths else None


def _job_row(folder: Path) -> dict[str, Any]:
    overrides = OmegaConf.load(folder / ".hydra" / "overrides.yaml")
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(job=folder.name, overrides=list(overrides), folder=str(folder))
    tta = latest_report(folder, STEM)
    if tta is not None:
        values = [v for _, v in tta["curve"] if v is not None]
        row.update({k: tta[k] for k in ("metric", "best", "target", "reached", "seconds", "epochs", "steps",
                                         "run_seconds", "mode")})
        row["final"] = values[-1] if values else None
    breakdown = latest_report(folder, "step_breakdown")
    if breakdown is not None:
        summary = breakdown["summary"]
        row["steps_per_s"] = 1.0 / summary["step_s"] if summary.get("step_s") else None
        row["bottleneck"] = summary.get("bottleneck")
    return row


def sweep_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job folder of ``sweep_dir``, ranked: reached first by time, then by best value, then no report.

    ``overrides`` keeps only what differs between the jobs.
    """
    folders = sorted((p.parent.parent for p in Path(sweep_dir).glob("*/.hydra/overrides.yaml")),
                     key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    rows = [_job_row(f) for f in folders]
    common = set(common_overrides(sweep_dir))
    for r in rows:
        r["overrides"] = " ".join(o for o in r["overrides"] if o not in common)

    def order(r: Mapping[str, Any]) -> tuple:
        if r["reached"]:
            return (0, r["seconds"])
        if r["best"] is not None:
            sign = -1 if r.get("mode", "max") == "max" else 1
            return (1, sign * r["best"])
        return (2, 0.0)

    rows.sort(key=order)
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows


def common_overrides(sweep_dir: str | Path) -> list[str]:
    """The overrides every job of the sweep shares (the sweep's own command line)."""
    lists = [list(OmegaConf.load(p)) for p in sorted(Path(sweep_dir).glob("*/.hydra/overrides.yaml"))]
    return [o for o in lists[0] if all(o in other for other in lists)] if lists else []


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    if key in ("seconds", "run_seconds"):
        return f"{value:.1f}"
    if key in ("final", "best", "steps_per_s"):
        return f"{value:.4g}"
    if key == "epochs":
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return str(value)


def sweep_markdown(rows: Sequence[Mapping[str, Any]], common: Sequence[str] = ()) -> str:
    """The ranked table in Markdown, with a line per job and the common overrides above it."""
    lines = ["# Sweep summary", ""]
    if common:
        lines += ["Common to every job: `" + " ".join(common) + "`", ""]
    if rows and rows[0].get("target") is not None:
        lines += [f"Ranked by time to {rows[0]['metric']} >= {rows[0]['target']:g} (jobs that reached it first), "
                  "then by best value.", ""]
    cols = [c for c in COLUMNS if c != "folder"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [_cell(c, r.get(c)) for c in cols]
        if r.get("seconds") is not None and r["seconds"] >= 60:
            cells[cols.index("seconds")] += f" ({format_duration(r['seconds'])})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_sweep_table(sweep_dir: str | Path) -> dict[str, Path]:
    """Write ``sweep_summary.csv`` and ``.md`` into ``sweep_dir``; returns their paths."""
    sweep_dir = Path(sweep_dir)
    rows = sweep_rows(sweep_dir)
    paths = {"csv": sweep_dir / f"{TABLE}.csv", "md": sweep_dir / f"{TABLE}.md"}
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows([{k: r.get(k) for k in COLUMNS} for r in rows])
    paths["md"].write_text(sweep_markdown(rows, common_overrides(sweep_dir)))
    return paths


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks.sweep_summary``): at the end of a multirun, write the ranked table."""

    @override
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        paths = write_sweep_table(sweep_dir)
        log.info("sweep summary written to %s\n%s", paths["md"], paths["md"].read_text())


OBJECTIVES = ("time_to_target",)


def check_objective(cfg: DictConfig) -> None:
    """Refuse an ``objective`` that cannot be computed, before anything starts (``ConfigError``)."""
    node = cfg.get("objective")
    if not node:
        return
    if node.get("name") not in OBJECTIVES:
        raise ConfigError(f"objective.name={node.get('name')!r} is not one of {OBJECTIVES}", key="objective.name")
    tta = (cfg.get("callbacks") or {}).get("time_to_accuracy")
    if not tta or tta.get("target") is None:
        raise ConfigError("objective.name=time_to_target needs a target: set callbacks.time_to_accuracy.target "
                          "(e.g. callbacks.time_to_accuracy.target=0.8) and keep callbacks.time_to_accuracy on",
                          key="callbacks.time_to_accuracy.target")
    penalty = node.get("penalty")
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or penalty < 1:
        raise ConfigError(f"objective.penalty={penalty!r}: a run that misses the target scores its whole time "
                          "times this factor; use a number >= 1 (e.g. 2) so it never beats a run that reached it",
                          key="objective.penalty")


def time_to_target_objective(summary: Mapping[str, Any], penalty: float) -> float:
    """Seconds to the target if reached, else the whole run's seconds times ``penalty`` (minimise)."""
    return float(summary["seconds"]) if summary["reached"] else float(summary["run_seconds"]) * penalty


def objective_value(cfg: DictConfig, trainer: Any, value: float | None) -> float | None:
    """What ``fastscale-train`` returns to a sweeper: ``value``, or with an ``objective`` `time_to_target_objective`."""
    node = cfg.get("objective")
    if not node:
        return value
    from lightning_fastscale.diagnostics.time_to_accuracy import TimeToAccuracy

    tta = next(c for c in trainer.callbacks if isinstance(c, TimeToAccuracy))
    # under a spawn launcher the ranks ran in child processes: their summary is in the file
    summary = tta.summary or latest_report(tta.dirpath or trainer.default_root_dir, STEM)
    if summary is None:
        raise RuntimeError(f"objective.name=time_to_target: no {STEM}.json was written in {tta.dirpath}")
    return time_to_target_objective(summary, float(node.penalty))
