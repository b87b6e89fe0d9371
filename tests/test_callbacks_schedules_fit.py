"""BatchSizeRamp, WarmupDecayLR and ProgressiveResizing wired into real Trainer runs.

Self-contained: a tiny conv net and a datamodule implementing both datamodule protocols.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_fastscale.callbacks import BatchSizeRamp, ProgressiveResizing, WarmupDecayLR
from lightning_fastscale.callbacks.lr_schedule import lr_at
from lightning_fastscale.data.protocol import check_positive
from tests.distributed import ReleaseProcessGroup

TRAIN_SIZE = 64


class Images(Dataset):
    """Fixed random images (by seed) served at any resolution; label = index parity."""

    def __init__(self, size: int, resolution: int, seed: int = 0) -> None:
        base = torch.randn(size, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
        self.x = base if resolution == 16 else F.interpolate(base, size=(resolution, resolution), mode="bilinear")
        self.y = torch.arange(size) % 2

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class ControllableDM(pl.LightningDataModule):
    """Implements BatchSizeControllable and ResolutionControllable."""

    def __init__(self, batch_size: int = 4, resolution: int = 16, val_resolution: int = 16) -> None:
        super().__init__()
        self.train_batch_size = batch_size
        self.train_resolution = resolution
        self.val_resolution = val_resolution

    def set_train_batch_size(self, n: int) -> None:
        self.train_batch_size = check_positive("train_batch_size", n)

    def set_train_resolution(self, px: int) -> None:
        self.train_resolution = check_positive("train_resolution", px)

    def set_val_resolution(self, px: int) -> None:
        self.val_resolution = check_positive("val_resolution", px)

    def train_dataloader(self):
        return DataLoader(Images(TRAIN_SIZE, self.train_resolution), batch_size=self.train_batch_size)

    def val_dataloader(self):
        return DataLoader(Images(8, self.val_resolution, seed=1), batch_size=4)


class PlainDM(pl.LightningDataModule):
    """Implements neither protocol."""

    def __init__(self, tuple_batches: bool = False) -> None:
        super().__init__()
        self.tuple_batches = tuple_batches

    def train_dataloader(self):
        collate = (lambda s: tuple(torch.utils.data.default_collate(s))) if self.tuple_batches else None
        return DataLoader(Images(16, 16), batch_size=4, collate_fn=collate)

    def val_dataloader(self):
        return DataLoader(Images(8, 16, seed=1), batch_size=4)


class CachingDM(ControllableDM):
    """Breaks the protocol: keeps serving its first loader."""

    def train_dataloader(self):
        if not hasattr(self, "_loader"):
            self._loader = super().train_dataloader()
        return self._loader


class TinyNet(pl.LightningModule):
    """Records what it trains on: images' size and samples per optimizer step."""

    def __init__(self, lr: float = 0.1, record_dir: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
        self.lr = lr
        self.record_dir = record_dir
        self.train_shapes: list[tuple[int, tuple[int, ...]]] = []
        self.val_shapes: list[tuple[int, ...]] = []
        self.samples_per_step: list[tuple[int, int]] = []
        self.lrs: list[float] = []
        self._since_step = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.train_shapes.append((self.current_epoch, tuple(x.shape)))
        self._since_step += len(x)
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.val_shapes.append(tuple(batch[0].shape))

    def on_before_optimizer_step(self, optimizer):
        self.samples_per_step.append((self.current_epoch, self._since_step))
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self._since_step = 0

    def on_train_end(self):
        if self.record_dir is not None:
            Path(self.record_dir, f"rank{self.global_rank}.json").write_text(json.dumps({
                "samples_per_step": self.samples_per_step,
                "weight": self.net[0].weight.flatten().tolist(),
            }))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def trainer(tmp_path, callbacks, max_epochs=3, **kw) -> pl.Trainer:
    kw.setdefault("limit_val_batches", 0)
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, callbacks=callbacks, default_root_dir=tmp_path, **kw,
    )


# --------------------------------------------------------------------------- BatchSizeRamp


