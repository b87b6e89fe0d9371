"""HierarchicalAllReduceStrategy inside real Trainer runs equals plain DDP (4 ranks as 2x2, gloo).

All Trainer runs share one set of 4 spawned processes (``run_distributed``): the Trainer finds
the process group already initialised and ``LOCAL_RANK`` set, so it launches nothing itself.
"""
from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastscale.strategies import HierarchicalAllReduceStrategy
from tests.comm_recording import CommRecorder
from tests.distributed import relative_error as _rel
from tests.distributed import run_distributed
from tests.distributed import same_on_all_ranks as _same_on_all_ranks

# Relative error of the final weights against DDP after STEPS SGD steps. fp32: only summation
# order differs. fp16/bf16 wire: per-step gradient rounding of 2^-11 / 2^-8, accumulated.
TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}
STEPS = 4
WIRES = [("hier", "fp32"), ("torus2d", "fp32"), ("flat", "fp32"), ("hier", "fp16"), ("torus2d", "bf16")]
# Every Trainer run shares one spawn; on a 2-core machine shared with other jobs it can be slow.
pytestmark = pytest.mark.timeout(900)


class _Net(pl.LightningModule):
    def __init__(self, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(strategy, steps: int = STEPS, ckpt_path: str | None = None, momentum: float = 0.9,
         **trainer_kw) -> tuple[pl.Trainer, _Net]:
    model = _Net(momentum=momentum)
    # Lightning's default logger and checkpointing, in the working directory (the test's folder,
    # see _worker): each fit writes its own lightning_logs/version_N
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=steps, **trainer_kw)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return trainer, model


def _full_loss(model: _Net) -> float:
    model.eval()
    x, y = _data().dataset.tensors
    with torch.no_grad():
        return nn.functional.cross_entropy(model.net(x), y).item()


def _flat(model: nn.Module, buffers: bool = True) -> torch.Tensor:
    tensors = [p.detach().flatten() for p in model.parameters()]
    if buffers:  # BN running statistics: each rank's own, from its last forward
        tensors += [b.flatten() for b in model.buffers() if b.dtype.is_floating_point]
    return torch.cat(tensors)


