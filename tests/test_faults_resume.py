"""SIGTERM mid-epoch on ``fastscale-train``, then ``resume=auto``: the resumed run is bitwise the
uninterrupted one (CPU, gloo), or the combination is refused before it trains.

The matrix: data {procedural, streaming} x scheduler {none, cosine (the default)} x callbacks
{default, large_batch} x {1, 2} ranks. ``experiment=large_batch`` owns the learning rate
(WarmupDecayLR), so with ``scheduler=cosine`` the run is refused; every other cell resumes
bitwise: the batches of every step (samples, pixels, the next number of the global generator)
on every rank, the final weights, BN buffers and SGD momentum. The default run keeps the one
cell a new user hits first, 1 rank on the built-in data with the default scheduler and
callbacks; the whole matrix is ``make test-slow``.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.fault_helpers import finish, finish_all, read_batch_log, start
from lightning_fastscale.callbacks import ExactResume
from lightning_fastscale.data.convert import convert
from lightning_fastscale.faults.checkpoint_reading import read_checkpoint, resume_point
from lightning_fastscale.faults.exact_resume import WorldSizeChangeError

# 256 samples, global batch 32 (large_batch: data.batch_size is the global batch; default
# callbacks: the per-device batch, set to 32 / ranks): 8 steps per epoch (default callbacks:
# steps 0..15; large_batch ramps the global batch to 64 in epoch 1: steps 8..11). SIGTERM on the
# last rank as step 9 starts: every rank finishes step 9 and stops with global_step 10, mid-epoch 1.
RUN = [
    "data.batch_size=32", "data.resolution=16", "model.model_kwargs.widths=[8,8,8]", "trainer.max_epochs=2",
    "trainer.log_every_n_steps=1", "trainer.accelerator=cpu",
]
PROCEDURAL = ["data.train_size=256", "data.val_size=32"]
LARGE_BATCH = [
    "experiment=large_batch", "callbacks.batch_size_ramp.lr_milestones=[1]",
    "callbacks.progressive_resizing.size_increment=2",
]
STOP_STEP = 9
STEPS = {"default": 16, "large_batch": 12}


def preempt(ranks: int, step: int = STOP_STEP) -> list[str]:
    return [
        "+callbacks.preempt_test._target_=benchmarks.fault_helpers.SignalAtStep",
        f"+callbacks.preempt_test.step={step}", f"+callbacks.preempt_test.rank={ranks - 1}",
    ]


def batch_log(run_dir: Path) -> list[str]:
    """Each step's batch per rank, and the final state (whatever ModelCheckpoint kept as last.ckpt)."""
    return ["+callbacks.batch_log._target_=benchmarks.fault_helpers.BatchLog", f"+callbacks.batch_log.folder={run_dir / 'batches'}",
            "+callbacks.final._target_=benchmarks.fault_helpers.FinalCheckpoint", f"+callbacks.final.path={run_dir / 'final.ckpt'}"]


def load(run_dir: Path) -> dict:
    return torch.load(run_dir / "final.ckpt", map_location="cpu", weights_only=True)


def assert_same_training_state(a: dict, b: dict) -> None:
    """Weights, BN buffers, SGD momentum and the callbacks' state bitwise equal."""
    assert a["global_step"] == b["global_step"]
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    moments_a, moments_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert moments_a.keys() == moments_b.keys()
    for index in moments_a:
        assert torch.equal(moments_a[index]["momentum_buffer"], moments_b[index]["momentum_buffer"])
    assert a["lr_schedulers"] == b["lr_schedulers"]
    for key in ("WarmupDecayLR", "BatchSizeRamp"):
        assert a["callbacks"].get(key) == b["callbacks"].get(key)


def sigterm_then_resume(tmp_path: Path, run: list[str], ranks: int, steps: int, stop: int = STOP_STEP) -> None:
    """Run uninterrupted and (side by side) with a SIGTERM at ``stop``; resume; compare bitwise."""
    full_dir, preempted_dir = tmp_path / "full", tmp_path / "preempted"
    devices = [f"trainer.devices={ranks}"] + (["strategy=ddp"] if ranks > 1 else [])
    stopped, _ = finish_all(
        start(preempted_dir, *devices, *batch_log(preempted_dir), *preempt(ranks, stop), run=run),
        start(full_dir, *devices, *batch_log(full_dir), run=run),
    )
    name = f"preempted-epoch1-step{stop + 1}.ckpt"
    assert f"SIGTERM received; stopped after step {stop + 1} (epoch 1)" in stopped
    assert (preempted_dir / "checkpoints" / name).is_file()

    code, out = finish(start(preempted_dir, *devices, *batch_log(preempted_dir), "resume=auto", run=run))
    assert code == 0, out[-3000:]
    assert "continuing from" in out and name in out
    assert "not resumable" not in out

    for rank in range(ranks):
        reference = read_batch_log(full_dir / "batches", rank)
        assert sorted(reference) == list(range(1, steps + 1))
        assert read_batch_log(preempted_dir / "batches", rank) == reference, f"rank {rank}"
    a, b = load(full_dir), load(preempted_dir)
    assert a["global_step"] == steps
    assert_same_training_state(a, b)


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_auto_under_the_default_cosine_schedule(tmp_path):
    """1 rank, built-in data, the default scheduler (cosine, sized by the Trainer's step
    estimate, which builds the training loader before the checkpoint is restored) and the
    default callbacks. 64 samples, batch 16: 4 steps per epoch, SIGTERM as step 5 starts."""
    run = [a.replace("data.batch_size=32", "data.batch_size=16") for a in RUN] + [
        "data.train_size=64", "data.val_size=16",
    ]
    sigterm_then_resume(tmp_path, run, ranks=1, steps=8, stop=5)


