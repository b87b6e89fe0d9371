"""A checkpoint written before the fault-tolerance callbacks moved to ``lightning_fastscale.faults``
still resumes, callback state included, to the same weights as the uninterrupted run.

The fixture in ``tests/data/main_checkpoint/`` was written by the package as it was before the
move (commit 8b5de2d): ``fastscale-train`` with the large-batch recipe and the default fault
callbacks, SIGTERM at step 9 (``PreemptionCheckpoint`` wrote ``preempted-epoch1-step10.ckpt``,
mid-epoch 1); ``uninterrupted_final.pt`` holds the weights, step and schedule callbacks' state
of the same run left to finish (12 steps). Both files are small (ResNet widths 4).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.fault_helpers import finish_all, start
from lightning_fastscale.callbacks import (
    BatchSizeRamp,
    CheckpointCheck,
    ExactResume,
    NonFiniteGuard,
    PreemptionCheckpoint,
    WarmupDecayLR,
)

FIXTURE = Path(__file__).parent / "data" / "main_checkpoint"
RUN = [
    "experiment=large_batch", "model.model_kwargs.widths=[4,4,4]", "data.train_size=128", "data.val_size=16",
    "data.batch_size=16", "data.resolution=16", "trainer.max_epochs=2", "trainer.accelerator=cpu", "logger=csv",
    "trainer.enable_progress_bar=false", "callbacks.progressive_resizing.size_increment=2",
    "callbacks.batch_size_ramp.lr_milestones=[1]",
]


def test_fixture_holds_the_state_keys_of_the_moved_callbacks() -> None:
    saved = torch.load(FIXTURE / "preempted-epoch1-step10.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 10
    callbacks = [ExactResume(), NonFiniteGuard(), BatchSizeRamp(schedule={0: 16}),
                 WarmupDecayLR(warmup_epochs=1)]
    assert {cb.state_key for cb in callbacks} <= saved["callbacks"].keys()
    # the callbacks without state leave no key, before the move as after it
    assert CheckpointCheck().state_key not in saved["callbacks"]
    assert PreemptionCheckpoint().state_key not in saved["callbacks"]


@pytest.mark.slow  # three Trainer runs, about 10 s
def test_checkpoint_of_the_old_layout_resumes_to_the_uninterrupted_run(tmp_path: Path) -> None:
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    out, = finish_all(start(
        resumed, f"ckpt_path={FIXTURE / 'preempted-epoch1-step10.ckpt'}",
        "+callbacks.final._target_=benchmarks.fault_helpers.FinalCheckpoint",
        f"+callbacks.final.path={tmp_path / 'final.ckpt'}", run=RUN,
    ))
    assert "Restoring states from the checkpoint" in out, out[-3000:]
    got = torch.load(tmp_path / "final.ckpt", map_location="cpu", weights_only=True)
    expected = torch.load(FIXTURE / "uninterrupted_final.pt", map_location="cpu", weights_only=True)
    assert got["global_step"] == expected["global_step"] == 12
    assert got["state_dict"].keys() == expected["state_dict"].keys()
    # Same machine and thread count resume bitwise (tests/test_faults_resume.py); the fixture's
    # first 10 steps ran elsewhere, where float sums may round differently (1e-8 here). Two
    # missed or repeated steps move the weights by far more than the tolerance:
    start_weights = torch.load(FIXTURE / "preempted-epoch1-step10.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert max((start_weights[k] - v).abs().max().item() for k, v in expected["state_dict"].items()
               if v.is_floating_point()) > 1e-3
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for key, value in expected["callbacks"].items():
        assert got["callbacks"][key] == value, key
