"""The ImageNet recipe scripts run with ``--fast-dev-run`` on the built-in data and apply their
recipe: the ramp's second epoch serves the doubled global batch by accumulation, the LARS
plugin stepped without skipping, and the recipe's callbacks logged their schedules."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, *extra: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--fast-dev-run", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(text for text in done.stdout.splitlines() if text.startswith("final "))
    return {k: float(v) for k, v in re.findall(r"(\S+)=(\S+)", line)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "script, extra, smoothing",
    [pytest.param("imagenet_resnet50.py", ("--model", "resnet_small"), 0.1,  # the recipe, on a small ResNet
                  marks=pytest.mark.slow),
     pytest.param("imagenet_alexnet_bn.py", (), None, marks=pytest.mark.slow)],
)
def test_recipe_script_fast_dev_run(script: str, extra: tuple[str, ...], smoothing: float | None) -> None:
    metrics = run_example(script, *extra)
    # BatchSizeRamp {0: 8, 1: 16} under max_per_device_batch=8: epoch 1 is 8 x 2 accumulation
    assert (metrics["batch_size/global"], metrics["batch_size/per_device"],
            metrics["batch_size/accumulation"]) == (16, 8, 2)
    assert metrics["lars/skipped_steps"] == 0
    assert metrics["lr_schedule/epoch_progress"] == pytest.approx(2.0)  # every step advanced the LR
    assert metrics.get("label_smoothing") == smoothing
    assert math.isfinite(metrics["train/loss"])
