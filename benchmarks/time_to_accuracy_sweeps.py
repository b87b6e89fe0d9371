"""The two sweeps ``docs/time_to_accuracy.md`` shows ("Sweeps"), run on the built-in data.

A grid over the learning rate (``fastscale-train -m``) and an Optuna search for the time to
the target (``hparams_search=time_to_target``), each in one CPU process per job, under
``--workdir``. Prints the grid's ``sweep_summary.md`` table as written, the search's with fewer
columns and the learning rates rounded, and Optuna's best value.

Example::

    python benchmarks/time_to_accuracy_sweeps.py --workdir /tmp/tta_sweeps
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_fastscale.diagnostics.sweeps import sweep_rows

TRAIN = str(Path(sys.executable).parent / "fastscale-train")
GRID = ["-m", "trainer.max_epochs=2", "callbacks.time_to_accuracy.target=0.15", "optimizer.lr=0.05,0.1,0.2"]
SEARCH = ["hparams_search=time_to_target", "hydra.sweeper.n_trials=4", "trainer.max_epochs=3",
          "callbacks.time_to_accuracy.target=0.2"]
SEARCH_COLUMNS = ("rank", "job", "overrides", "final", "reached", "seconds", "epochs", "steps", "steps_per_s", "bottleneck")


def sweep(workdir: Path, name: str, overrides: list[str]) -> Path:
    folder = workdir / name
    if folder.exists():
        raise SystemExit(f"{folder} exists: give another --workdir or remove it")
    subprocess.run([TRAIN, *overrides, f"hydra.sweep.dir={folder}"], cwd=workdir, check=True,
                   env={**os.environ, "WANDB_MODE": "offline"})
    return folder


def search_row(row: dict[str, Any]) -> str:
    overrides = re.sub(r"optimizer\.lr=([0-9.]+)", lambda m: f"optimizer.lr={float(m.group(1)):.3g}", row["overrides"])
    cells = {**row, "overrides": overrides, "final": f"{row['final']:.4g}", "seconds": f"{row['seconds']:.1f}",
             "epochs": f"{row['epochs']:g}", "steps_per_s": f"{row['steps_per_s']:.3g}"}
    return "| " + " | ".join(str(cells[c]) for c in SEARCH_COLUMNS) + " |"


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    grid = sweep(args.workdir, "grid", GRID)
    search = sweep(args.workdir, "search", SEARCH)
    print(f"grid: fastscale-train {' '.join(GRID)}\n")
    print("\n".join(line for line in (grid / "sweep_summary.md").read_text().splitlines() if line.startswith("|")))
    best = OmegaConf.to_container(OmegaConf.load(search / "optimization_results.yaml"))
    print(f"\nsearch: fastscale-train {' '.join(SEARCH)}; Optuna's best value {best['best_value']:.1f} s\n")
    print("| " + " | ".join(SEARCH_COLUMNS) + " |")
    print("|" + "---|" * len(SEARCH_COLUMNS))
    rows = sweep_rows(search)
    for row in rows:
        print(search_row(row))
    return {"grid": sweep_rows(grid), "search": rows, "search_best": best}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results_file

    results_file.run(main, "time_to_accuracy_sweeps", page="docs/time_to_accuracy.md")
