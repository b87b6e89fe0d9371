"""Preemption and exact mid-epoch resume in one process (the 2-rank run is in test_faults_resume.py)."""
from __future__ import annotations

import os
import signal
import stat
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.fault_helpers import SignalAtStep
from lightning_fastscale.callbacks import ExactResume, PreemptionCheckpoint
from lightning_fastscale.data import ProceduralDataModule
from lightning_fastscale.exit_codes import ExitCode
from lightning_fastscale.faults.exact_resume import SkipFirstBatches
from lightning_fastscale.faults.preemption import parse_signals, slurm_job_id


class DropoutNet(pl.LightningModule):
    """Uses the global generator every step (dropout), so a resume must restore it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 4),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data() -> ProceduralDataModule:
    # 96 samples / 16 = 6 steps per epoch; the single-device loader shuffles with the global generator
    return ProceduralDataModule(num_classes=4, train_size=96, val_size=16, resolution=12, batch_size=16)


def run(tmp_path, callbacks, ckpt_path=None, max_epochs=2):
    pl.seed_everything(0)
    model = DropoutNet()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, callbacks=callbacks, default_root_dir=tmp_path,
    )
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model, trainer


def preempt_at(tmp_path, step, exact=True, send="SIGTERM", **preemption):
    stopper = PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt"), **preemption)
    callbacks = [SignalAtStep(step, signum=send), stopper] + ([ExactResume()] if exact else [])
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, callbacks)
    return stopper, exit_info.value.code


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model, _ = run(tmp_path_factory.mktemp("full"), [ExactResume()])
    return model.state_dict()


def assert_equal_states(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_sigterm_mid_epoch_then_resume_is_bitwise_the_uninterrupted_run(tmp_path, uninterrupted):
    stopper, code = preempt_at(tmp_path, step=8)  # epoch 1, its third step
    assert code == ExitCode.PREEMPTED == 75 and stopper.received == signal.SIGTERM  # retryable: not finished
    assert stopper.saved_path.name == "preempted-epoch1-step9.ckpt"  # the step in flight finished
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["preempted-epoch1-step9.ckpt"]
    saved = torch.load(stopper.saved_path, weights_only=True)
    assert saved["global_step"] == 9 and saved["epoch"] == 1
    model, trainer = run(tmp_path / "resumed", [ExactResume()], ckpt_path=str(stopper.saved_path))
    assert trainer.global_step == 12
    assert_equal_states(model.state_dict(), uninterrupted)


def test_without_exact_resume_the_resumed_run_differs(tmp_path, uninterrupted):
    """The check above can fail: Lightning alone restarts the epoch's data and generators."""
    stopper, _ = preempt_at(tmp_path, step=8, exact=False)
    model, _ = run(tmp_path / "resumed", [], ckpt_path=str(stopper.saved_path))
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), uninterrupted.values()))


@pytest.mark.parametrize("exact", [True, False])
def test_resume_from_an_epoch_end_checkpoint_is_bitwise_the_uninterrupted_run(tmp_path, uninterrupted, exact):
    """An epoch-end checkpoint (Lightning hands the loader no state there): the next epoch's
    shuffle and dropout draw from the generators as they were at the save. Without ExactResume
    they restart from the seed and the run differs (the check can fail)."""
    keep = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1)
    run(tmp_path, [keep] + ([ExactResume()] if exact else []))
    first = tmp_path / "ckpt" / "epoch=0.ckpt"
    assert torch.load(first, weights_only=True)["global_step"] == 6
    model, trainer = run(tmp_path / "resumed", [ExactResume()] if exact else [], ckpt_path=str(first))
    assert trainer.global_step == 12
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), uninterrupted.values()))
    assert same == exact


def test_signal_at_the_last_step_of_an_epoch_waits_for_the_next_step(tmp_path, uninterrupted):
    stopper, _ = preempt_at(tmp_path, step=5, send="SIGUSR1", signals=["SIGUSR1"])  # epoch 0's last step
    assert stopper.received == signal.SIGUSR1
    assert stopper.saved_path.name == "preempted-epoch1-step7.ckpt"
    model, _ = run(tmp_path / "resumed", [ExactResume()], ckpt_path=str(stopper.saved_path))
    assert_equal_states(model.state_dict(), uninterrupted)


