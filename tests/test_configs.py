"""Every file in conf/ composes with the main config and builds the objects it describes.

Each built object is checked against the composed config (class from ``_target_``, the key
settings), so a config that silently falls back to a default, or builds the wrong class,
fails here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.strategies import SingleDeviceStrategy
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_fastscale import train as train_module
from lightning_fastscale.callbacks import BatchSizeRamp, LabelSmoothing, WarmupDecayLR
from lightning_fastscale.conf import autocast_device
from lightning_fastscale.data.convert import convert
from lightning_fastscale.precision import LARSMixedPrecision
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy
from tests.test_data_imagefolder import _write_tree

CONF = Path(__file__).resolve().parents[1] / "lightning_fastscale" / "conf"
GROUP_OPTIONS = sorted(
    (group.name, option.stem)
    for group in CONF.iterdir() if group.is_dir()
    for option in group.glob("*.yaml")
)


def build(overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[DictConfig, Any, Any, Any]:
    """Compose ``train`` with ``overrides`` and build it on this CPU at one device."""
    monkeypatch.chdir(tmp_path)
    _write_tree(tmp_path / "imagenet", per_class=1)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
        cfg.hydra.job.num = 0
        # objects are instantiated on this CPU-only machine at a toy size
        if "root" in cfg.data.keys():
            cfg.data.root = str(tmp_path / "imagenet")
            if cfg.data._target_.endswith("StreamingDataModule"):  # reads a converted copy
                cfg.data.root = str(tmp_path / "imagenet-stream")
                convert(tmp_path / "imagenet", cfg.data.root, max_side=256, num_workers=1, verbose=False)
        cfg.data.num_workers = 0
        cfg.trainer.accelerator = "cpu"
        cfg.trainer.devices = 1
        cfg.trainer.num_nodes = 1
    HydraConfig.instance().set_config(cfg)
    try:
        datamodule, module, trainer = train_module.build(cfg)
    finally:
        HydraConfig.instance().cfg = None
    module.trainer = trainer
    return cfg, datamodule, module, trainer


def optimizer_of(configured: Any) -> torch.optim.Optimizer:
    return configured["optimizer"] if isinstance(configured, dict) else configured


def assert_built_as_configured(cfg: DictConfig, datamodule: Any, module: Any, trainer: Any) -> None:
    """Check every group of ``cfg`` against what ``train.build`` made of it."""
    # data
    assert type(datamodule) is get_class(cfg.data._target_)
    assert datamodule.train_batch_size == cfg.data.batch_size
    assert datamodule.train_resolution == cfg.data.resolution
    # model: the configured classifier over the datamodule's classes at the configured resolution
    assert type(module) is get_class(cfg.model._target_)
    for key in ("channels_last", "compile", "compile_mode", "no_weight_decay_on_bias_norm"):
        assert module.hparams[key] == cfg.model[key], key
    side = cfg.data.resolution
    module.model.eval()
    with torch.no_grad():
        logits = module.model(torch.zeros(2, 3, side, side))
    assert logits.shape == (2, datamodule.num_classes)
    # optimizer and scheduler
    configured = module.configure_optimizers()
    optimizer = optimizer_of(configured)
    assert type(optimizer) is get_class(cfg.optimizer._target_)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr)
    if cfg.get("scheduler"):
        assert isinstance(configured, dict) and configured["lr_scheduler"]["scheduler"] is not None
    else:
        assert not isinstance(configured, dict), "no scheduler configured, yet configure_optimizers returned one"
    # precision: every option is a precision plugin handed to the Trainer
    node = cfg.precision
    plugin = trainer.precision_plugin
    assert type(plugin) is get_class(node._target_)
    for key in ("precision", "device", "eta"):
        if key in node:
            assert getattr(plugin, key) == node[key], key
    if "device" in node:
        assert node.device == "cpu"  # trainer.accelerator=cpu: autocast on the CPU
    # strategy: a _target_ node, or empty for Lightning's default ("auto": one CPU device, no DDP)
    node = cfg.get("strategy")
    if node:
        assert type(trainer.strategy) is get_class(node._target_)
        if "algorithm" in node:
            assert trainer.strategy.algorithm == node.algorithm
    else:
        assert isinstance(trainer.strategy, SingleDeviceStrategy)
    # logger
    node = cfg.get("logger")
    if node:
        assert type(trainer.logger) is get_class(node._target_)
    else:
        assert trainer.logger is None
    # callbacks: every configured one is there (monitors need a logger and are dropped without)
    expected = [get_class(c._target_) for c in (cfg.get("callbacks") or {}).values() if c]
    if not trainer.logger:
        expected = [c for c in expected if c not in (LearningRateMonitor, ThroughputMonitor)]
    built = [type(c) for c in trainer.callbacks]
    missing = [c.__name__ for c in expected if c not in built]
    assert not missing, f"configured callbacks not on the Trainer: {missing}"
    # trainer
    assert trainer.max_epochs == cfg.trainer.max_epochs


def test_every_group_has_options():
    groups = {g for g, _ in GROUP_OPTIONS}
    expected = {"model", "data", "optimizer", "scheduler", "trainer", "strategy", "precision",
                "callbacks", "logger", "experiment", "hparams_search"}
    assert expected <= groups, f"missing config groups: {expected - groups}"


@pytest.mark.parametrize("group, option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_option_builds_what_it_configures(group, option, tmp_path, monkeypatch):
    cfg, datamodule, module, trainer = build([f"{group}={option}"], tmp_path, monkeypatch)
    assert_built_as_configured(cfg, datamodule, module, trainer)
    if group == "hparams_search":
        sweeper = cfg.hydra.sweeper
        assert get_class(sweeper._target_).__name__ == "OptunaSweeper"
        assert "optimizer.lr" in sweeper.params


@pytest.mark.parametrize(
    "override, precision, eta",
    [("precision=lars_bf16", "bf16-mixed", 1e-3), ("precision=lars_fp16", "16-mixed", 1e-3),
     ("precision=lars_fp32", "32-true", 1e-3)],
)
def test_lars_precision_configs_build_the_plugin(override, precision, eta, tmp_path, monkeypatch):
    _, _, _, trainer = build([override], tmp_path, monkeypatch)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, LARSMixedPrecision)
    assert (plugin.precision, plugin.eta) == (precision, eta)


@pytest.mark.parametrize(
    "override, algorithm", [("strategy=hier_ring", "hier"), ("strategy=hier_torus", "torus2d"),
                            ("strategy=hier_auto", "auto")],
)
def test_hierarchical_strategy_configs(override, algorithm, tmp_path, monkeypatch):
    _, _, _, trainer = build([override], tmp_path, monkeypatch)
    strategy = trainer.strategy
    assert isinstance(strategy, HierarchicalAllReduceStrategy)
    assert strategy.algorithm == algorithm
    assert strategy.pipeline_chunk_mb == "auto"


def test_hier_powersgd_runs_torchs_powersgd_hook_between_the_nodes(tmp_path, monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    _, _, _, trainer = build(["strategy=hier_powersgd"], tmp_path, monkeypatch)
    strategy = trainer.strategy
    assert isinstance(strategy, HierarchicalAllReduceStrategy) and strategy.algorithm == "hier"
    assert strategy.user_hook.hook is powerSGD_hook.powerSGD_hook
    state = strategy.user_hook.state
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.process_group) == (4, 2, None)
    assert state.use_error_feedback


def test_large_batch_callbacks_replace_the_scheduler(tmp_path, monkeypatch):
    cfg, _, module, trainer = build(["experiment=large_batch"], tmp_path, monkeypatch)
    types = {type(c) for c in trainer.callbacks}
    assert {BatchSizeRamp, WarmupDecayLR, LabelSmoothing} <= types
    # WarmupDecayLR owns the LR, so the group turns the module's scheduler off
    assert not cfg.scheduler and not isinstance(module.configure_optimizers(), dict)
    # and the optimizer's bias/BN group gets no weight decay
    assert [g["weight_decay"] for g in module.configure_optimizers().param_groups] == [cfg.optimizer.weight_decay, 0.0]


@pytest.mark.parametrize(
    "override, plugin, precision",
    [("precision=fp32", "Precision", "32-true"), ("precision=bf16_mixed", "MixedPrecision", "bf16-mixed"),
     ("precision=fp16_mixed", "MixedPrecision", "16-mixed")],
)
def test_lightning_precision_configs_build_lightnings_plugins(override, plugin, precision, tmp_path, monkeypatch):
    """Lightning's own plugins, autocast on the device of trainer.accelerator (here the CPU)."""
    _, _, _, trainer = build([override], tmp_path, monkeypatch)
    assert type(trainer.precision_plugin).__name__ == plugin
    assert trainer.precision == precision
    if plugin == "MixedPrecision":
        assert trainer.precision_plugin.device == "cpu"
        assert (trainer.precision_plugin.scaler is not None) == (precision == "16-mixed")


