"""SIGTERM mid-epoch on a 2-rank ``fastscale-train`` run, then ``resume=auto``: the final
weights are bitwise those of the uninterrupted run (CPU, gloo), with the whole large-batch
recipe on (batch-size ramp, warmup + poly LR, progressive resizing, label smoothing)."""
from __future__ import annotations

import torch

from benchmarks.fault_helpers import finish, finish_all, start

# save_top_k=-1: last.ckpt follows every epoch (with a monitor, Lightning refreshes it only
# when the metric improves). Epoch 0: global batch 32 (16 per rank), 8 steps; epoch 1: 64, 4 steps (steps 8..11).
# SIGTERM reaches rank 1 only, as step 9 starts: every rank finishes step 9, then stops.
PREEMPT = [
    "+callbacks.preempt_test._target_=benchmarks.fault_helpers.SignalAtStep",
    "+callbacks.preempt_test.step=9", "+callbacks.preempt_test.rank=1",
]


def test_sigterm_mid_epoch_then_resume_auto_equals_the_uninterrupted_run(tmp_path):
    full_dir, preempted_dir = tmp_path / "full", tmp_path / "preempted"
    out, _ = finish_all(start(preempted_dir, *PREEMPT), start(full_dir))  # side by side
    assert "SIGTERM received; stopped after step 10 (epoch 1)" in out
    files = sorted(p.name for p in (preempted_dir / "checkpoints").iterdir())
    assert files == ["epoch000.ckpt", "last.ckpt", "preempted-epoch1-step10.ckpt"]

    code, out = finish(start(preempted_dir, "resume=auto"))
    assert code == 0, out[-3000:]
    assert "continuing from" in out and "preempted-epoch1-step10.ckpt" in out
    assert "not resumable" not in out

    a = torch.load(full_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(preempted_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] == 12
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    moments_a, moments_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert moments_a.keys() == moments_b.keys()
    for index in moments_a:
        assert torch.equal(moments_a[index]["momentum_buffer"], moments_b[index]["momentum_buffer"])
    assert a["callbacks"]["WarmupDecayLR"] == b["callbacks"]["WarmupDecayLR"]
