"""``fastscale-train data=streaming`` end to end on data the test converts itself."""
import os
import re
import subprocess
import sys

import pytest
import torch

from lightning_fastscale.data.cli import main as fastscale_data

from .data_streaming_utils import convert_tree

# Small-run limits only: the model summary, the throughput monitor and the progress bar stay on.
_SMALL = ["model.model_kwargs.widths=[8,16,16]", "trainer.max_epochs=1", "logger=csv"]


def _train(tmp_path, run_dir, overrides):
    """Run ``fastscale-train`` with ``overrides``; return its output after checking it succeeded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fastscale.train", *overrides, *_SMALL, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "final val/top1:" in out
    return out


@pytest.mark.slow
def test_fastscale_train_on_streaming_data(tmp_path):
    data = tmp_path / "shapes"
    assert fastscale_data(["convert", "procedural", str(data), "--train-size", "192", "--val-size", "64",
                           "--resolution", "32", "--max-side", "32", "--workers", "1"]) == 0
    run_dir = tmp_path / "run"
    out = _train(tmp_path, run_dir, [
        "data=streaming", f"data.root={data}", "data.resolution=32", "data.batch_size=32",
        "data.num_workers=auto", "data.max_workers=1", f"data.num_workers_cache={tmp_path / 'nw.json'}",
        "trainer.log_every_n_steps=1",
    ])
    assert "num_workers=auto:" in out  # the probe's pick and curve are logged
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 6  # 192 samples / 32 per step
    assert state["StreamingDataModule"]["train_resolution"] == 32
    assert (tmp_path / "nw.json").is_file()


@pytest.mark.slow  # the rectangular path is covered by tests/test_data_rect_val.py; this adds the CLI run
def test_fastscale_train_with_rectangular_validation(tmp_path):
    data = convert_tree(tmp_path, max_side=64)  # 24 train, 6 val images of several aspect ratios
    out = _train(tmp_path, tmp_path / "run", [
        "data=streaming", f"data.root={data}", "data.resolution=32", "data.batch_size=8", "data.val_batch_size=2",
        "data.num_workers=0", "data.rect_val=true",
    ])
    # 6 samples in batches of at most 2, one rank; the ratios give more than one shape
    shapes = re.search(r"rect_val: 3 validation batches on rank 0 of 1, (\d+) shapes", out)
    assert shapes and int(shapes.group(1)) >= 2, out[-4000:]
