"""Time to accuracy: the clock and crossing rule on a controlled clock, real fits (one process and two
gloo ranks, a plain Trainer and Fabric), stop at the target, resume, and the summary in the JSON,
CSV and W&B logs.

The fits use a scripted validation metric (a value per epoch) and a clock that the module itself
advances: 10 s per training batch, 1 s per validation batch, so every expected time is a sum of
those (nothing else moves the clock).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastscale import TimeToAccuracy
from lightning_fastscale.diagnostics import AccuracyClock, FabricTimeToAccuracy, summary_line
from lightning_fastscale.diagnostics.time_to_accuracy import format_duration, process_age
from tests.distributed import run_distributed

TRAIN_S, VAL_S = 10.0, 1.0
BATCH, TRAIN_BATCHES, VAL_BATCHES = 8, 4, 2
EPOCH_S = TRAIN_BATCHES * TRAIN_S + VAL_BATCHES * VAL_S  # 42 s
SANITY_S = VAL_BATCHES * VAL_S  # Lightning's sanity check: 2 validation batches
CURVE = [0.25, 0.5, 0.875, 0.9375, 0.96875]  # val/top1 per epoch (exact in float32): 0.875 is reached at the 3rd
TARGET = 0.875


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted(pl.LightningModule):
    """A small classifier whose ``val/top1`` follows ``curve`` by epoch and which advances ``clock``."""

    def __init__(self, clock: Clock, curve=CURVE, per_rank: dict[int, list[float]] | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.clock, self.curve, self.per_rank = clock, curve, per_rank

    def training_step(self, batch, batch_idx):
        self.clock.now += TRAIN_S
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.clock.now += VAL_S
        curve = self.per_rank[self.global_rank] if self.per_rank else self.curve
        value = curve[min(self.current_epoch, len(curve) - 1)]
        # synced unless the test gives each rank its own curve on purpose
        self.log("val/top1", value, sync_dist=self.per_rank is None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loaders(world: int = 1) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(TRAIN_BATCHES * BATCH * world, 4, generator=g), torch.randint(0, 2, (TRAIN_BATCHES * BATCH * world,), generator=g))
    val = TensorDataset(torch.randn(VAL_BATCHES * BATCH * world, 4, generator=g), torch.randint(0, 2, (VAL_BATCHES * BATCH * world,), generator=g))
    return DataLoader(train, batch_size=BATCH), DataLoader(val, batch_size=BATCH)


# -- pure core ----------------------------------------------------------------------------------
def test_crossing_is_the_first_validation_at_or_above_the_target_and_its_summary():
    clock = Clock()
    c = AccuracyClock("val/top1", target=0.9, price_per_device_hour=3.0, clock=clock)
    c.world_size = 8
    c.start()
    for t, value, crossed in ((100, 0.5, False), (200, float("nan"), False), (300, 0.9, True), (400, 0.95, False)):
        clock.now = t - 5
        c.validation_started()
        clock.now = t
        c.validation_ended()
        c.count(64)
        assert c.record(value, epochs=t / 100, steps=t) is crossed
    clock.now = 450
    s = c.finish(epochs=4.5, steps=450)
    assert s["reached"] and s["seconds"] == 300 and s["epochs"] == 3 and s["steps"] == 300 and s["samples"] == 192
    assert s["validation_seconds"] == 15 and s["run_seconds"] == 450 and s["validations"] == 4
    assert s["device_hours"] == pytest.approx(300 * 8 / 3600) and s["cost"] == pytest.approx(3 * 300 * 8 / 3600)
    assert s["best"] == 0.95 and s["best_seconds"] == 400
    assert s["curve"] == [[100, 0.5], [200, None], [300, 0.9], [400, 0.95]]
    json.dumps(s)  # plain data


def test_not_reached_no_target_and_mode_min():
    clock = Clock()
    c = AccuracyClock("val/top1", target=0.99, clock=clock)
    c.start()
    clock.now = 60
    c.record(0.7, epochs=1, steps=10)
    clock.now = 90
    s = c.finish(epochs=1, steps=10)
    assert not s["reached"] and s["seconds"] == 90 and s["best"] == 0.7 and s["cost"] is None
    assert summary_line(s) == ("did not reach val/top1 >= 0.99 in 1 min 30 s: 1 epochs, 10 steps, 0 samples, "
                               "0.025 device-hours; best 0.7 at 1 min 0 s")
    none = AccuracyClock("val/top1", clock=clock)
    none.start()
    assert not none.record(1.0, epochs=1, steps=1) and none.finish(1, 1)["reached"] is False
    loss = AccuracyClock("val/loss", target=0.5, mode="min", clock=clock)
    loss.start()
    assert not loss.record(0.6, 1, 1) and loss.record(0.5, 2, 2)
    # a metric logged in float32 (as Lightning logs) at the target reaches it
    f32 = AccuracyClock("val/top1", target=0.9, clock=clock)
    f32.start()
    assert f32.record(torch.tensor(0.9).item(), 1, 1)
    with pytest.raises(ValueError, match="mode"):
        AccuracyClock(mode="up")


def test_console_line_format():
    s = {"metric": "val/top1", "target": 0.93, "mode": "max", "reached": True, "seconds": 1078.0, "epochs": 31.0,
         "steps": 9920, "samples": 2.9e6, "device_hours": 1078 * 8 / 3600, "cost": 40.1}
    assert summary_line(s) == ("reached val/top1 >= 0.93 in 17 min 58 s: 31 epochs, 9,920 steps, 2.9M samples, "
                               "2.4 device-hours, $40.10")
    assert format_duration(3723) == "1 h 02 min 03 s" and format_duration(12.34) == "12.3 s"


def test_process_age_is_this_process_lifetime():
    age = process_age()
    assert age is not None and 0 < age < 3600  # this test process started before the test, not hours ago


def test_resume_state_carries_elapsed_time_and_reports_downtime():
    clock = Clock()
    first = AccuracyClock("m", target=1.0, clock=clock)
    first.start()
    clock.now = 100
    first.count(10)
    first.record(0.5, 1, 5)
    clock.now = 120
    state = first.state_dict()
    clock.now = 1120  # the job is down for 1000 s
    second = AccuracyClock("m", target=1.0, clock=clock)
    second.start()
    second.load_state_dict(state)
    clock.now = 1150
    second.count(6)
    assert second.record(1.0, 2, 8)
    s = second.summary()
    assert s["seconds"] == 150 and s["downtime_seconds"] == 1000 and s["samples"] == 16
    assert s["curve"] == [[100, 0.5], [150, 1.0]]


# -- Lightning: one process ---------------------------------------------------------------------
def _fit(tmp_path: Path, clock: Clock, tta: TimeToAccuracy, max_epochs: int = 5, ckpt_path=None, **kw) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, default_root_dir=tmp_path,
                         callbacks=[tta], **kw)
    trainer.fit(Scripted(clock), *loaders(), ckpt_path=ckpt_path)
    return trainer


def test_fit_times_on_a_controlled_clock_json_and_csv_logger(tmp_path, caplog):
    clock = Clock()
    tta = TimeToAccuracy(target=TARGET, price_per_device_hour=2.0, clock=clock)
    trainer = _fit(tmp_path, clock, tta, logger=CSVLogger(tmp_path / "csv"))
    s = tta.summary
    crossing = SANITY_S + 3 * EPOCH_S  # the end of the 3rd epoch's validation
    assert s["reached"] and s["seconds"] == crossing == 128
    assert s["validation_seconds"] == SANITY_S + 3 * VAL_BATCHES * VAL_S
    assert (s["epochs"], s["steps"], s["samples"]) == (3, 3 * TRAIN_BATCHES, 3 * TRAIN_BATCHES * BATCH)
    assert s["run_seconds"] == SANITY_S + 5 * EPOCH_S  # stop=False: the fit went on
    assert s["curve"] == [[SANITY_S + (e + 1) * EPOCH_S, v] for e, v in enumerate(CURVE)]
    assert s["device_hours"] == pytest.approx(128 / 3600) and s["cost"] == pytest.approx(2 * 128 / 3600)
    assert s["startup_seconds"] is not None and s["startup_seconds"] >= 0 and s["downtime_seconds"] == 0
    assert trainer.global_step == 5 * TRAIN_BATCHES
    # the CSV logger's folder is the Trainer's log_dir: one JSON there, the same values
    log_dir = Path(trainer.log_dir)
    assert (log_dir / "metrics.csv").exists() and (log_dir / "time_to_accuracy.png").stat().st_size > 0
    assert json.loads((log_dir / "time_to_accuracy.json").read_text()) == s
    assert any(summary_line(s) in m for m in caplog.messages)  # the console line, on rank zero


def test_stop_ends_the_fit_at_the_crossing_with_checkpoint_and_logger_closed(tmp_path):
    clock = Clock()
    tta = TimeToAccuracy(target=TARGET, stop=True, clock=clock, dirpath=tmp_path / "run")
    csv = CSVLogger(tmp_path / "csv")
    trainer = _fit(tmp_path, clock, tta, max_epochs=10, logger=csv)
    assert trainer.state.status == "finished" and trainer.global_step == 3 * TRAIN_BATCHES
    assert tta.summary["seconds"] == tta.summary["run_seconds"] == clock.now == 128
    # the checkpoint of the crossing epoch was written as at any epoch end, and it carries the clock
    (ckpt,) = Path(trainer.checkpoint_callback.dirpath).glob("*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == 12 and state["callbacks"]["TimeToAccuracy"]["elapsed"] == 128
    # the logger was finalized: every validation's row is in metrics.csv; the JSON beside it too
    rows = (Path(csv.log_dir) / "metrics.csv").read_text().splitlines()
    assert sum(any(f",{v}," in r + "," for v in CURVE) for r in rows) == 3
    assert json.loads((Path(csv.log_dir) / "time_to_accuracy.json").read_text()) == tta.summary
    assert json.loads((tmp_path / "run" / "time_to_accuracy.json").read_text()) == tta.summary


def test_resume_carries_elapsed_time_and_reports_downtime(tmp_path):
    clock = Clock()
    first = TimeToAccuracy(target=TARGET, clock=clock)
    trainer = _fit(tmp_path / "a", clock, first, max_epochs=2)
    ckpt = trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    assert first.summary["run_seconds"] == SANITY_S + 2 * EPOCH_S == clock.now
    clock.now += 1000.0  # the job is down
    second = TimeToAccuracy(target=TARGET, clock=clock)
    _fit(tmp_path / "b", clock, second, max_epochs=5, ckpt_path=ckpt)
    s = second.summary
    # uninterrupted: 128 s; the resumed run adds its own sanity check, and not the 1000 s between
    assert s["seconds"] == SANITY_S + 3 * EPOCH_S + SANITY_S and s["downtime_seconds"] == 1000
    assert (s["epochs"], s["steps"], s["samples"]) == (3, 12, 96)
    assert [p[1] for p in s["curve"]] == CURVE


def test_wandb_summary_carries_the_json_values(tmp_path):
    import wandb

    clock = Clock()
    tta = TimeToAccuracy(target=TARGET, clock=clock)
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="tta")
    trainer = _fit(tmp_path, clock, tta, max_epochs=3, logger=logger)
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    saved = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert Path(trainer.log_dir) == tmp_path and saved == tta.summary
    summary = wandb_summary(run_dir)
    for key, value in saved.items():
        assert summary[f"time_to_accuracy/{key}"] == value, key


def wandb_summary(run_dir: Path) -> dict:
    """The summary items of an offline W&B run file (the last value of each key).

    A summary item is its key (field 1) followed by its JSON value (field 16) in ``run-*.wandb``.
    """
    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    out = {}
    for m in re.finditer(rb"\n[\x01-\x7f](time_to_accuracy/\w+)\x82\x01", data):
        at, size, shift = m.end(), 0, 0
        while True:  # the value's length, a protobuf varint
            byte = data[at]
            size |= (byte & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if byte < 0x80:
                break
        out[m.group(1).decode()] = json.loads(data[at:at + size])
    return out


# -- Lightning: two ranks, a plain Trainer with its defaults ------------------------------------
def _two_ranks(rank: int, world: int, tmp: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group
    out = {}
    tta = TimeToAccuracy()  # no arguments: val/top1, no target, folder from the Trainer
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2,
                         default_root_dir=Path(tmp) / "plain", callbacks=[tta])
    trainer.fit(Scripted(Clock()), *loaders(world))
    out["plain"] = (tta.summary, str(trainer.log_dir))
    # each rank logs its own unsynced metric: rank zero's decides, on both ranks
    clock = Clock()
    tta = TimeToAccuracy(target=TARGET, stop=True, clock=clock)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=5,
                         default_root_dir=Path(tmp) / "stop", callbacks=[tta])
    per_rank = {0: CURVE, 1: [0.95] * 5}
    trainer.fit(Scripted(clock, per_rank=per_rank), *loaders(world))
    out["stop"] = (tta.summary, trainer.global_step, trainer.state.status)
    # Fabric: each rank its own clock, metric and batch size; rank zero's clock and metric decide
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    clock = Clock()
    clock.now = 1000.0 * rank
    ftta = FabricTimeToAccuracy(fabric, target=TARGET, clock=clock)
    crossed = []
    for epoch, value in enumerate([0.5, TARGET] if rank == 0 else [0.9, 0.9]):
        clock.now += 30
        ftta.count(BATCH * (rank + 1))
        with ftta.validating():
            clock.now += 2
        crossed.append(ftta.record(value, epochs=epoch + 1, steps=epoch + 1))
    summary = ftta.finish(epochs=2, steps=2, verbose=False)
    out["fabric"] = (crossed, summary, ftta.save(Path(tmp) / "fabric"))
    return out


def test_two_ranks_plain_trainer_defaults_agree_and_stop_together(tmp_path):
    r0, r1 = run_distributed(_two_ranks, 2, str(tmp_path), timeout=240)
    (s0, dir0), (s1, dir1) = r0["plain"], r1["plain"]
    assert s0 == s1 and dir0 == dir1
    assert s0["metric"] == "val/top1" and s0["target"] is None and not s0["reached"] and s0["world_size"] == 2
    assert s0["samples"] == 2 * 2 * TRAIN_BATCHES * BATCH  # both ranks' batches, both epochs
    assert s0["steps"] == 2 * TRAIN_BATCHES and s0["epochs"] == 2 and [v for _, v in s0["curve"]] == CURVE[:2]
    assert json.loads((Path(dir0) / "time_to_accuracy.json").read_text()) == s0
    (t0, step0, status0), (t1, step1, status1) = r0["stop"], r1["stop"]
    assert t0 == t1 and t0["reached"] and t0["epochs"] == 3  # rank 0's curve, on rank 1 too
    assert step0 == step1 == 3 * TRAIN_BATCHES and status0 == status1 == "finished"
    assert not math.isnan(t0["seconds"])
    (c0, f0, p0), (c1, f1, p1) = r0["fabric"], r1["fabric"]
    assert c0 == c1 == [False, True] and f0 == f1
    assert f0["seconds"] == 64 and f0["validation_seconds"] == 4 and f0["samples"] == 2 * (BATCH + 2 * BATCH)
    assert p1 == {} and json.loads(p0["json"].read_text()) == f0