def test_ramp_trains_with_scheduled_global_batch_on_two_processes(tmp_path):
    """DDP on 2 CPU processes: samples per optimizer step (summed over ranks) follow the ramp."""
    schedule = {0: 8, 1: 16, 2: 32}
    t = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=3,
        limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=[BatchSizeRamp(schedule, max_per_device_batch=8), ReleaseProcessGroup()],
    )
    t.fit(TinyNet(record_dir=str(tmp_path)), ControllableDM(batch_size=99))
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    per_rank = [r["samples_per_step"] for r in ranks]
    assert [e for e, _ in per_rank[0]] == [e for e, _ in per_rank[1]]
    global_steps = [(e, n0 + n1) for (e, n0), (_, n1) in zip(*per_rank)]
    # 64 samples per epoch: 8 steps of 8, 4 of 16, then 2 of 32 (8 per device x 2 ranks x 2 accumulation).
    assert global_steps == [(0, 8)] * 8 + [(1, 16)] * 4 + [(2, 32)] * 2
    assert ranks[0]["weight"] == ranks[1]["weight"]  # DDP kept replicas identical


def run_ramp_with_schedule(tmp_path, max_epochs, ckpt_path=None, checkpoint_dir=None):
    callbacks = [
        BatchSizeRamp({0: 8, 1: 16, 2: 32}, max_per_device_batch=8),
        WarmupDecayLR(warmup_epochs=1.5, total_epochs=4, reference_batch=8, end_lr=1e-3),
        ProgressiveResizing({0: 8, 3: 12}),
    ]
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True))
    model = TinyNet(lr=0.05)
    t = trainer(tmp_path, callbacks, max_epochs=max_epochs,
                enable_checkpointing=checkpoint_dir is not None)
    t.fit(model, ControllableDM(), ckpt_path=ckpt_path)
    return model


