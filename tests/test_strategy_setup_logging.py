"""Setup of the Trainer strategy with one process: no collective, the plan logged at the right time.

One process has nothing to compare between nodes, so setup must not call a collective (a mocked
``init_process_group`` leaves none to call); the plan goes to rank-zero info at setup and to the
loggers only at train start, after Lightning's own hyper-parameters, unless the module opted out
with ``save_hyperparameters(logger=False)``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
import yaml
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from lightning_fastscale.strategies import HierarchicalAllReduceStrategy


class _Opted(BoringModel):
    def __init__(self, log_hparams: bool, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters(logger=log_hparams)


@pytest.fixture
def release_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@mock.patch("torch.distributed.init_process_group")
def test_no_collective_at_setup_with_one_process(init_process_group: mock.Mock) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=HierarchicalAllReduceStrategy())
    trainer.strategy.connect(BoringModel())
    with mock.patch.object(dist, "all_gather_object", side_effect=AssertionError("collective at setup")) as gather:
        trainer.strategy.setup_environment()
    init_process_group.assert_called_once()
    gather.assert_not_called()
    assert trainer.strategy.topology.world_size == 1


def _fit(tmp_path: Path, model: BoringModel, caplog: pytest.LogCaptureFixture) -> tuple[dict, list[str]]:
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HierarchicalAllReduceStrategy(), logger=logger, max_steps=1,
    )
    seen_before_train_start: list[str] = []

    class _Probe(pl.Callback):
        def setup(self, trainer, pl_module, stage):  # after the strategy's setup_environment
            seen_before_train_start.extend(logger.experiment.hparams)

        def on_train_start(self, trainer, pl_module):  # before the strategy's on_train_start
            seen_before_train_start.extend(logger.experiment.hparams)

    trainer.callbacks.append(_Probe())
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer.fit(model)
    written = tmp_path / "run" / "version_0" / "hparams.yaml"  # absent when nothing was logged
    hparams = yaml.safe_load(written.read_text()) or {} if written.exists() else {}
    return hparams, seen_before_train_start


def test_plan_logged_after_lightning_hparams(tmp_path: Path, caplog, release_process_group) -> None:
    hparams, seen_before_train_start = _fit(tmp_path, _Opted(log_hparams=True), caplog)
    assert hparams["width"] == 32  # Lightning's own hyper-parameters are still there
    assert hparams["strategy/algorithm"] == "flat"  # one node: the one all-reduce DDP runs itself
    assert hparams["strategy/comm_hook"] == "none (DDP's own all-reduce)"
    assert hparams["strategy/world_size"] == 1
    assert not any(key.startswith("strategy/") for key in seen_before_train_start), "plan written to the logger at setup"
    assert "HierarchicalAllReduceStrategy: algorithm=flat, num_nodes=1" in caplog.text
    assert "comm_hook=none (DDP's own all-reduce)" in caplog.text
    # strategy=hier_ring's algorithm runs as flat here: the plan line says so
    note = "algorithm='hier' runs as DDP's own flat all-reduce: one node, fp32, no compression"
    assert hparams["strategy/algorithm_note"] == note and f"algorithm_note={note}" in caplog.text


def test_plan_not_logged_when_module_opts_out(tmp_path: Path, caplog, release_process_group) -> None:
    hparams, _ = _fit(tmp_path, _Opted(log_hparams=False), caplog)
    assert not any(key.startswith("strategy/") for key in hparams)
    assert "HierarchicalAllReduceStrategy: algorithm=" in caplog.text  # still visible on rank zero
