"""Exact resume on ``data=streaming`` (litdata, whose loader keeps its own position).

The 2-rank case: SIGTERM mid-epoch on ``fastscale-train data=streaming`` with 2 loader workers
per rank, then ``resume=auto``. The batches after the resume, each rank's global generator
and the final weights, momentum and LR-schedule state are bitwise those of the uninterrupted
run (CPU, gloo), with the large-batch recipe rebuilding the loader between epochs (batch-size
ramp 16 -> 32 per rank, progressive resizing 8 -> 16 px). The same resume with litdata's
position taken out of the checkpoint trains on other batches and ends elsewhere, so the
comparison can fail. Four 2-rank runs, two at a time, about a minute on 2 cores (each process
spends most of it importing the stack): marked slow (``make test-slow``).

The one-process cases (run by default): a model with dropout resumes bitwise on streaming
data with ``ExactResume`` and not without it; the generators are put back only at the step
a mid-epoch checkpoint was saved at, and not across world sizes.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from benchmarks.fault_helpers import RECIPE_RUN, SignalAtStep, finish_all, read_batch_log, start
from lightning_fastscale.callbacks import ExactResume, PreemptionCheckpoint
from lightning_fastscale.data import StreamingDataModule
from lightning_fastscale.data.convert import convert
from lightning_fastscale.faults.exact_resume import collect_rng_states

# RECIPE_RUN's job on converted data: 256 train samples at 16 px (the stored max side, which
# progressive resizing reaches in epoch 1), 32 val samples.
# Epoch 0: 16 per rank at 8 px, steps 0..7; epoch 1 (loaders rebuilt): 32 per rank at 16 px,
# steps 8..11. SIGTERM reaches rank 1 as step 9 starts: every rank finishes it and stops.
PROCEDURAL = {"num_classes": 10, "train_size": 256, "val_size": 32, "resolution": 16, "seed": 0}
PREEMPT = [
    "+callbacks.preempt_test._target_=benchmarks.fault_helpers.SignalAtStep",
    "+callbacks.preempt_test.step=9", "+callbacks.preempt_test.rank=1",
]


def streaming_run(root: Path, run_dir: Path) -> list[str]:
    procedural_only = ("data.train_size=", "data.val_size=")
    return [a for a in RECIPE_RUN if not a.startswith(procedural_only)] + [
        "data=streaming", f"data.root={root}", "data.num_workers=2",
        "+callbacks.batch_log._target_=benchmarks.fault_helpers.BatchLog",
        f"+callbacks.batch_log.folder={run_dir / 'batches'}",
    ]


def launch(root: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    return start(run_dir, *extra, run=streaming_run(root, run_dir))


def load(run_dir: Path, name: str = "last.ckpt") -> dict:
    return torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=True)


def same_training_state(a: dict, b: dict) -> bool:
    """Weights, BN buffers and SGD momentum bitwise equal."""
    if a["state_dict"].keys() != b["state_dict"].keys():
        return False
    if not all(torch.equal(v, b["state_dict"][k]) for k, v in a["state_dict"].items()):
        return False
    moments_a, moments_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    return moments_a.keys() == moments_b.keys() and all(
        torch.equal(moments_a[i]["momentum_buffer"], moments_b[i]["momentum_buffer"]) for i in moments_a
    )


def drop_loader_state(run_dir: Path, name: str) -> None:
    """Remove the training loader's saved position from a checkpoint, in place."""
    path = run_dir / "checkpoints" / name
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["loops"]["fit_loop"]["state_dict"].pop("combined_loader")
    torch.save(state, path)


