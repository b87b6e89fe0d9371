"""``lightning_fastscale.diagnose`` on a user's own module and datamodule (not ImageClassifier), without Hydra.

Input-bound (a sleep per sample, 0 workers) and compute-bound (a wide net on in-memory-fast
data) on a plain ``pl.Trainer`` with Lightning's defaults; the same on 2 ranks (gloo), where every
rank returns the same diagnosis. The Hydra ``_target_`` route for the same classes builds.
"""
from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest

from lightning_fastscale import diagnose
from lightning_fastscale.diagnostics.doctor_report import dumps
from tests.distributed import run_distributed
from tests.outside_module import OutsideData, OutsideModule

QUICK = dict(warmup_steps=1, steps=8, compute_steps=2, loader_batches=2, max_workers=0)


def test_input_bound_outside_module_is_named_input(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path)
    d = diagnose(trainer, OutsideModule(), OutsideData(delay=0.004), **QUICK)  # ~32 ms of sleep per batch
    assert d.verdict.bottleneck == "input" and not d.verdict.too_close_to_call, d.verdict.reason
    doc = json.loads(dumps(d))  # what fastscale-doctor writes as doctor.json
    assert doc["bottleneck"] == "input" and doc["measurements"]["batch_size"] == 8
    assert len(doc["measurements"]["compute_alone_runs_s"]) == 3 and doc["measurements"]["threads"] >= 1
    assert len(doc["measurements"]["window_scores"]) == 4  # 8 steps after the warm-up, 4 windows


def test_compute_bound_outside_module_is_named_compute(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path)
    d = diagnose(trainer, OutsideModule(width=1024, depth=3), OutsideData(batch_size=64), **QUICK)
    assert d.verdict.bottleneck == "compute", d.verdict.reason


def test_verify_is_refused_with_the_hydra_route(tmp_path):
    with pytest.raises(ValueError, match="fastscale-doctor --verify"):
        diagnose(pl.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path), OutsideModule(), OutsideData(),
                 verify=True)


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    trainer = pl.Trainer(accelerator="cpu", devices=2, default_root_dir=tmp)
    d = diagnose(trainer, OutsideModule(), OutsideData(delay=0.004), **QUICK)
    return d.to_json()


def test_two_ranks_return_the_same_diagnosis_on_every_rank(tmp_path):
    r0, r1 = run_distributed(_two_ranks, 2, str(tmp_path), timeout=240)
    assert r0 == r1 and r0["bottleneck"] == "input" and len(r0["breakdown_per_rank"]) == 2
    assert "flat/fp32" in r0["measurements"]["allreduce_s"]


# docs/doctor.md's Hydra route: a user's own classes by _target_, the package's optimizer and scheduler groups dropped
TARGET_ROUTE = ["~model", "+model={_target_: tests.outside_module.OutsideModule, width: 32}",
                "~data", "+data={_target_: tests.outside_module.OutsideData, delay: 0.0}", "~optimizer", "~scheduler"]


def test_the_hydra_target_route_builds_the_users_own_classes(tmp_path, monkeypatch):
    from tests.test_train_validation import _build

    monkeypatch.setenv("WANDB_MODE", "offline")
    datamodule, module, trainer = _build(TARGET_ROUTE, tmp_path / "run", base=["trainer.accelerator=cpu"])
    assert isinstance(module, OutsideModule) and isinstance(datamodule, OutsideData)
    assert module.net[1].out_features == 32 and trainer.max_epochs is not None
