"""Every file in conf/ composes with the main config and its objects instantiate."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from lightning_fastscale import train as train_module
from tests.test_data_imagefolder import _write_tree

CONF = Path(__file__).resolve().parents[1] / "lightning_fastscale" / "conf"
GROUP_OPTIONS = sorted(
    (group.name, option.stem)
    for group in CONF.iterdir() if group.is_dir()
    for option in group.glob("*.yaml")
)


def test_every_group_has_options():
    groups = {g for g, _ in GROUP_OPTIONS}
    expected = {"model", "data", "optimizer", "scheduler", "trainer", "strategy", "precision",
                "callbacks", "logger", "experiment", "hparams_search"}
    assert expected <= groups, f"missing config groups: {expected - groups}"


@pytest.mark.parametrize("group, option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_option_composes_and_instantiates(group, option, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write_tree(tmp_path / "imagenet", per_class=1)
    overrides = [f"{group}={option}"]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
        cfg.hydra.job.num = 0
        # objects are instantiated on this CPU-only machine at a toy size
        if "root" in cfg.data.keys():
            cfg.data.root = str(tmp_path / "imagenet")
        cfg.data.num_workers = 0
        cfg.trainer.accelerator = "cpu"
        cfg.trainer.devices = 1
        cfg.trainer.num_nodes = 1
    HydraConfig.instance().set_config(cfg)
    try:
        datamodule, module, trainer = train_module.build(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert module.model is not None and trainer is not None
    module.trainer = trainer
    optimizers = module.configure_optimizers()
    assert optimizers is not None
