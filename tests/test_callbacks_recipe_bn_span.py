"""``bn_span=N``: BN statistics over N images equal plain BN of one device holding those N images,
within a device (ghost groups), across 2 and 4 ranks (process subgroups, gloo), and in a Trainer."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from torch import nn

from lightning_fastscale.callbacks.bn_span import BNSpan, SpanBatchNormLayer, apply_bn_span, bn_span_plan
from lightning_fastscale.callbacks.ghost_batch_norm import GhostBatchNormLayer
from lightning_fastscale.data import ProceduralDataModule
from tests.callbacks_recipe_utils import TinyClassifier
from tests.distributed import ReleaseProcessGroup, run_distributed

ROOT = Path(__file__).parents[1]


def _bn() -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.0, 1.5]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return bn


def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 4, 4, generator=g) * 2 + 1, torch.randn(n, 3, 4, 4, generator=g)


def _plain(x: torch.Tensor, upstream: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain BN on one device holding ``x``: output, input and weight gradients, running stats."""
    bn, x = _bn(), x.clone().requires_grad_()
    y = bn(x)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "weight_grad": bn.weight.grad, "bias_grad": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var}


def _spanned(rank: int, world_size: int, per_device: int, span: int, ranks_per_node: int | None = None) -> dict:
    x_all, up_all = _images(world_size * per_device)
    mine = slice(rank * per_device, (rank + 1) * per_device)
    model = nn.Sequential(_bn())
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        ranks = apply_bn_span(model, span, per_device, ranks_per_node=ranks_per_node or world_size)
    x = x_all[mine].clone().requires_grad_()
    y = model(x)
    (y * up_all[mine]).sum().backward()
    bn = model[0]
    # ThroughputMonitor's FLOP count of ImageClassifier runs a meta-device deep copy of the model
    # (a convolution in front: the FLOP counter prices no BN arithmetic)
    copied = copy.deepcopy(nn.Sequential(nn.Conv2d(3, 3, 1), bn)).to("meta")
    plain = nn.Sequential(nn.Conv2d(3, 3, 1), _bn()).to("meta")
    meta_x = torch.empty(2, 3, 4, 4, device="meta")
    flops = [measure_flops(m, lambda m=m: m(meta_x), loss_fn=torch.Tensor.sum) for m in (copied, plain)]
    return {"ranks": ranks, "type": type(bn).__name__, "copy_shares_group": copied[1].group is bn.group,
            "warnings": [str(w.message) for w in warned],
            "meta_flops": flops[0], "plain_flops": flops[1], "y": y.tolist(), "x_grad": x.grad.tolist(),
            "weight_grad": bn.weight.grad.tolist(), "bias_grad": bn.bias.grad.tolist(),
            "running_mean": bn.running_mean.tolist(), "running_var": bn.running_var.tolist()}


def _assert_span_equals_one_device(results: list[dict], world_size: int, per_device: int, span: int) -> None:
    x_all, up_all = _images(world_size * per_device)
    group = span // per_device
    for first in range(0, world_size, group):
        members = results[first:first + group]
        images = slice(first * per_device, first * per_device + span)
        ref = _plain(x_all[images], up_all[images])
        assert {r["ranks"] for r in members} == {group} and {r["type"] for r in members} == {"SpanBatchNormLayer"}
        assert all(r["copy_shares_group"] and r["meta_flops"] == r["plain_flops"] > 0 for r in members)
        for key in ("y", "x_grad"):
            torch.testing.assert_close(torch.cat([torch.tensor(r[key]) for r in members]), ref[key], rtol=1e-4, atol=1e-5)
        for key in ("weight_grad", "bias_grad"):  # each rank's share; DDP sums them
            torch.testing.assert_close(sum(torch.tensor(r[key]) for r in members), ref[key], rtol=1e-4, atol=1e-5)
        for key in ("running_mean", "running_var"):
            for r in members:
                torch.testing.assert_close(torch.tensor(r[key]), ref[key], rtol=1e-5, atol=1e-6)