def test_resume_in_the_middle_of_the_ramp_matches_uninterrupted_run(tmp_path):
    full = run_ramp_with_schedule(tmp_path / "full", 4)
    run_ramp_with_schedule(tmp_path / "a", 2, checkpoint_dir=tmp_path / "ckpt")
    resumed = run_ramp_with_schedule(tmp_path / "b", 4, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    # The resumed run did epochs 2-3 only, with epoch 2's accumulation (32 = 8 x 4) and LRs.
    assert [n for _, n in resumed.samples_per_step] == [32] * 4
    assert resumed.lrs == full.lrs[-4:]
    assert sorted({(e, s[-1]) for e, s in resumed.train_shapes}) == [(2, 8), (3, 12)]
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_resume_with_a_different_ramp_is_refused(tmp_path):
    run_ramp_with_schedule(tmp_path / "a", 1, checkpoint_dir=tmp_path / "ckpt")
    t = trainer(tmp_path, [BatchSizeRamp({0: 8, 1: 64}, max_per_device_batch=8)], max_epochs=2)
    with pytest.raises(ValueError, match="resume with the same settings"):
        t.fit(TinyNet(), ControllableDM(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))


def test_ramp_scale_lr_follows_linear_rule(tmp_path):
    model = TinyNet(lr=0.1)
    trainer(tmp_path, [BatchSizeRamp({0: 8, 1: 32}, scale_lr=True)], max_epochs=2).fit(model, ControllableDM())
    assert model.lrs == pytest.approx([0.1] * 8 + [0.4] * 2)


@pytest.mark.parametrize(
    "dm, callbacks, error, message",
    [
        (PlainDM(), [BatchSizeRamp({0: 8})], TypeError, "BatchSizeControllable"),
        (CachingDM(), [BatchSizeRamp({0: 4, 1: 8})], RuntimeError, "do not cache"),
        (ControllableDM(), [BatchSizeRamp({0: 8}, scale_lr=True), WarmupDecayLR(warmup_epochs=1)],
         ValueError, "both set the learning rate"),
    ],
)
def test_ramp_misuse_errors(tmp_path, dm, callbacks, error, message):
    t = trainer(tmp_path, callbacks, max_epochs=2)
    with pytest.raises(error, match=message):
        t.fit(TinyNet(), dm)


def test_ramp_setup_refuses_a_size_not_divisible_by_world_size():
    """The setup check sees the real world size; a stand-in trainer avoids starting 4 processes."""
    ramp = BatchSizeRamp({0: 8, 3: 10})
    fake = SimpleNamespace(datamodule=ControllableDM(), world_size=4, callbacks=[ramp],
                           reload_dataloaders_every_n_epochs=0, accumulate_grad_batches=1)
    with pytest.raises(ValueError, match=r"global batch 10 is not divisible by the world size 4.*e\.g\. 8 or 12"):
        ramp.setup(fake, TinyNet(), "fit")
    ramp = BatchSizeRamp({0: 8, 3: 12})
    ramp.setup(fake, TinyNet(), "fit")
    assert fake.reload_dataloaders_every_n_epochs == 1
    assert ramp.plan(3) == ramp.plan(3, world_size=4) and ramp.plan(3).per_device == 3


def test_ramp_refuses_trainer_accumulation(tmp_path):
    t = trainer(tmp_path, [BatchSizeRamp({0: 8})], accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\) and BatchSizeRamp"):
        t.fit(TinyNet(), ControllableDM())


def test_ramp_refuses_scale_lr_with_module_scheduler(tmp_path):
    class WithScheduler(TinyNet):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    t = trainer(tmp_path, [BatchSizeRamp({0: 8}, scale_lr=True)])
    with pytest.raises(ValueError, match="fight the LR scheduler"):
        t.fit(WithScheduler(), ControllableDM())
    t = trainer(tmp_path, [WarmupDecayLR(warmup_epochs=1)])
    with pytest.raises(ValueError, match="owns the learning rate"):
        t.fit(WithScheduler(), ControllableDM())


# --------------------------------------------------------------------------- WarmupDecayLR


def test_a_second_fit_with_the_same_callbacks_starts_afresh(tmp_path):
    callbacks = [BatchSizeRamp({0: 16, 1: 32}), WarmupDecayLR(warmup_epochs=1, total_epochs=2),
                 ProgressiveResizing({0: 8, 1: 12})]
    first, second = TinyNet(), TinyNet()
    trainer(tmp_path, callbacks, max_epochs=2).fit(first, ControllableDM())
    trainer(tmp_path, callbacks, max_epochs=2).fit(second, ControllableDM())
    assert first.lrs == second.lrs and first.train_shapes == second.train_shapes
    assert first.samples_per_step == second.samples_per_step == [(0, 16)] * 4 + [(1, 32)] * 2


def test_warmup_follows_the_curve_and_the_ramp(tmp_path):
    """LR per step = lr_at(applied steps in epochs) x current global batch / reference."""
    model = TinyNet(lr=0.1)
    cb = WarmupDecayLR(warmup_epochs=1, total_epochs=3, decay="cosine", reference_batch=16)
    trainer(tmp_path, [BatchSizeRamp({0: 16, 1: 32}), cb], max_epochs=3).fit(model, ControllableDM())
    expected = [lr_at(i / 4, 0.1 * 16 / 16, warmup_epochs=1, total_epochs=3, decay="cosine") for i in range(4)]
    expected += [lr_at(1 + i / 2, 0.1 * 32 / 16, warmup_epochs=1, total_epochs=3, decay="cosine")
                 for i in range(2)] + [lr_at(2 + i / 2, 0.2, warmup_epochs=1, total_epochs=3, decay="cosine") for i in range(2)]
    assert model.lrs == pytest.approx(expected)
    assert cb.progress == pytest.approx(3.0)


class MetricsInMemory(pl.loggers.Logger):
    """A logger keeping every logged metric with its step."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, dict(metrics)))


def test_lr_monitor_logs_the_lr_each_step_applies(tmp_path):
    """Lightning's LearningRateMonitor (listed first, so it reads the optimizer before this
    callback's batch hooks run) logs at every step the LR that step applies, step 0 included,
    across a batch-size change that rescales the LR at the epoch boundary."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    model, memory = TinyNet(lr=0.1), MetricsInMemory()
    cb = WarmupDecayLR(warmup_epochs=1, total_epochs=3, decay="poly", reference_batch=16)
    pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, logger=memory, log_every_n_steps=1, limit_val_batches=0,
        callbacks=[LearningRateMonitor(logging_interval="step"), BatchSizeRamp({0: 16, 1: 32}), cb],
        default_root_dir=tmp_path,
    ).fit(model, ControllableDM())
    monitored = [m["lr-SGD"] for _, m in memory.metrics if "lr-SGD" in m]
    scheduled = [m["lr_schedule/lr"] for _, m in memory.metrics if "lr_schedule/lr" in m]
    assert len(model.lrs) == 8 and model.lrs[0] == 0.0  # warmup from 0, 4 + 2 + 2 steps
    assert monitored == pytest.approx(model.lrs)
    assert scheduled == pytest.approx(model.lrs)
    assert len(set(model.lrs)) == 7  # the LR moves at all but one step: a lag of one step would show


