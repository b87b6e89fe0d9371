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
from lightning_fastscale.callbacks import BNSpan
from lightning_fastscale.config_check import ConfigError, check_group_names, config_names

TINY = ["data.batch_size=16", "trainer.accelerator=cpu"]
PROCEDURAL = ["data.train_size=64", "data.val_size=32"]


def default_data(overrides: list[str]) -> list[str]:
    """The small procedural data set, unless the overrides choose another data group."""
    return [] if any(o.startswith("data=") for o in overrides) else PROCEDURAL


def _build(overrides: list[str], run_dir: Path, base: list[str] | None = None):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_fastscale.conf", version_base="1.3"):
        cfg = compose("train", return_hydra_config=True, overrides=[*(base if base is not None else [*TINY, *default_data(overrides)]), *overrides])
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
        # the rows of docs/hydra.md's table of checks before launch
        (["experiment=large_batch", "trainer.max_epochs=1"], "callbacks.warmup_decay_lr.warmup_epochs",
         r"^callbacks.warmup_decay_lr.warmup_epochs=1 leaves no room for decay before trainer.max_epochs=1; lower"),
        (["experiment=large_batch", "trainer.devices=3"], None,
         r"^callbacks.batch_size_ramp: global batch 16 is not divisible by the world size 3 .*use a multiple of 3"),
        (["experiment=large_batch", "trainer.accumulate_grad_batches=2", "callbacks.warmup_decay_lr.warmup_epochs=0.5"],
         "trainer.accumulate_grad_batches", r"^trainer.accumulate_grad_batches=2: .*BatchSizeRamp both set gradient accumulation"),
        (["experiment=large_batch", "trainer.max_epochs=-1", "trainer.max_steps=10", "callbacks.warmup_decay_lr.total_epochs=2"],
         "trainer.max_epochs", r"^trainer.max_epochs=-1: ProgressiveResizing spreads its resolutions over trainer.max_epochs=-1"),
        # all the recipe's refusals at once: the warmup and the ramp
        (["experiment=large_batch", "trainer.max_epochs=1", "trainer.devices=3"], None,
         r"global batch 16 is not divisible.*; callbacks.warmup_decay_lr.warmup_epochs=1 leaves no room"),
        (["optimizer.lr=abc"], "optimizer.lr", r"^optimizer.lr=abc is not a number; give a number, e.g. optimizer.lr="),
        (["optimizer.momentum=-1"], "optimizer.momentum", r"^optimizer.momentum=-1: .*use a momentum in \[0, 1\)"),
        (["data=imagefolder"], "data.root", r"^data.root has no value .*give it on the command line, e.g. data.root="),
        (["data.train_size=8"], "data.train_size", r"^data.train_size=8: .*less than one batch of data.batch_size=16"),
        (["model.model_kwargs.widths=[0,32,64]"], "model.model_kwargs.widths",
         r"^model.model_kwargs.widths=\[0, 32, 64\] must be channel counts >= 1"),
        (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val", r"^trainer.gradient_clip_val=-1 must be a number >= 0"),
        (["model.bn_span=3"], "model.bn_span",
         r"^model.bn_span=3 must divide the per-device batch \(16\) .*: use bn_span=2 or 4$"),
        (["strategy=hier_ring", "strategy.compression=topk", "strategy.topk_momentum=0.9", "trainer.devices=2",
          "optimizer.momentum=0", "optimizer.nesterov=false"], "strategy.topk_momentum",
         r"^strategy.topk_momentum=0.9 moves the optimizer's momentum into the top-k stage between nodes, which "
         r"this run does not have \(one node\)"),
        (["strategy=hier_ring", "strategy.compression=topk", "strategy.topk_momentum=0.9", "trainer.devices=2",
          "strategy.ranks_per_node=1"], "strategy.topk_momentum",
         r"^strategy.topk_momentum=0.9 moves the momentum into the top-k stage .*keeps its own \(momentum=0.9\): "
         r"set optimizer.momentum=0 optimizer.nesterov=false \(and optimizer.weight_decay x 10 for the same decay\)"),
        (["strategy=hier_ring", "strategy.topk_momentum=0.9"], "strategy.topk_momentum",
         r"^strategy.topk_momentum=0.9 corrects top-k's error feedback: set strategy.compression=topk too"),
        (["model.bn_span=48", "trainer.devices=2"], "model.bn_span",
         r"^model.bn_span=48 must divide the per-device batch \(16\) .*: use bn_span=32$"),
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


def test_misspelt_group_names_the_nearest_before_hydra_starts():
    with pytest.raises(ConfigError, match=r"^precison: no config group or key .*did you mean precision=lars_bf16\?$"):
        check_group_names(["trainer.max_epochs=1", "precison=lars_bf16"], config_names())
    check_group_names(["precision=lars_bf16", "+trainer.limit_train_batches=2", "hydra/launcher=slurm", "-m", "seed=1"],
                      config_names())  # real names, additions and flags pass


def test_fp16_on_a_cpu_builds_with_a_warning_naming_bf16(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_MODE", "offline")
    _build(["precision=lars_fp16"], tmp_path / "run")
    warned = [r.getMessage() for r in caplog.records if "fp16" in r.getMessage()]
    assert warned == ["precision=lars_fp16 on a CPU: fp16 runs emulated there, many times slower than bf16; "
                      "use precision=lars_bf16"]


def test_good_settings_build(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    _, _, trainer = _build(["strategy=hier_ring", "strategy.bucket_cap_mb=5", "trainer.devices=2",
                            "strategy.ranks_per_node=1"], tmp_path / "run")
    assert trainer.strategy.check_topology().num_nodes == 2


def test_bn_span_setting_adds_the_callback_and_leaves_the_model_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    _, module, trainer = _build(["model.bn_span=32", "trainer.devices=2"], tmp_path / "run")
    assert [c.span for c in trainer.callbacks if isinstance(c, BNSpan)] == [32]  # 16 images x 2 ranks
    assert "bn_span" not in module.hparams


def _console(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([str(Path(sys.executable).with_name("fastscale-train")), *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("overrides", "line"), [
    (["optimizer.lr=-1"], "fastscale-train: error: optimizer.lr=-1: Invalid learning rate"),
    (["data=imagefolder"], "fastscale-train: error: data.root has no value"),  # Hydra's MissingMandatoryValue before
])
def test_console_prints_one_line_exits_2_and_leaves_no_run_folder(tmp_path, overrides, line):
    proc = _console(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(line)
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "run folder" in errors[0] and "removed" in errors[0]
    assert not [p for p in (tmp_path / "outputs").glob("*/*")]  # the timestamped folder is gone
    assert not (tmp_path / "wandb").exists()


def test_console_misspelt_group_exits_2_before_any_folder(tmp_path):
    proc = _console(tmp_path, "precison=lars_bf16")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "fastscale-train: error: precison: no config group or key of that name (precison=lars_bf16); "
        "did you mean precision=lars_bf16?"], proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()