@pytest.mark.parametrize(
    "accelerator, cuda, expected",
    [("cpu", True, "cpu"), ("gpu", True, "cuda"), ("cuda", True, "cuda"), ("auto", True, "cuda"), ("auto", False, "cpu")],
)
def test_autocast_device_follows_the_accelerator(accelerator, cuda, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert autocast_device(accelerator) == expected


def test_imagenet_resnet50_preset_carries_the_published_settings(tmp_path, monkeypatch):
    cfg, datamodule, module, trainer = build(["experiment=imagenet_resnet50_64k"], tmp_path, monkeypatch)
    # ResNet-50: 23,508,032 backbone parameters + a 2048-wide linear head (25,557,032 at 1000 classes)
    head = 2049 * datamodule.num_classes
    assert sum(p.numel() for p in module.model.parameters()) == 23_508_032 + head
    assert isinstance(trainer.precision_plugin, LARSMixedPrecision)
    assert trainer.precision_plugin.precision == "16-mixed"
    ramp = next(c for c in trainer.callbacks if isinstance(c, BatchSizeRamp))
    assert ramp.schedule == {0: 65536}
    lr = next(c for c in trainer.callbacks if isinstance(c, WarmupDecayLR))
    assert (lr.warmup_epochs, lr.power, lr.end_lr) == (25, 2.0, 1e-4)
    assert optimizer_of(module.configure_optimizers()).param_groups[0]["lr"] == 31.2
    assert trainer.max_epochs == 90
    assert OmegaConf.select(cfg, "callbacks.label_smoothing.smoothing") == 0.1
