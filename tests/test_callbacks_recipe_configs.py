"""Hydra: `experiment=large_batch` and the two 64K experiment presets compose, instantiate, run."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_fastscale.callbacks import (
    BatchSizeRamp,
    LabelSmoothing,
    ProgressiveResizing,
    WarmupDecayLR,
    ZeroInitResidualBN,
)
from lightning_fastscale.precision import LARSMixedPrecision

CONF = str(Path(__file__).resolve().parents[1] / "lightning_fastscale" / "conf")
RECIPE = {
    "batch_size_ramp": BatchSizeRamp,
    "warmup_decay_lr": WarmupDecayLR,
    "progressive_resizing": ProgressiveResizing,
    "label_smoothing": LabelSmoothing,
    "zero_init_residual_bn": ZeroInitResidualBN,
}


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _recipe_callbacks(cfg: DictConfig) -> dict[str, object]:
    return {name: instantiate(node) for name, node in cfg.callbacks.items() if node and name in RECIPE}


def test_large_batch_turns_on_every_technique_and_keeps_the_defaults() -> None:
    cfg = _compose("experiment=large_batch")
    assert {"model_checkpoint", "lr_monitor"} <= set(cfg.callbacks)
    built = _recipe_callbacks(cfg)
    assert {name: type(cb) for name, cb in built.items()} == RECIPE
    assert not cfg.scheduler  # WarmupDecayLR owns the LR: the cosine scheduler is switched off
    assert cfg.model.no_weight_decay_on_bias_norm is True  # in the optimizer's groups, not a callback


@pytest.mark.parametrize(
    ("experiment", "model", "epochs", "active"),
    [
        ("imagenet_resnet50_64k", "resnet50", 90, set(RECIPE) - {"progressive_resizing"}),
        (
            "imagenet_alexnet_bn_64k",
            "alexnet_bn",
            95,
            set(RECIPE) - {"progressive_resizing", "label_smoothing", "zero_init_residual_bn"},
        ),
    ],
)
def test_presets_compose_and_instantiate(experiment, model, epochs, active) -> None:
    cfg = _compose(f"experiment={experiment}", "data.root=/nonexistent")
    assert (cfg.model.model, cfg.trainer.max_epochs) == (model, epochs)
    assert cfg.model.no_weight_decay_on_bias_norm is True
    assert cfg.strategy._target_.endswith("HierarchicalAllReduceStrategy")
    built = _recipe_callbacks(cfg)
    assert set(built) == active
    assert built["batch_size_ramp"].schedule == {0: 65536}
    plugin = instantiate(cfg.precision)
    assert isinstance(plugin, LARSMixedPrecision) and plugin.eta == 0.001


def test_default_job_trains_with_the_whole_recipe(tmp_path) -> None:
    from lightning_fastscale.train import build

    cfg = _compose(
        "experiment=large_batch",
        "logger=csv",
        f"logger.save_dir={tmp_path}",
        "trainer=cpu",
        "trainer.max_epochs=3",
        "trainer.enable_progress_bar=false",
        f"trainer.default_root_dir={tmp_path}",
        f"callbacks.model_checkpoint.dirpath={tmp_path}/ckpt",
        f"callbacks.step_breakdown.dirpath={tmp_path}",
        f"callbacks.time_to_accuracy.dirpath={tmp_path}",
        "model.model_kwargs.widths=[4,8,8]",
        "data.train_size=64",
        "data.val_size=32",
        "data.batch_size=16",
        "data.resolution=16",
    )
    datamodule, module, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.current_epoch == 3
    assert datamodule.train_batch_size == 32  # Smith ramp: doubled at epoch 2
    assert trainer.callback_metrics["label_smoothing"].item() == pytest.approx(0.1)
    assert [g["weight_decay"] for g in trainer.optimizers[0].param_groups] == [5e-4, 0.0]
