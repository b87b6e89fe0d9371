"""Truncated or mismatched checkpoints are refused, naming the file, before any training step."""
from __future__ import annotations

import functools
import os
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from lightning_fastscale.callbacks import BatchSizeRamp, CheckpointCheck
from lightning_fastscale.config_check import ConfigError
from lightning_fastscale.data import ProceduralDataModule
from lightning_fastscale.faults import checkpoint_reading
from lightning_fastscale.faults.checkpoint_reading import CheckpointError
from lightning_fastscale.module import ImageClassifier, cosine_schedule
from lightning_fastscale.run_folder import resolve_resume


class CountSteps(pl.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps += 1


def tiny_module(widths=(8, 8, 8)) -> ImageClassifier:
    return ImageClassifier(
        "resnet_small", num_classes=4, model_kwargs={"widths": list(widths)},
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        scheduler=cosine_schedule,
    )


def tiny_data() -> ProceduralDataModule:
    return ProceduralDataModule(num_classes=4, train_size=64, val_size=16, resolution=16, batch_size=16)


class StopAfterFirstEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


def fit(tmp_path, module, callbacks=(), max_epochs=2, ckpt_path=None, checkpoint_dir=None):
    counter = CountSteps()
    cbs = [CheckpointCheck(), counter, *callbacks]
    if checkpoint_dir is not None:
        cbs.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, callbacks=cbs, limit_val_batches=0, enable_checkpointing=checkpoint_dir is not None, default_root_dir=tmp_path,
    )
    trainer.fit(module, tiny_data(), ckpt_path=ckpt_path)
    return counter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    # epoch 0 of a 2-epoch run: the cosine schedule spans 8 steps
    fit(folder, tiny_module(), [StopAfterFirstEpoch()], max_epochs=2, checkpoint_dir=folder)
    return folder / "last.ckpt"


def test_a_good_checkpoint_resumes(tmp_path, checkpoint):
    counter = fit(tmp_path, tiny_module(), max_epochs=2, ckpt_path=str(checkpoint))
    assert counter.steps == 4  # epoch 1 only: 64 samples / 16


def test_truncated_checkpoint_is_refused_before_any_step(tmp_path, checkpoint):
    truncated = tmp_path / "truncated.ckpt"
    data = checkpoint.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    counter = CountSteps()
    with pytest.raises(CheckpointError, match="truncated") as err:
        fit(tmp_path, tiny_module(), [counter], max_epochs=2, ckpt_path=str(truncated))
    assert str(truncated) in str(err.value) and f"{len(data) // 2} bytes" in str(err.value)
    assert counter.steps == 0


def test_empty_and_foreign_files_are_refused(tmp_path):
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        checkpoint_reading.read_checkpoint(empty)
    foreign = tmp_path / "weights.ckpt"
    torch.save({"weight": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint"):
        checkpoint_reading.read_checkpoint(foreign)


def test_checkpoint_of_another_model_is_refused(tmp_path, checkpoint):
    counter = CountSteps()
    with pytest.raises(CheckpointError, match="another model") as err:
        fit(tmp_path, tiny_module(widths=(8, 8, 16)), [counter], max_epochs=2, ckpt_path=str(checkpoint))
    message = str(err.value)
    assert str(checkpoint) in message and "differ in shape" in message and "(8, 8, 3, 3)" in message
    assert counter.steps == 0


def test_checkpoint_of_another_lr_schedule_is_refused(tmp_path, checkpoint):
    # cosine over 3 epochs (12 steps) while the checkpoint's decays over 2 epochs (8 steps)
    counter = CountSteps()
    with pytest.raises(CheckpointError, match="LR schedule") as err:
        fit(tmp_path, tiny_module(), [counter], max_epochs=3, ckpt_path=str(checkpoint))
    assert str(checkpoint) in str(err.value) and "T_max: checkpoint 8 vs this run 12" in str(err.value)
    assert counter.steps == 0


def test_checkpoint_of_another_batch_size_ramp_is_refused(tmp_path):
    folder = tmp_path / "ramp"
    fit(folder, tiny_module(), [BatchSizeRamp({0: 16, 1: 32}), StopAfterFirstEpoch()], checkpoint_dir=folder)
    saved = folder / "last.ckpt"
    with pytest.raises(CheckpointError, match="schedule") as err:
        fit(tmp_path, tiny_module(), [BatchSizeRamp({0: 16, 2: 32})], max_epochs=2, ckpt_path=str(saved))
    assert str(saved) in str(err.value) and "BatchSizeRamp" in str(err.value)
    with pytest.raises(CheckpointError, match="written with BatchSizeRamp, this run has none"):
        fit(tmp_path, tiny_module(), [], max_epochs=2, ckpt_path=str(saved))


def test_newest_checkpoint_is_the_latest_written(tmp_path):
    assert checkpoint_reading.newest_checkpoint([tmp_path, tmp_path / "absent"]) is None
    old, new = tmp_path / "last.ckpt", tmp_path / "preempted-epoch1-step8.ckpt"
    old.write_bytes(b"a")
    new.write_bytes(b"b")
    now = time.time()
    os.utime(old, (now - 10, now - 10))
    assert checkpoint_reading.newest_checkpoint([tmp_path]) == new
    os.utime(old, (now + 10, now + 10))
    assert checkpoint_reading.newest_checkpoint([tmp_path]) == old


def _cfg(run_dir, **extra):
    return OmegaConf.create({
        "callbacks": {"model_checkpoint": {"dirpath": str(run_dir / "checkpoints")}},
        "ckpt_path": None, **extra,
    })


def test_resume_modes(tmp_path, checkpoint):
    run_dir = tmp_path / "run"
    assert resolve_resume(_cfg(run_dir, resume="auto")) is None  # nothing yet: a fresh start
    (run_dir / "checkpoints").mkdir(parents=True)
    target = run_dir / "checkpoints" / "last.ckpt"
    target.write_bytes(checkpoint.read_bytes())
    assert resolve_resume(_cfg(run_dir, resume="auto")) == str(target)
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        resolve_resume(_cfg(run_dir))  # the default stays: a used folder is refused
    with pytest.raises(ValueError, match="both given"):
        resolve_resume(_cfg(run_dir, resume="auto", ckpt_path=str(target)))
    with pytest.raises(ValueError, match="resume='sometimes'"):
        resolve_resume(_cfg(run_dir, resume="sometimes"))
    target.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"{target}.*no complete checkpoint"):
        resolve_resume(_cfg(run_dir, resume="auto"))


def test_resume_auto_skips_an_incomplete_newest_file_and_leftover_partial_writes(tmp_path, checkpoint, caplog):
    """A file cut short (copied in, or by a writer without atomic writes) is skipped by name;
    the newest complete one is resumed; a killed atomic write's temporary file is removed."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    complete, truncated = folder / "epoch000.ckpt", folder / "last.ckpt"
    complete.write_bytes(checkpoint.read_bytes())
    truncated.write_bytes(checkpoint.read_bytes()[:1000])
    partial = folder / ".preempted-epoch1-step9.ckpt.abc123.partial"
    partial.write_bytes(b"cut short")
    now = time.time()
    os.utime(complete, (now - 10, now - 10))
    with caplog.at_level("WARNING"):
        assert resolve_resume(_cfg(tmp_path / "run", resume="auto")) == str(complete)
    assert f"skipping {truncated}" in caplog.text and "truncated" in caplog.text
    assert str(partial) in caplog.text and not partial.exists()
    assert truncated.exists()  # a person may still want it: skipped, not deleted