@pytest.mark.slow  # about a minute on 2 cores (see the module docstring)
@pytest.mark.timeout(660)  # past each phase's own 300 s, which ends the runs with their stacks printed
def test_streaming_sigterm_mid_epoch_then_resume_auto_equals_the_uninterrupted_run(tmp_path):
    root = tmp_path / "stream"
    convert("procedural", root, max_side=16, quality=95, num_workers=1, procedural=PROCEDURAL)
    full_dir, preempted_dir, dropped_dir = tmp_path / "full", tmp_path / "preempted", tmp_path / "dropped"
    out, _ = finish_all(launch(root, preempted_dir, *PREEMPT), launch(root, full_dir), timeout=300)  # side by side
    assert "SIGTERM received; stopped after step 10 (epoch 1)" in out
    files = sorted(p.name for p in (preempted_dir / "checkpoints").iterdir())
    assert files == ["epoch000.ckpt", "last.ckpt", "preempted-epoch1-step10.ckpt"]
    stopped = load(preempted_dir, "preempted-epoch1-step10.ckpt")
    assert stopped["global_step"] == 10
    assert stopped["StreamingDataModule"]["train_batch_size"] == 32
    assert stopped["StreamingDataModule"]["train_resolution"] == 16
    (loader_state,) = stopped["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    # litdata's position: 2 batches of 32 into epoch 1 on this rank, read by 2 workers
    assert loader_state["num_samples_yielded"] == 64 and loader_state["dataset"]["num_workers"] == 2

    shutil.copytree(preempted_dir, dropped_dir)
    drop_loader_state(dropped_dir, "preempted-epoch1-step10.ckpt")
    resumes = launch(root, preempted_dir, "resume=auto"), launch(root, dropped_dir, "resume=auto")
    for out in finish_all(*resumes, timeout=300):
        assert "continuing from" in out and "preempted-epoch1-step10.ckpt" in out

    # Every step ran once, on the same samples with the same pixels and the same next number of
    # the global generator on each rank: 1..10 before the stop, 11..12 after the resume, as in
    # the uninterrupted run.
    for rank in (0, 1):
        reference = read_batch_log(full_dir / "batches", rank)
        assert sorted(reference) == list(range(1, 13))
        assert read_batch_log(preempted_dir / "batches", rank) == reference, f"rank {rank}"
    a, b = load(full_dir), load(preempted_dir)
    assert a["global_step"] == b["global_step"] == 12
    assert same_training_state(a, b)
    assert a["callbacks"]["WarmupDecayLR"] == b["callbacks"]["WarmupDecayLR"]
    assert a["StreamingDataModule"] == b["StreamingDataModule"]

    # Without litdata's position Lightning restarts the resumed epoch's loader: steps 11-12
    # replay the batches of steps 9-10, and the run ends elsewhere.
    def batches(folder: Path, steps: tuple[int, ...]) -> list[str]:
        log = read_batch_log(folder / "batches", 0)
        return [log[s].rsplit(" ", 1)[0] for s in steps]  # without the generator's draw

    assert batches(dropped_dir, (11, 12)) == batches(full_dir, (9, 10)) != batches(full_dir, (11, 12))
    assert not same_training_state(a, load(dropped_dir))


class _DropoutNet(pl.LightningModule):
    """Draws dropout masks from the global generator every step, so a resume must restore it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(root: Path, folder: Path, callbacks, ckpt_path=None) -> pl.LightningModule:
    pl.seed_everything(0)
    model = _DropoutNet()
    dm = StreamingDataModule(str(root), resolution=16, batch_size=16, num_workers=1, device_prefetch=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=callbacks,
                         limit_val_batches=0, default_root_dir=str(folder))
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


@pytest.fixture(scope="module")
def small_stream(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small") / "stream"
    convert("procedural", root, max_side=16, quality=95, num_workers=1,
            procedural={**PROCEDURAL, "train_size": 96, "val_size": 16})
    return root


@pytest.mark.parametrize("exact", [True, False], ids=["exact_resume", "loader_state_only"])
def test_streaming_resume_restores_the_generators_the_model_draws_from(small_stream, tmp_path, exact):
    """litdata's loader keeps its own position; ExactResume still puts the global generators
    back where the run stopped, so dropout after the resume draws the uninterrupted masks.
    Without it only the data is the same, and the run ends elsewhere."""
    full = _fit(small_stream, tmp_path / "full", [ExactResume()] if exact else [])
    stopper = PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt"))
    callbacks = [SignalAtStep(8), stopper] + ([ExactResume()] if exact else [])
    with pytest.raises(SystemExit):
        _fit(small_stream, tmp_path / "stopped", callbacks)
    assert stopper.saved_path.name == "preempted-epoch1-step9.ckpt"  # 6 steps per epoch
    resumed = _fit(small_stream, tmp_path / "resumed", [ExactResume()] if exact else [],
                   ckpt_path=str(stopper.saved_path))
    equal = all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), resumed.state_dict().values()))
    assert equal == exact


def test_generators_are_restored_only_at_the_saved_mid_epoch_step():
    torch.manual_seed(1)
    saved = collect_rng_states()
    expected = torch.rand(3)

    def first_batch(state: dict, global_step: int = 9, world_size: int = 1) -> torch.Tensor:
        callback = ExactResume()
        callback.load_state_dict({"global_step": 9, "mid_epoch": True, "world_size": 1, "rng": [saved], **state})
        torch.manual_seed(2)
        callback.on_train_batch_start(SimpleNamespace(global_step=global_step, world_size=world_size), None, None, 0)
        return torch.rand(3)

    assert torch.equal(first_batch({}), expected)
    assert not torch.equal(first_batch({"mid_epoch": False}), expected)  # an epoch boundary: left as is
    assert not torch.equal(first_batch({}, global_step=10), expected)  # not the step it was saved at
    with pytest.warns(UserWarning, match="written by 1 processes, this run has 2"):
        assert not torch.equal(first_batch({}, world_size=2), expected)


class _BatchRecorder(pl.LightningModule):
    """Records each step's input pixels (a digest) by global step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
        self.seen: dict[int, str] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen[self.global_step] = hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_recorded(root: Path, folder: Path, callbacks, workers: int, ckpt_path=None, limit=None) -> _BatchRecorder:
    pl.seed_everything(0)
    model = _BatchRecorder()
    dm = StreamingDataModule(str(root), resolution=16, batch_size=16, num_workers=workers, device_prefetch=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=callbacks,
                         limit_train_batches=limit, default_root_dir=str(folder))
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("workers", [1, 0])
def test_streaming_resume_from_an_epoch_end_checkpoint_draws_the_next_epochs_order(small_stream, tmp_path, workers):
    """Epoch 1 after a resume from epoch 0's checkpoint reads epoch 1's samples, not epoch 0's again."""
    full = _fit_recorded(small_stream, tmp_path / "full", [ExactResume(), ModelCheckpoint(save_top_k=-1)], workers)
    assert sorted(full.seen) == list(range(12))  # 96 samples, 6 batches of 16 per epoch
    (first_epoch,) = (tmp_path / "full").rglob("epoch=0-step=6.ckpt")
    resumed = _fit_recorded(small_stream, tmp_path / "resumed", [ExactResume()], workers, ckpt_path=str(first_epoch))
    assert resumed.seen == {step: full.seen[step] for step in range(6, 12)}
    for name, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


@pytest.mark.parametrize("workers", [1, 0])
def test_streaming_mid_epoch_resume_under_limit_train_batches_trains_the_same_steps(small_stream, tmp_path, workers):
    """limit_train_batches=4 of 6: stopped after step 3 of epoch 0 and resumed, the run trains
    the same 8 steps on the same samples as the uninterrupted one."""
    full = _fit_recorded(small_stream, tmp_path / "full", [ExactResume()], workers, limit=4)
    assert sorted(full.seen) == list(range(8))
    stopper = PreemptionCheckpoint(dirpath=str(tmp_path / "ckpt"))
    with pytest.raises(SystemExit):
        _fit_recorded(small_stream, tmp_path / "stopped", [SignalAtStep(2), stopper, ExactResume()],
                      workers, limit=4)
    assert stopper.saved_path.name == "preempted-epoch0-step3.ckpt"
    resumed = _fit_recorded(small_stream, tmp_path / "resumed", [ExactResume()], workers,
                            ckpt_path=str(stopper.saved_path), limit=4)
    assert resumed.seen == {step: full.seen[step] for step in range(3, 8)}
    for name, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