class _CountCollectives:
    """Count torch.distributed calls by (name, group size, default group?), independently of our counters."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int, bool], int] = {}
        self._saved = {}

    def __enter__(self):
        for name in ("reduce", "broadcast", "all_reduce"):
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                group = kwargs.get("group")
                key = (_name, dist.get_world_size(group), group in (None, dist.group.WORLD))
                self.counts[key] = self.counts.get(key, 0) + 1
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _worker(rank: int, world_size: int, tmp: str) -> dict | None:
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    os.chdir(tmp)  # the Trainer's default folder, as for a user who runs a script there
    out: dict = {}

    def hier(**kw) -> HierarchicalAllReduceStrategy:
        return HierarchicalAllReduceStrategy(ranks_per_node=2, **kw)

    _, ddp = _fit(DDPStrategy())
    reference = _flat(ddp)
    for algorithm, wire in WIRES:
        # The fp32 hier run also fuses into two segments: bucketing must not change the sum.
        fusion = {"two_segment_split": 2} if (algorithm, wire) == ("hier", "fp32") else {}
        with _CountCollectives() as counter, CommRecorder() as recorder:
            trainer, model = _fit(hier(algorithm=algorithm, wire_dtype=wire, **fusion))
        state = trainer.strategy.hook_state
        out[(algorithm, wire)] = {
            "rel": _rel(_flat(model), reference),
            "agree": _same_on_all_ranks(_flat(model, buffers=False)),
            "hook_calls": recorder.hook_calls,
            "iterations": state.iteration,
            "stages": dict(recorder.stages),
            "patched": counter.counts,
        }
        if fusion:
            params = list(model.parameters())
            out["two_segment"] = {
                "buckets": dict(recorder.buckets),
                "tail": sum(p.numel() for p in params[2:]), "head": sum(p.numel() for p in params[:2]),
            }

    # One node (ranks_per_node from the launcher = 4): fp32 keeps DDP's own all-reduce, no hook;
    # a wire dtype still needs the hook.
    trainer, model = _fit(HierarchicalAllReduceStrategy())
    one_fp16, _ = _fit(HierarchicalAllReduceStrategy(wire_dtype="fp16"))
    out["one_node"] = {
        "rel": _rel(_flat(model), reference), "hook_state": trainer.strategy.hook_state,
        "native": trainer.strategy.uses_ddp_allreduce, "fp16_native": one_fp16.strategy.uses_ddp_allreduce,
        "fp16_iterations": one_fp16.strategy.hook_state.iteration,
        "fp16_hook": (one_fp16.strategy.comm_hook, one_fp16.strategy.comm_hook_calls),
        "summary": trainer.strategy.plan_summary()["strategy/algorithm"],
        "resolved": trainer.strategy.resolved_algorithm, "comm_hook": trainer.strategy.comm_hook,
        "hook_calls": trainer.strategy.comm_hook_calls,
    }

    # Gradient accumulation (no_sync micro-batches) with a precision plugin, against DDP doing the
    # same. (SyncBatchNorm cannot be checked here: torch's DDP refuses it for CPU modules.)
    features = {"accumulate_grad_batches": 2, "precision": "bf16-mixed"}
    _, base = _fit(DDPStrategy(), **features)
    trainer, model = _fit(hier(algorithm="torus2d"), **features)
    out["accumulate_bf16_mixed"] = {"rel": _rel(_flat(model), _flat(base)),
                                    "iterations": trainer.strategy.hook_state.iteration}

    # Checkpoint at an epoch boundary (a mid-epoch resume replays the epoch's first batches in
    # Lightning, whatever the strategy): 1 epoch, save, resume to 2 == 2 epochs uninterrupted.
    ckpt = str(Path(tmp) / "epoch1.ckpt")
    epochs = {"steps": -1, "limit_train_batches": 2}
    trainer, _ = _fit(hier(), max_epochs=1, **epochs)
    trainer.save_checkpoint(ckpt)
    _, resumed = _fit(hier(), max_epochs=2, ckpt_path=ckpt, **epochs)
    _, straight = _fit(hier(), max_epochs=2, **epochs)
    out["resume"] = {"rel": _rel(_flat(resumed), _flat(straight))}

    # Top-k: each rank's error-feedback residuals travel with the checkpoint. 4 steps, so the
    # residuals are in use (compression starts at step 2); then resume to 8 == 8 straight.
    topk_epochs = {"steps": -1, "limit_train_batches": 4}
    ckpt = str(Path(tmp) / "topk.ckpt")
    topk = {"compression": "topk", "topk_ratio": 0.05}
    trainer, _ = _fit(hier(**topk), max_epochs=1, **topk_epochs)
    trainer.save_checkpoint(ckpt)
    saved = torch.load(f"{ckpt}.topk-residuals-rank{rank}", weights_only=True)
    _, resumed = _fit(hier(**topk), max_epochs=2, ckpt_path=ckpt, **topk_epochs)
    _, straight = _fit(hier(**topk), max_epochs=2, **topk_epochs)
    # Without the residuals (file gone) the resumed run restarts them from zero, with a warning.
    os.rename(f"{ckpt}.topk-residuals-rank{rank}", f"{ckpt}.moved")
    import warnings

    with warnings.catch_warnings(record=True) as missing:
        warnings.simplefilter("always")
        _, without = _fit(hier(**topk), max_epochs=2, ckpt_path=ckpt, **topk_epochs)
    # Residuals of another layout are not used either, and the warning says what differs.
    saved["layout"]["world_size"] = 8
    torch.save(saved, f"{ckpt}.topk-residuals-rank{rank}")
    with warnings.catch_warnings(record=True) as other:
        warnings.simplefilter("always")
        _fit(hier(**topk), max_epochs=2, ckpt_path=ckpt, **topk_epochs)
    # The torus keeps one residual per rank (its own shard): the same holds.
    torus_ckpt = str(Path(tmp) / "topk_torus.ckpt")
    trainer, _ = _fit(hier(algorithm="torus2d", **topk), max_epochs=1, **topk_epochs)
    trainer.save_checkpoint(torus_ckpt)
    _, torus_resumed = _fit(hier(algorithm="torus2d", **topk), max_epochs=2, ckpt_path=torus_ckpt, **topk_epochs)
    _, torus_straight = _fit(hier(algorithm="torus2d", **topk), max_epochs=2, **topk_epochs)
    out["topk_resume"] = {
        "rel_torus": _rel(_flat(torus_resumed), _flat(torus_straight)),
        "rel": _rel(_flat(resumed), _flat(straight)), "rel_without": _rel(_flat(without), _flat(straight)),
        "residual_keys": sorted(map(str, saved["errors"])), "iteration": saved["iteration"],
        "missing_warning": [str(w.message) for w in missing if "top-k residuals" in str(w.message)],
        "other_warning": [str(w.message) for w in other if "top-k residuals" in str(w.message)],
    }

    # Momentum correction: the velocities travel with the residuals; the optimizer runs without momentum.
    corrected = {**topk, "topk_momentum": 0.9}
    ckpt = str(Path(tmp) / "topk_momentum.ckpt")
    trainer, _ = _fit(hier(**corrected), max_epochs=1, momentum=0.0, **topk_epochs)
    trainer.save_checkpoint(ckpt)
    saved = torch.load(f"{ckpt}.topk-residuals-rank{rank}", weights_only=True)
    _, resumed = _fit(hier(**corrected), max_epochs=2, ckpt_path=ckpt, momentum=0.0, **topk_epochs)
    _, straight = _fit(hier(**corrected), max_epochs=2, momentum=0.0, **topk_epochs)
    # Sending everything, momentum correction clears every velocity each step: plain SGD without momentum.
    _, sgd = _fit(DDPStrategy(), steps=8, momentum=0.0)
    _, dense = _fit(hier(compression="topk", topk_ratio=1.0, topk_momentum=0.9), steps=8, momentum=0.0)
    out["topk_momentum"] = {"rel": _rel(_flat(resumed), _flat(straight)), "layout": saved["layout"],
                            "velocity_keys": sorted(map(str, saved["velocities"])),
                            "rel_dense_vs_sgd": _rel(_flat(dense), _flat(sgd))}

    # Top-k (5% of each inter-node shard) with error feedback trains like DDP on a longer run,
    # also with momentum correction (the optimizer's momentum moved into the top-k stage).
    losses = {}
    for name, strategy, momentum in (("ddp", DDPStrategy(), 0.9), ("topk", hier(**topk), 0.9),
                                     ("topk_momentum", hier(**corrected), 0.0)):
        with CommRecorder() as recorder:
            trainer, model = _fit(strategy, steps=40, momentum=momentum)
        losses[name] = _full_loss(model)
        if name != "ddp":
            out[f"{name}_stages"] = dict(recorder.stages)
    losses["initial"] = _full_loss(_Net())
    out["losses"] = losses

    # Last: a refused fit tells the peer watchdogs of later fits in these processes that a rank failed.
    refused = out["topk_momentum"]["refused"] = {}
    for name, strategy, momentum in (("optimizer", hier(**corrected), 0.9),
                                     ("one_node", HierarchicalAllReduceStrategy(**corrected), 0.0)):
        try:
            _fit(strategy, momentum=momentum)
        except ValueError as error:
            refused[name] = str(error)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = run_distributed(_worker, 4, str(tmp_path_factory.mktemp("ckpt")), timeout=850)[0]
    print(out)  # the measured errors, visible with -s
    return out


@pytest.mark.parametrize("algorithm,wire", WIRES)
def test_same_weights_as_ddp(results: dict, algorithm: str, wire: str) -> None:
    r = results[(algorithm, wire)]
    assert r["agree"], "ranks ended with different weights"
    assert r["rel"] <= TOLERANCE[wire], r["rel"]
    # The hook ran on every step (one or more buckets per step), not DDP's built-in all-reduce.
    assert r["iterations"] == STEPS and r["hook_calls"] >= STEPS


def test_one_node_keeps_ddp_allreduce(results: dict) -> None:
    r = results["one_node"]
    assert r["native"] and r["hook_state"] is None and r["summary"] == r["resolved"] == "flat"
    assert r["comm_hook"] is None and r["hook_calls"] == 0
    assert r["rel"] <= TOLERANCE["fp32"], r["rel"]
    assert not r["fp16_native"] and r["fp16_iterations"] == STEPS
    assert r["fp16_hook"][0] is not None and r["fp16_hook"][1] == STEPS  # a wire dtype needs the hook


@pytest.mark.parametrize("algorithm", ["hier", "torus2d", "flat"])
def test_hook_issues_subgroup_collectives(results: dict, algorithm: str) -> None:
    patched = results[(algorithm, "fp32")]["patched"]
    if algorithm == "hier":  # rank 0 leads node 0: reduce + broadcast in the node, all-reduce with node 1
        assert patched[("reduce", 2, False)] >= STEPS and patched[("broadcast", 2, False)] >= STEPS
        assert patched[("all_reduce", 2, False)] >= STEPS
    elif algorithm == "torus2d":  # one reduce and one broadcast per shard (2 per node)
        assert patched[("reduce", 2, False)] >= 2 * STEPS and patched[("broadcast", 2, False)] >= 2 * STEPS
    else:  # a private all-ranks group, not the default group Lightning's own syncs use
        assert patched[("all_reduce", 4, False)] >= STEPS and ("reduce", 2, False) not in patched


def test_accumulation_and_precision_plugin_match_ddp(results: dict) -> None:
    r = results["accumulate_bf16_mixed"]
    assert r["rel"] <= 1e-5, r
    assert r["iterations"] == STEPS  # one all-reduce per optimizer step, none per micro-batch


def test_resume_equals_uninterrupted(results: dict) -> None:
    assert results["resume"]["rel"] <= 1e-6


def test_topk_resume_equals_uninterrupted(results: dict) -> None:
    r = results["topk_resume"]
    assert r["iteration"] == 4 and r["residual_keys"], r  # rank 0 leads node 0: it keeps residuals
    assert r["rel"] <= 1e-6 and r["rel_torus"] <= 1e-6, r
    assert r["rel_without"] > 1e-4, r  # the residuals matter: dropping them changes the weights
    assert len(r["missing_warning"]) == 1 and "restarts from zero" in r["missing_warning"][0], r
    assert any("world_size 8 in the checkpoint vs 4 now" in w for w in r["other_warning"]), r


def test_two_segment_fusion(results: dict) -> None:
    r = results["two_segment"]
    assert sorted(r["buckets"].values()) == sorted([r["tail"], r["head"]])


def test_topk_trains_like_ddp(results: dict) -> None:
    losses = results["losses"]
    assert results["topk_stages"].get("inter-node top-k all-gather", 0) > 0, "compression never engaged"
    # Both must learn (loss well below the start), top-k to within 20% of DDP's final loss.
    assert losses["ddp"] < 0.5 * losses["initial"], losses
    assert losses["topk"] < 1.2 * losses["ddp"] + 0.02, losses


def test_topk_momentum_learns_and_sending_everything_is_sgd(results: dict) -> None:
    losses = results["losses"]
    assert results["topk_momentum_stages"].get("inter-node top-k all-gather", 0) > 0, "compression never engaged"
    # It learns; not held to DDP's loss in 40 steps: each sent entry's velocity restarts from zero
    # (momentum factor masking), so its momentum builds up again between sends.
    assert losses["topk_momentum"] < 0.5 * losses["initial"], losses
    assert results["topk_momentum"]["rel_dense_vs_sgd"] <= 1e-5, results["topk_momentum"]


def test_topk_momentum_resumes_exactly_and_refuses_a_second_momentum(results: dict) -> None:
    r = results["topk_momentum"]
    assert r["layout"]["topk_momentum"] == 0.9 and r["velocity_keys"], r  # rank 0 leads node 0
    assert r["rel"] <= 1e-6, r
    assert "SGD has momentum=0.9 in param group 0: set the optimizer's momentum to 0" in r["refused"]["optimizer"]
    assert "which this run does not have (one node)" in r["refused"]["one_node"], r
