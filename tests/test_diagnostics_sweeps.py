"""Sweeps ranked by time to accuracy: the table of a real ``fastscale-train -m`` multirun, the W&B
runs' names and group, the ranking and the Optuna objective on written reports, and the
``hparams_search=time_to_target`` preset end to end."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_fastscale.config_check import ConfigError
from lightning_fastscale.diagnostics.step_breakdown import VERDICTS
from lightning_fastscale.diagnostics.sweeps import (
    check_objective,
    latest_report,
    sweep_rows,
    time_to_target_objective,
)
from tests.test_train_cli import TINY, fastscale_train

LIMITS = ["+trainer.limit_train_batches=2", "+trainer.limit_val_batches=1"]


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _run_record_has(run_file: Path, field: int, text: str) -> bool:
    """Whether the W&B run record holds ``text`` as string field ``field`` (6: group, 8: name)."""
    value = text.encode()
    return bytes([field << 3 | 2]) + _varint(len(value)) + value in run_file.read_bytes()


@pytest.mark.slow  # a three-job multirun, about 14 s
def test_multirun_writes_its_table_one_row_per_job_and_names_wandb_runs(tmp_path):
    sweep = tmp_path / "sweep"
    out = fastscale_train(["-m", *TINY, *LIMITS, "optimizer.lr=0.05,0.1", f"hydra.sweep.dir={sweep}"], tmp_path)
    with (sweep / "sweep_summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["overrides"] for r in rows) == ["optimizer.lr=0.05", "optimizer.lr=0.1"]
    assert [r["rank"] for r in rows] == ["1", "2"]
    for row in rows:
        job = sweep / row["job"]
        tta = json.loads((job / "time_to_accuracy.json").read_text())
        breakdown = json.loads((job / "step_breakdown.json").read_text())["summary"]
        assert float(row["final"]) == pytest.approx(tta["curve"][-1][1]) and row["metric"] == "val/top1"
        assert row["reached"] == "False" and float(row["seconds"]) == pytest.approx(tta["seconds"])
        assert float(row["steps_per_s"]) == pytest.approx(1 / breakdown["step_s"])
        assert row["bottleneck"] == breakdown["bottleneck"] and row["bottleneck"] in VERDICTS
        # the W&B run is named after the job's overrides and grouped by the sweep folder
        name = OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.job.override_dirname
        assert "optimizer.lr=" in name
        (run_file,) = (job / "wandb").glob("offline-run-*/run-*.wandb")
        assert _run_record_has(run_file, 8, name) and _run_record_has(run_file, 6, str(sweep))
    assert float(rows[0]["best"]) >= float(rows[1]["best"])  # no target: ranked by best value
    md = (sweep / "sweep_summary.md").read_text()
    assert "optimizer.lr=0.05" in md and "data.train_size=192" in md.split("|")[0]  # common overrides above
    assert "sweep summary written to" in out


def _job(sweep: Path, num: int, overrides: list[str], **tta) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    if tta:
        report = {"metric": "val/top1", "target": 0.8, "mode": "max", "epochs": 1, "steps": 10, **tta}
        (job / "time_to_accuracy.json").write_text(json.dumps(report))


def test_ranking_reached_first_by_time_then_best_then_failed(tmp_path):
    common = ["trainer.max_epochs=3"]
    _job(tmp_path, 0, [*common, "lr=1"], reached=False, seconds=50, run_seconds=50, best=0.7, curve=[[50, 0.7]])
    _job(tmp_path, 1, [*common, "lr=2"], reached=True, seconds=40, run_seconds=60, best=0.9, curve=[[40, 0.85], [60, 0.9]])
    _job(tmp_path, 2, [*common, "lr=3"])  # failed: no report
    _job(tmp_path, 3, [*common, "lr=4"], reached=True, seconds=30, run_seconds=30, best=0.81, curve=[[30, 0.81]])
    _job(tmp_path, 4, [*common, "lr=5"], reached=False, seconds=50, run_seconds=50, best=0.75, curve=[[50, 0.75]])
    rows = sweep_rows(tmp_path)
    assert [r["overrides"] for r in rows] == ["lr=4", "lr=2", "lr=5", "lr=1", "lr=3"]
    assert rows[1]["final"] == 0.9 and rows[1]["seconds"] == 40 and rows[-1]["reached"] is None
    # a resumed run in the same folder wrote time_to_accuracy-1.json: the newest report counts
    (tmp_path / "3" / "time_to_accuracy-1.json").write_text(json.dumps({"seconds": 99}))
    assert latest_report(tmp_path / "3", "time_to_accuracy") == {"seconds": 99}


def test_objective_and_its_checks():
    assert time_to_target_objective({"reached": True, "seconds": 40.0, "run_seconds": 90.0}, 3.0) == 40.0
    assert time_to_target_objective({"reached": False, "seconds": 90.0, "run_seconds": 90.0}, 3.0) == 270.0
    ok = {"objective": {"name": "time_to_target", "penalty": 2.0},
          "callbacks": {"time_to_accuracy": {"target": 0.5}}}
    check_objective(OmegaConf.create(ok))
    for change, key in (({"callbacks": {"time_to_accuracy": {"target": None}}}, "callbacks.time_to_accuracy.target"),
                        ({"callbacks": {"time_to_accuracy": None}}, "callbacks.time_to_accuracy.target"),
                        ({"objective": {"penalty": 0.5}}, "objective.penalty"),
                        ({"objective": {"name": "fastest"}}, "objective.name")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            check_objective(OmegaConf.merge(OmegaConf.create(ok), change))


@pytest.mark.slow
def test_optuna_time_to_target_preset_runs_two_trials(tmp_path):
    sweep = tmp_path / "sweep"
    out = fastscale_train(["hparams_search=time_to_target", *TINY, *LIMITS, "hydra.sweeper.n_trials=2",
                           "callbacks.time_to_accuracy.target=0.99", "objective.penalty=3",
                           f"hydra.sweep.dir={sweep}"], tmp_path)
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    scores = []
    for job in ("0", "1"):
        tta = json.loads((sweep / job / "time_to_accuracy.json").read_text())
        assert not tta["reached"] and tta["target"] == 0.99
        scores.append(3 * tta["run_seconds"])  # missed the target: its whole time x the penalty
    assert results.best_value == pytest.approx(min(scores))
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert len(rows) == 2 and all("optimizer.lr=" in r["overrides"] for r in rows)
    assert "Best value" in out