def test_within_one_device_a_span_is_plain_batch_norm_of_its_images() -> None:
    x, upstream = _images(8)
    for span in (4, 8):
        model = nn.Sequential(_bn())
        assert apply_bn_span(model, span, per_device_batch=8) == 1
        assert isinstance(model[0], GhostBatchNormLayer)
        xs = x.clone().requires_grad_()
        y = model(xs)
        (y * upstream).sum().backward()
        refs = [_plain(x[i:i + span], upstream[i:i + span]) for i in range(0, 8, span)]
        torch.testing.assert_close(y, torch.cat([r["y"] for r in refs]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xs.grad, torch.cat([r["x_grad"] for r in refs]), rtol=1e-4, atol=1e-5)
        if span == 8:
            torch.testing.assert_close(model[0].running_var, refs[0]["running_var"])


def test_a_span_of_two_ranks_is_plain_batch_norm_of_their_images() -> None:
    """Also across two nodes of one rank: the same arithmetic, and a warning that BN now waits on the network."""
    results = run_distributed(_spanned, 2, 2, 4, 1)
    _assert_span_equals_one_device(results, 2, 2, 4)
    assert results[0]["warnings"] == ["bn_span=4 synchronises BN over 2 ranks, more than a node's 1: every BN layer "
                                      "then waits on the network in forward and backward "
                                      "(`fastscale-plan MODEL CLUSTER --bn-span 4` prices it)"]


def _four_rank_spans(rank: int, world_size: int) -> list[dict]:
    return [_spanned(rank, world_size, 2, span) for span in (4, 8)]


@pytest.mark.slow
def test_spans_of_two_and_four_of_four_ranks_are_plain_batch_norm_of_their_images() -> None:
    results = run_distributed(_four_rank_spans, 4)
    for i, span in enumerate((4, 8)):
        _assert_span_equals_one_device([r[i] for r in results], 4, 2, span)
        assert not any(r[i]["warnings"] for r in results)  # inside one node of 4: nothing to warn about


def test_a_span_that_is_not_whole_ranks_is_refused_with_the_nearest_that_are() -> None:
    assert bn_span_plan(4, 4, world_size=4, ranks_per_node=4) == 1
    assert bn_span_plan(16, 4, world_size=8, ranks_per_node=2) == 4  # two whole nodes
    with pytest.raises(ValueError, match=r"bn_span=6 .*use bn_span=4 or 8"):
        bn_span_plan(6, 4, world_size=4, ranks_per_node=4)
    with pytest.raises(ValueError, match=r"bn_span=3 .*use bn_span=2 or 4"):
        bn_span_plan(3, 4)  # must divide the device's batch
    with pytest.raises(ValueError, match=r"bn_span=12 .*use bn_span=8 or 24"):
        bn_span_plan(12, 4, world_size=6, ranks_per_node=2)  # 3 ranks would straddle nodes
    with pytest.raises(ValueError, match="bn_span"):
        BNSpan(1)


class _RunningStats(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers = [m for m in pl_module.modules() if isinstance(m, SpanBatchNormLayer)]
        stats = [m.running_var.tolist() for m in layers]
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(stats))


def test_bn_span_callback_on_a_two_rank_trainer_shares_the_statistics(tmp_path) -> None:
    """BNSpan(2 x per-device batch) on 2 ranks: one BN group, so every rank's running statistics
    are the same (plain BN under DDP keeps its own per rank)."""
    torch.manual_seed(0)
    data = ProceduralDataModule(train_size=32, val_size=8, resolution=8, batch_size=4, num_classes=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, default_root_dir=tmp_path,
                         callbacks=[BNSpan(8), _RunningStats(str(tmp_path)), ReleaseProcessGroup()])
    trainer.fit(TinyClassifier(), datamodule=data)
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] and ranks[0] == ranks[1]


@pytest.mark.slow  # two freshly started ranks through the console entry point
def test_model_bn_span_in_fastscale_train_on_two_ranks_shares_the_statistics(tmp_path) -> None:
    """``fastscale-train model.bn_span=64`` with 32 images per device: one BN group over both ranks,
    the same running statistics on each (written by every rank from a callback added on the command line)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("fastscale-train")), "model.bn_span=64", "trainer.devices=2",
         "trainer.accelerator=cpu", "strategy=ddp", "data.train_size=128", "data.val_size=32", "data.batch_size=32",
         "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'run'}",
         "+callbacks.running_stats._target_=tests.test_callbacks_recipe_bn_span._RunningStats",
         f"+callbacks.running_stats.out={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "BNSpan: BN normalises 64 images (2 rank(s) per group)" in out and "final val/top1:" in out
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] and ranks[0] == ranks[1]
