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
    # compute alone on one thread too, where the run has several (the oversubscribed-cores check)
    assert (doc["measurements"]["compute_alone_one_thread_s"] is not None) == (doc["measurements"]["threads"] > 1)
    assert len(doc["measurements"]["window_scores"]) == 4  # 8 steps after the warm-up, 4 windows


def test_compute_bound_outside_module_is_named_compute(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path)
    d = diagnose(trainer, OutsideModule(width=1024, depth=3), OutsideData(batch_size=64), **QUICK)
    assert d.verdict.bottleneck == "compute", d.verdict.reason


class RecordingData(OutsideData):
    """OutsideData that records the worker count of every loader it makes."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.workers_seen: list[int] = []

    def train_dataloader(self):
        self.workers_seen.append(self.num_workers)
        return super().train_dataloader()


def test_verify_applies_the_fix_to_the_datamodule_and_measures_it(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path)
    data = RecordingData(delay=0.004)
    d = diagnose(trainer, OutsideModule(), data, verify=True, verify_rounds=2, **dict(QUICK, max_workers=2))
    fix = d.fixes[0]
    assert d.verdict.bottleneck == "input" and fix.overrides == ["data.num_workers=2"], d.fixes
    # measured: 2 rounds of the baseline (0 workers) then the fix (2 workers), each 1 + 8 more steps
    assert data.workers_seen[-4:] == [0, 2, 0, 2] and data.num_workers == 0  # restored after its runs
    assert trainer.global_step == 5 * 9 and d.verify_rounds == 2
    assert fix.measured_speedup == pytest.approx(d.baseline_step_s / fix.verified_step_s)
    assert json.loads(dumps(d))["fixes"][0]["measured_speedup"] == fix.measured_speedup


def test_verify_leaves_a_fix_that_sets_no_attribute_of_the_users_objects_to_the_cli():
    from lightning_fastscale.diagnostics.doctor_probe import _attributes

    targets = {"model": OutsideModule(), "data": OutsideData()}
    assert _attributes(["data.num_workers=4"], targets) == {("data", "num_workers"): 4}
    assert _attributes(["strategy=hier_ring", "strategy.wire_dtype=bf16"], targets) is None
    assert _attributes(["model.channels_last=true"], targets) is None  # OutsideModule has no such attribute


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    trainer = pl.Trainer(accelerator="cpu", devices=2, default_root_dir=tmp)
    d = diagnose(trainer, OutsideModule(), OutsideData(delay=0.004), **QUICK)
    return d.to_json()


def _two_ranks_verified(rank: int, world_size: int, tmp: str) -> tuple[dict, list[int]]:
    os.environ["LOCAL_RANK"] = str(rank)
    trainer = pl.Trainer(accelerator="cpu", devices=2, default_root_dir=tmp)
    data = RecordingData(delay=0.004)
    d = diagnose(trainer, OutsideModule(), data, verify=True, **dict(QUICK, max_workers=2))
    return d.to_json(), data.workers_seen[-2:]


@pytest.mark.slow
def test_verify_on_two_ranks_refits_the_same_ddp_trainer(tmp_path):
    (r0, seen0), (r1, seen1) = run_distributed(_two_ranks_verified, 2, str(tmp_path), timeout=300)
    assert r0 == r1 and r0["fixes"][0]["overrides"] == ["data.num_workers=2"], r0["fixes"]
    assert seen0 == seen1 == [0, 2] and r0["fixes"][0]["measured_speedup"] > 0 and r0["verify_rounds"] == 1


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