def test_exit_code_and_no_overwrite(tmp_path):
    (tmp_path / "ckpt").mkdir()
    existing = tmp_path / "ckpt" / "preempted-epoch1-step9.ckpt"
    existing.write_bytes(b"an earlier run's file")
    stopper, code = preempt_at(tmp_path, step=8, exit_code=143)
    assert code == 143
    assert stopper.saved_path.name == "preempted-epoch1-step9-v1.ckpt"
    assert existing.read_bytes() == b"an earlier run's file"


def test_signal_handlers_are_given_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    run(tmp_path, [PreemptionCheckpoint(dirpath=str(tmp_path))], max_epochs=1)
    assert signal.getsignal(signal.SIGTERM) == before


def test_slurm_requeue_after_the_checkpoint(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/scontrol.args\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    stopper, _ = preempt_at(tmp_path, step=2, requeue=True)
    assert stopper.saved_path.is_file()
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]


def test_slurm_job_id_and_signal_names():
    assert slurm_job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert slurm_job_id({"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "2"}) == "5_2"
    assert slurm_job_id({}) is None
    assert parse_signals(["TERM", "SIGUSR1", int(signal.SIGUSR2), "SIGTERM"]) == [
        signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
    ]
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        parse_signals(["SIGKILL"])
    with pytest.raises(ValueError, match="'SIGNOPE' is not a signal"):
        PreemptionCheckpoint(signals=["SIGNOPE"])
    with pytest.raises(ValueError, match="check_every_n_steps"):
        PreemptionCheckpoint(check_every_n_steps=0)


def test_skip_first_batches_skips_once():
    sampler = SkipFirstBatches(list(range(6)), 4)
    assert len(sampler) == 6  # Lightning counts the skipped batches of a resumed epoch itself
    unused = iter(sampler)  # a pass that is never advanced does not use up the skip
    del unused
    assert list(sampler) == [4, 5]
    assert list(sampler) == list(range(6)) and len(sampler) == 6  # persistent workers re-iterate it


def test_exact_resume_with_a_plain_loader_and_persistent_workers(tmp_path):
    """A loader passed to fit() directly, with worker processes that outlive the epoch."""
    dataset = TensorDataset(torch.randn(48, 3, 8, 8), torch.randint(0, 4, (48,)))

    def loader():
        return DataLoader(dataset, batch_size=8, shuffle=True, num_workers=1, persistent_workers=True)

    def fit(callbacks, ckpt_path=None, root=tmp_path):
        pl.seed_everything(0)
        model = DropoutNet()
        pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=2, callbacks=callbacks, default_root_dir=root,
            reload_dataloaders_every_n_epochs=0,
        ).fit(model, train_dataloaders=loader(), ckpt_path=ckpt_path)
        return model

    full = fit([ExactResume()], root=tmp_path / "full")
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit([ExactResume(), saver], root=tmp_path / "saving")
    resumed = fit([ExactResume()], ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"), root=tmp_path / "b")
    assert_equal_states(resumed.state_dict(), full.state_dict())


def test_the_large_batch_recipe_resumes_bitwise_mid_epoch(tmp_path):
    """Ramp, warmup + poly LR, resizing, label smoothing, no-decay groups, zero-init BN: all resume
    mid-epoch (Lightning calls no on_train_epoch_start there, so each must restore on its own)."""
    from lightning_fastscale.callbacks import (
        BatchSizeRamp,
        LabelSmoothing,
        ProgressiveResizing,
        WarmupDecayLR,
        ZeroInitResidualBN,
    )
    from lightning_fastscale.module import ImageClassifier

    smoothing_seen = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            smoothing_seen.append((trainer.global_step, pl_module.criterion.label_smoothing))

    def fit(root, extra=(), ckpt_path=None):
        pl.seed_everything(0)
        module = ImageClassifier(
            "resnet_small", num_classes=4, model_kwargs={"widths": [8, 8, 8]},
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4),
            no_weight_decay_on_bias_norm=True,
        )
        callbacks = [
            BatchSizeRamp(initial_global_batch=16, lr_milestones=[1], lr_decay_factor=0.5),
            WarmupDecayLR(warmup_epochs=1, decay="poly", power=2.0, reference_batch=64),
            ProgressiveResizing(full_resolution=16, initial_scale=0.5, finish_fraction=0.5, size_increment=4),
            LabelSmoothing(0.1), ZeroInitResidualBN(), ExactResume(), Record(),
            PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt")), *extra,
        ]
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=callbacks, default_root_dir=root)
        trainer.fit(module, data(), ckpt_path=ckpt_path)
        return module

    full = fit(tmp_path / "full").state_dict()
    with pytest.raises(SystemExit):
        fit(tmp_path / "stopped", [SignalAtStep(7)])  # epoch 1 (batch 32): steps 6, 7, 8
    smoothing_seen.clear()
    resumed = fit(tmp_path / "resumed", ckpt_path=str(tmp_path / "ckpt" / "preempted-epoch1-step8.ckpt"))
    assert smoothing_seen == [(8, 0.1)]
    assert_equal_states(resumed.state_dict(), full)