class InfOnSteps(TinyNet):
    """Makes the loss infinite on chosen batches so the fp16 GradScaler skips those steps."""

    def __init__(self, inf_batches, **kw):
        super().__init__(**kw)
        self.inf_batches = set(inf_batches)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if (self.current_epoch, batch_idx) in self.inf_batches else loss


def test_skipped_fp16_steps_do_not_advance_warmup(tmp_path):
    cb = WarmupDecayLR(warmup_epochs=2, total_epochs=4, decay="poly")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    model = InfOnSteps({(0, 1), (0, 2)}, lr=0.1)
    dm = ControllableDM(batch_size=16)
    trainer(tmp_path, [cb], max_epochs=1, plugins=[plugin]).fit(model, dm)
    # Steps 1 and 2 were skipped: steps 2 and 3 run with the LR of step 1 (one applied step).
    expected = [lr_at(p, 0.1, warmup_epochs=2, total_epochs=4) for p in (0, 0.25, 0.25, 0.25)]
    assert model.lrs == pytest.approx(expected)
    assert model.lrs[1] == model.lrs[2] == model.lrs[3] > model.lrs[0]
    assert cb._skipped_steps == 2
    assert cb.progress == pytest.approx(2 / 4)


class SkippingPrecision(pl.plugins.Precision):
    """Skips the optimizer step on chosen calls; says so in last_step_skipped if ``report``."""

    def __init__(self, skip_calls, report: bool):
        self.skip_calls = set(skip_calls)
        self.calls = 0
        if report:
            self.last_step_skipped = False

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure_result = closure()
        self._after_closure(model, optimizer)
        skip = self.calls in self.skip_calls
        self.calls += 1
        if hasattr(self, "last_step_skipped"):
            self.last_step_skipped = skip
        if not skip:
            optimizer.step()
        return closure_result


@pytest.mark.parametrize("report", [True, False], ids=["last_step_skipped", "optimizer_step_hook"])
def test_plugin_skip_holds_the_schedule(tmp_path, report):
    cb = WarmupDecayLR(warmup_epochs=1, total_epochs=2, decay="none", warmup_start_factor=0.5)
    model = TinyNet(lr=0.2)
    plugin = SkippingPrecision({0}, report)
    trainer(tmp_path, [cb], max_epochs=1, plugins=[plugin]).fit(model, ControllableDM(batch_size=16))
    assert model.lrs == pytest.approx([0.1, 0.1, 0.125, 0.15])
    assert cb._skipped_steps == 1


def test_fused_optimizer_skip_is_seen_through_the_loss_scale(tmp_path):
    """A fused optimizer gets the GradScaler and skips inside its own step(): the scale tells."""

    class Fused(InfOnSteps):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)

    cb = WarmupDecayLR(warmup_epochs=1, total_epochs=2, decay="none")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    model = Fused({(0, 1)}, lr=0.2)
    trainer(tmp_path, [cb], max_epochs=1, plugins=[plugin]).fit(model, ControllableDM(batch_size=16))
    assert cb._skipped_steps == 1
    assert model.lrs == pytest.approx([0.0, 0.05, 0.05, 0.1])


def test_lars_mixed_precision_skip_holds_the_schedule(tmp_path):
    """Interop with this package's LARS plugin, which reports skips in last_step_skipped."""
    from lightning_fastscale.precision import LARSMixedPrecision

    cb = WarmupDecayLR(warmup_epochs=1, total_epochs=2, decay="poly")
    plugin = LARSMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    model = InfOnSteps({(0, 0)}, lr=0.2)
    trainer(tmp_path, [cb], max_epochs=1, plugins=[plugin]).fit(model, ControllableDM(batch_size=16))
    assert plugin.skipped_steps == 1 and cb._skipped_steps == 1
    assert model.lrs == pytest.approx([0.0, 0.0, 0.05, 0.1])