@pytest.fixture(scope="module")
def stream_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data") / "stream"
    convert("procedural", root, max_side=16, quality=95, num_workers=1, verbose=False,
            procedural={"num_classes": 10, "train_size": 256, "val_size": 32, "resolution": 16, "seed": 0})
    return root


@pytest.mark.slow  # 16 cells, each two runs side by side and a resume: many minutes on 2 cores
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("callbacks", ["default", "large_batch"])
# scheduler is the subject here: "cosine" (the default) builds the loader before the restore
# (Lightning #20550, the pending-state path), "none" after it (Lightning's own path), and
# large_batch's WarmupDecayLR needs scheduler=none.
@pytest.mark.parametrize("scheduler", ["none", "cosine"])
@pytest.mark.parametrize("data", ["procedural", "streaming"])
def test_exact_resume_matrix(tmp_path, request, data, scheduler, callbacks, ranks):
    run = list(RUN) + [f"scheduler={scheduler}"]
    if callbacks == "large_batch":
        run += LARGE_BATCH
    else:
        run += [f"data.batch_size={32 // ranks}"]
    if data == "procedural":
        run += PROCEDURAL
    else:
        run += ["data=streaming", f"data.root={request.getfixturevalue('stream_root')}", "data.num_workers=2"]
    if callbacks == "large_batch" and scheduler == "cosine":
        # WarmupDecayLR owns the learning rate: refused before the first step, no checkpoint written
        code, out = finish(start(tmp_path / "refused", f"trainer.devices={ranks}", *(["strategy=ddp"] if ranks > 1 else []), run=run))
        assert code != 0
        assert "scheduler=none" in out and "WarmupDecayLR" in out
        assert not list((tmp_path / "refused").glob("checkpoints/*.ckpt"))
        return
    sigterm_then_resume(tmp_path, run, ranks, STEPS[callbacks])


def test_a_checkpoint_of_another_world_size_without_a_global_order_is_refused_unless_allowed(tmp_path):
    """Before any state is restored: a checkpoint whose data position is per rank (a loader with
    its own state, or one written before the world-size-independent order) cannot be carried
    to another world size (tests/test_faults_resume_elastic.py: the ones that can)."""
    checkpoint = {"callbacks": {"ExactResume": {"world_size": 2}}}
    trainer = SimpleNamespace(world_size=1, ckpt_path="run/checkpoints/last.ckpt")
    with pytest.raises(WorldSizeChangeError, match=r"written by 2 processes, this run has 1: its data position is per "
                       r"rank.*= 2, or set ExactResume\(allow_world_size_change=True\)"):
        ExactResume().on_load_checkpoint(trainer, None, checkpoint)
    with pytest.warns(UserWarning, match="written by 2 processes"):
        ExactResume(allow_world_size_change=True).on_load_checkpoint(trainer, None, checkpoint)
    ExactResume().on_load_checkpoint(SimpleNamespace(world_size=2, ckpt_path=None), None, checkpoint)  # same: no error
    # a plain loader's position records the world size too (checkpoints of loaders without state_dict)
    loader_state = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [
        {"epoch": 1, "batches_consumed": 3, "world_size": 4, "rng": []}]}}}}
    with pytest.raises(WorldSizeChangeError, match="written by 4 processes"):
        ExactResume().on_load_checkpoint(trainer, None, loader_state)
    with pytest.raises(ValueError, match="allow_world_size_change"):
        ExactResume(allow_world_size_change="yes")


@pytest.mark.slow  # two fastscale-train runs, about 15 s
def test_a_finished_run_leaves_its_final_weights_where_resume_auto_looks(tmp_path):
    """The default checkpoints, a monitored metric that stops improving after the first epoch
    (``epoch`` under ``mode=min``): the newest checkpoint is still the last step's, so a SIGKILL
    after the run and ``resume=auto`` go back to nothing older."""
    run_dir = tmp_path / "run"
    code, out = finish(start(run_dir, "monitor=epoch", "callbacks.model_checkpoint.mode=min", run=RUN + PROCEDURAL))
    assert code == 0, out[-3000:]
    newest = resume_point([run_dir / "checkpoints"])
    assert newest is not None
    assert read_checkpoint(newest)["global_step"] == STEPS["default"], newest
    best = read_checkpoint(run_dir / "checkpoints" / "epoch000.ckpt")
    assert best["global_step"] == STEPS["default"] // 2  # the top-k file keeps the best epoch
