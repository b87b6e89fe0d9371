"""Smoke test of the large-batch accuracy study (benchmarks/convergence.py --quick).

Runs every arm of the ablation for 2 tiny epochs in this process and checks the outputs:
one row per arm in CSV and JSON, the batch sizes, optimizer step counts and peak learning
rates each arm's preset implies, accuracies in range, and a PNG plot.
"""
import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("convergence_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("convergence")
    result = module.main(["--quick", "--jobs", "1", "--output-dir", str(out)])
    return module, out, result


@pytest.mark.timeout(300)
def test_quick_study_writes_one_row_per_arm(study):
    module, out, _ = study
    arms = [name for name, _, _ in module.ARMS]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["arm"] for r in rows] == arms
    data = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in data["rows"]] == arms
    assert data["meta"]["quick"] is True
    png = (out / "convergence.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.timeout(300)
def test_quick_study_numbers_follow_the_presets(study):
    module, _, result = study
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
        assert r["base_lr"] == pytest.approx(module.arm_lr(arm, base_lr)), arm
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
        lr = module.arm_lr(arm, base_lr)
        assert rows[arm]["first_lr"] == pytest.approx(lr), arm
        assert rows[arm]["peak_lr"] == pytest.approx(32 * lr), arm
    assert rows["4_lars"]["base_lr"] == pytest.approx(2 * base_lr)
    # the ramp starts at 256 = 16 x B0: the same warmup factor of a 16 x scaled peak
    for arm in ("6_full", "7_ghost_bn"):
        lr = module.arm_lr(arm, base_lr)
        assert rows[arm]["first_lr"] == pytest.approx(16 * lr * 16 / 512), arm
        assert rows[arm]["peak_lr"] == pytest.approx(32 * lr), arm


def test_each_arm_adds_its_callbacks_to_the_previous_one(study, tmp_path):
    module, _, _ = study
    callbacks = [set(module.compose_arm(preset, [], tmp_path).callbacks) for _, preset, _ in module.ARMS]
    added = [sorted(after - before) for before, after in zip(callbacks, callbacks[1:])]
    assert all(before <= after for before, after in zip(callbacks, callbacks[1:]))  # cumulative
    assert added[-2:] == [["batch_size_ramp"], ["ghost_batch_norm"]]
    ghost = module.compose_arm("convergence_ghost_bn", [], tmp_path).callbacks.ghost_batch_norm
    assert ghost.ghost_batch_size == 16