def test_warmup_misuse_errors(tmp_path):
    t = trainer(tmp_path, [WarmupDecayLR(warmup_epochs=5)], max_epochs=3)
    with pytest.raises(ValueError, match="leaves no room for decay"):
        t.fit(TinyNet(), ControllableDM())

    class BatchSamplerDM(PlainDM):
        def train_dataloader(self):
            sampler = torch.utils.data.BatchSampler(range(16), 4, drop_last=False)
            return DataLoader(Images(16, 16), batch_sampler=sampler)

    t = trainer(tmp_path, [WarmupDecayLR(warmup_epochs=1, reference_batch=256)], max_epochs=3)
    with pytest.raises(ValueError, match="per-device batch size is unknown"):
        t.fit(TinyNet(), BatchSamplerDM())


# --------------------------------------------------------------------------- ProgressiveResizing


def test_resizing_through_the_datamodule(tmp_path):
    model = TinyNet()
    dm = ControllableDM(batch_size=16, resolution=16)
    cb = ProgressiveResizing({0: 8, 2: 12}, val_resolution=20)
    trainer(tmp_path, [cb], max_epochs=3, limit_val_batches=1).fit(model, dm)
    assert sorted({(e, s[-1]) for e, s in model.train_shapes}) == [(0, 8), (1, 8), (2, 12)]
    assert all(s[-2:] == (20, 20) for s in model.val_shapes) and model.val_shapes


def test_resizing_with_batch_scaling(tmp_path):
    model = TinyNet()
    cb = ProgressiveResizing({0: 8, 1: 16}, scale_batch=True, max_per_device_batch=32)
    trainer(tmp_path, [cb], max_epochs=2).fit(model, ControllableDM(batch_size=4, resolution=16))
    # 4 images at 16 px: at 8 px 4 x (16/8)^2 = 16 images per batch.
    assert sorted({(e, s[0], s[-1]) for e, s in model.train_shapes}) == [(0, 16, 8), (1, 4, 16)]


def test_resizing_fallback_resizes_batches_on_device(tmp_path):
    model = TinyNet()
    cb = ProgressiveResizing({0: 8, 1: 12}, val_resolution=10)
    trainer(tmp_path, [cb], max_epochs=2, limit_val_batches=1).fit(model, PlainDM())
    assert cb._resolved_mode == "batch"
    assert sorted({(e, s[-2], s[-1]) for e, s in model.train_shapes}) == [(0, 8, 8), (1, 12, 12)]
    assert model.val_shapes and all(s[-2:] == (10, 10) for s in model.val_shapes)


@pytest.mark.parametrize(
    "dm, cb, error, message",
    [
        (PlainDM(), ProgressiveResizing({0: 8}, mode="datamodule"), TypeError, "ResolutionControllable"),
        (PlainDM(tuple_batches=True), ProgressiveResizing({0: 8}), TypeError, "needs a list"),
        (PlainDM(), ProgressiveResizing({0: 8}, scale_batch=True), ValueError, "scale_batch=false"),
        (ControllableDM(), [ProgressiveResizing({0: 8}, scale_batch=True), BatchSizeRamp({0: 8})],
         ValueError, "both set the per-device batch"),
    ],
)
def test_resizing_misuse_errors(tmp_path, dm, cb, error, message):
    t = trainer(tmp_path, cb if isinstance(cb, list) else [cb], max_epochs=1)
    with pytest.raises(error, match=message):
        t.fit(TinyNet(), dm)


def test_resizing_detects_a_datamodule_that_ignores_the_setter(tmp_path):
    class IgnoresResolution(ControllableDM):
        def set_train_resolution(self, px):
            pass

    t = trainer(tmp_path, [ProgressiveResizing({0: 8})], max_epochs=1)
    with pytest.raises(RuntimeError, match="set_train_resolution\\(8\\).*16x16"):
        t.fit(TinyNet(), IgnoresResolution())
