"""Smoke test of the large-batch accuracy study (benchmarks/convergence.py --quick).

Runs the script as a user would, every arm of the ablation for 2 tiny epochs, and checks the
outputs: one row per arm in CSV and JSON, the batch sizes, optimizer step counts and peak
learning rates each arm's preset implies, accuracies in range, and a PNG plot.
"""
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "convergence.py"
CONF = ROOT / "lightning_fastscale" / "conf"
ARMS = ["1_baseline", "2_linear_scaling", "3_warmup", "4_lars", "5_recipe", "6_full", "7_ghost_bn"]
PRESETS = ["convergence_baseline", "convergence_linear_scaling", "convergence_warmup", "convergence_lars",
           "convergence_recipe", "convergence_full", "convergence_ghost_bn"]
LARS_ARMS = {"4_lars", "5_recipe", "6_full", "7_ghost_bn"}


def arm_lr(arm: str, base_lr: float) -> float:
    """The study runs the LARS arms at twice the baseline's LR (benchmarks/README.md)."""
    return 2 * base_lr if arm in LARS_ARMS else base_lr


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--jobs", "1", "--output-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=290,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_study_writes_one_row_per_arm(study):
    out, _ = study
    arms = ARMS
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["arm"] for r in rows] == arms
    data = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in data["rows"]] == arms
    assert data["meta"]["quick"] is True
    png = (out / "convergence.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_study_numbers_follow_the_presets(study):
    _, result = study
    rows = {r["arm"]: r for r in result["rows"]}
    base_lr = rows["1_baseline"]["base_lr"]
    # --quick: 512 training images, 2 epochs, B0 = 16, large batch 512, ramp 256 -> 512
    expected = {
        "1_baseline": (16, 2 * 512 // 16),
        "2_linear_scaling": (512, 2),
        "3_warmup": (512, 2),
        "4_lars": (512, 2),
        "5_recipe": (512, 2),
        "6_full": (512, 512 // 256 + 1),
        "7_ghost_bn": (512, 512 // 256 + 1),
    }
    for arm, (batch, steps) in expected.items():
        r = rows[arm]
        assert r["error"] is None, (arm, r["error"])
        assert (r["global_batch"], r["steps"], r["epochs"]) == (batch, steps, 2), arm
        # arms 4-7 (LARS) start from LARS_LR_FACTOR x the baseline's LR, the others from it
        assert r["base_lr"] == pytest.approx(arm_lr(arm, base_lr)), arm
        for value in (r["final_top1"], r["best_top1"]):
            assert 0.0 <= value <= 1.0 and not math.isnan(value), arm
        assert r["best_top1"] >= r["final_top1"]
        assert r["wall_s"] > 0
    # linear scaling: without warmup the first step already runs at base LR x 512 / 16
    assert rows["1_baseline"]["peak_lr"] == pytest.approx(base_lr)
    assert rows["2_linear_scaling"]["peak_lr"] == pytest.approx(32 * base_lr)
    # warmup (Goyal et al.) starts from the unscaled LR, factor 16 / 512 of the scaled peak;
    # after the 1-epoch warmup (--quick: 1 step per epoch) the second step runs at the peak
    for arm in ("3_warmup", "4_lars", "5_recipe"):
        lr = arm_lr(arm, base_lr)
        assert rows[arm]["first_lr"] == pytest.approx(lr), arm
        assert rows[arm]["peak_lr"] == pytest.approx(32 * lr), arm
    assert rows["4_lars"]["base_lr"] == pytest.approx(2 * base_lr)
    # the ramp starts at 256 = 16 x B0: the same warmup factor of a 16 x scaled peak
    for arm in ("6_full", "7_ghost_bn"):
        lr = arm_lr(arm, base_lr)
        assert rows[arm]["first_lr"] == pytest.approx(16 * lr * 16 / 512), arm
        assert rows[arm]["peak_lr"] == pytest.approx(32 * lr), arm


def compose_arm(preset: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"experiment={preset}", "logger=none"])


def test_each_arm_adds_its_callbacks_to_the_previous_one():
    callbacks = [{k for k, v in compose_arm(preset).callbacks.items() if v} for preset in PRESETS]
    added = [sorted(after - before) for before, after in zip(callbacks, callbacks[1:])]
    assert all(before <= after for before, after in zip(callbacks, callbacks[1:]))  # cumulative
    assert added[-2:] == [["batch_size_ramp"], ["ghost_batch_norm"]]
    ghost = compose_arm("convergence_ghost_bn").callbacks.ghost_batch_norm
    assert ghost.ghost_batch_size == 16
