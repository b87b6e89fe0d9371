"""``fastscale-train`` refuses a bad setting by its Hydra key, before any side effect.

Every part of the composed config is built (and the parts checked together) before the run
folder, the logger or the process group is touched; a wrong value becomes one line naming the
key, the value and the fix. In process through ``train.build`` for the settings; one console
run for the exit status, the missing traceback and the removed run folder.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lightning_fastscale import train
from lightning_fastscale.config_check import ConfigError

TINY = ["data.train_size=64", "data.val_size=32", "data.batch_size=16", "trainer.accelerator=cpu"]


def _build(overrides: list[str], run_dir: Path):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_fastscale.conf", version_base="1.3"):
        cfg = compose("train", return_hydra_config=True, overrides=[*TINY, *overrides])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    try:
        return train.build(cfg)
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["strategy=hier_ring", "strategy.bucket_cap_mb=-5"], "strategy.bucket_cap_mb",
         r"^strategy.bucket_cap_mb=-5 must be a number > 0; DDP's bucket size"),
        (["trainer.max_epochs=-1"], "trainer.max_epochs",
         r"^trainer.max_epochs=-1 with trainer.max_steps=-1 trains without end, but scheduler=cosine .*set trainer.max_epochs"),
        (["experiment=large_batch", "trainer.max_epochs=-1"], "trainer.max_epochs", r"callbacks.warmup_decay_lr"),
        (["optimizer.lr=-1"], "optimizer.lr", r"^optimizer.lr=-1: Invalid learning rate: -1; use a learning rate > 0"),
        (["optimizer=adamw", "optimizer.weight_decay=-1"], "optimizer.weight_decay", r"^optimizer.weight_decay=-1: "),
        (["trainer.devices=3", "strategy=hier_ring", "strategy.ranks_per_node=2"], "strategy.ranks_per_node",
         r"^strategy.ranks_per_node=2 does not divide the 3 ranks of trainer.devices=3 x trainer.num_nodes=1"),
        (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches",
         r"^trainer.accumulate_grad_batches=0 must be a positive integer"),
        (["trainer.max_steps=-2"], "trainer.max_steps", r"^trainer.max_steps=-2: .*must be a non-negative integer or -1"),
        (["data.batch_size=0"], "data.batch_size", r"^data.batch_size=0"),
        (["data.num_workers=-1"], "data.num_workers", r"^data.num_workers=-1 must be >= 0$"),
        (["data.num_classes=1"], "data.num_classes", r"^data.num_classes=1 must be between 2 and"),
        (["model.compile_mode=fastest"], "model.compile_mode", r"^model.compile_mode=fastest is not one of \[None, 'default'"),
        (["model.compile_mode=max-autotune"], "model.compile_mode",
         r"^model.compile_mode=max-autotune has no effect without model.compile=true$"),
        (["model=alexnet_bn", "model.model_kwargs.dropout=1.0"], "model.model_kwargs.dropout",
         r"^model.model_kwargs.dropout=1.0 must be in \[0, 1\)$"),
        (["model.pretrained=/nonexistent.pth"], "model.pretrained", r"^model.pretrained=/nonexistent.pth: no such file"),
        (["model.no_weight_decay_patterns=[model.fc.*]"], "model.no_weight_decay_patterns",
         r"^model.no_weight_decay_patterns=\['model.fc.\*'\] has no effect without model.no_weight_decay_on_bias_norm=true$"),
        (["data.resolution=0"], "data.resolution", r"^data.resolution=0"),
        (["precision=bf16_mixed", "precision.precision=17"], "precision.precision",
         r"^precision.precision=17: .*Precision must be '16-mixed' or 'bf16-mixed'"),
        (["trainer.devices=0"], "trainer.devices", r"^trainer.devices=0: "),
        (["experiment=large_batch", "callbacks.label_smoothing.smoothing=2"], "callbacks.label_smoothing.smoothing",
         r"callbacks.label_smoothing.smoothing=2 is outside \[0, 1\]"),
        (["experiment=large_batch", "callbacks.warmup_decay_lr.reference_batch=0"],
         "callbacks.warmup_decay_lr.reference_batch", r"^callbacks.warmup_decay_lr.reference_batch=0 must be a positive"),
    ],
)
def test_bad_setting_is_refused_by_its_hydra_key_before_side_effects(tmp_path, monkeypatch, overrides, key, message):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=message) as refused:
        _build(overrides, run_dir)
    assert refused.value.key == key
    assert "\n" not in str(refused.value)  # one line
    assert not run_dir.exists() and not dist.is_initialized()  # nothing written, no process group


def test_good_settings_build(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    _, _, trainer = _build(["strategy=hier_ring", "strategy.bucket_cap_mb=5", "trainer.devices=2",
                            "strategy.ranks_per_node=1"], tmp_path / "run")
    assert trainer.strategy.check_topology().num_nodes == 2


def test_console_prints_one_line_exits_2_and_leaves_no_run_folder(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("fastscale-train")), "optimizer.lr=-1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("fastscale-train: error: optimizer.lr=-1: Invalid learning rate")
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "run folder" in errors[0] and "removed" in errors[0]
    assert not [p for p in (tmp_path / "outputs").glob("*/*")]  # the timestamped folder is gone
    assert not (tmp_path / "wandb").exists()