def test_a_dataloader_subclass_keeps_its_class_and_behaviour_and_resumes_bitwise(tmp_path):
    """The user's DataLoader subclass (its own ``__iter__``) is neither swapped nor bypassed."""
    dataset = TensorDataset(torch.randn(48, 3, 8, 8), torch.randint(0, 4, (48,)))
    negated = {-float(x.sum()) for x in dataset.tensors[0]}

    class Negated(DataLoader):
        def __iter__(self):
            return ((-x, y) for x, y in super().__iter__())

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return Negated(dataset, batch_size=8, shuffle=True)

    seen = []

    class Check(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((type(trainer.train_dataloader), float(batch[0][0].sum()) in negated))

    def fit(callbacks, ckpt_path=None, root=tmp_path):
        pl.seed_everything(0)
        model = DropoutNet()
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=[*callbacks, Check()],
                   default_root_dir=root).fit(model, Data(), ckpt_path=ckpt_path)
        return model

    full = fit([ExactResume()], root=tmp_path / "full")
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    fit([ExactResume(), saver], root=tmp_path / "saving")
    seen.clear()
    resumed = fit([ExactResume()], ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=8.ckpt"), root=tmp_path / "b")
    assert_equal_states(resumed.state_dict(), full.state_dict())
    assert seen == [(Negated, True)] * 4  # steps 8..11, each batch made by the subclass's own __iter__


_TWO_RANK_SCRIPT = '''
import time, lightning.pytorch as pl
from benchmarks.fault_helpers import SignalAtStep
from lightning_fastscale.callbacks import PreemptionCheckpoint
from tests.test_faults_preemption import DropoutNet, data


class SlowExitOnRankZero(pl.Callback):
    def on_exception(self, trainer, pl_module, exception):
        if trainer.global_rank == 0:
            time.sleep({delay})


pl.seed_everything(0)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, default_root_dir={root!r},
                     callbacks=[SignalAtStep(4, rank=1), PreemptionCheckpoint(), SlowExitOnRankZero()])
trainer.fit(DropoutNet(), data())
'''


@pytest.mark.slow  # two ranks started by Lightning's launcher, ~20 s
def test_two_ranks_under_lightnings_launcher_exit_75_even_when_rank_0_exits_last(tmp_path):
    """Lightning's launcher SIGKILLs rank 0 once a rank it started exits non-zero; its observer
    polls every 5 s, so rank 0 is held 8 s in ``on_exception`` to make that race certain. The
    status must still be the preemption's 75, not -9, with the checkpoint written."""
    from benchmarks.fault_helpers import REPO, finish, popen_group

    script = tmp_path / "train.py"
    script.write_text(_TWO_RANK_SCRIPT.format(delay=8, root=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    code, out = finish(popen_group([sys.executable, str(script)], cwd=tmp_path, env=env), timeout=120)
    assert code == 75, out[-3000:]
    assert "Forcefully terminating" not in out
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["preempted-epoch1-step5.ckpt"]
