"""AlexNet-BN: layout of Jia et al. 2018, forward at 32 and 224 px, registry, bad input."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fastscale.models import create_model
from lightning_fastscale.models.alexnet_bn import AlexNetBN


@pytest.fixture(scope="module")
def model() -> AlexNetBN:
    return create_model("alexnet_bn", num_classes=10)


def test_registered_and_parameter_count_matches_hand_count(model) -> None:
    assert isinstance(model, AlexNetBN)
    convs = 3 * 96 * 11 * 11 + 96 * 256 * 5 * 5 + 256 * 384 * 9 + 384 * 384 * 9 + 384 * 256 * 9
    bns = 2 * (96 + 256 + 384 + 384 + 256 + 256)  # five conv BNs + the BN after pool5
    fcs = (256 * 6 * 6 + 1) * 4096 + (4096 + 1) * 4096 + (4096 + 1) * 10
    assert sum(p.numel() for p in model.parameters()) == convs + bns + fcs


def test_bn_follows_every_conv_and_pool5(model) -> None:
    """Trace the layer order of a forward pass: each conv is followed by BN, and pool5 by BN."""
    order: list[nn.Module] = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: order.append(mod))
        for m in model.modules()
        if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.AdaptiveMaxPool2d, nn.MaxPool2d, nn.Linear))
    ]
    with torch.no_grad():
        model.eval()(torch.randn(1, 3, 64, 64))
    for hook in hooks:
        hook.remove()
    kinds = [type(m).__name__ for m in order]
    assert kinds == [
        "Conv2d", "BatchNorm2d", "MaxPool2d",
        "Conv2d", "BatchNorm2d", "MaxPool2d",
        "Conv2d", "BatchNorm2d", "Conv2d", "BatchNorm2d", "Conv2d", "BatchNorm2d",
        "AdaptiveMaxPool2d", "BatchNorm2d",
        "Linear", "Linear", "Linear",
    ]


@pytest.mark.parametrize("resolution", [32, 64])
def test_forward_and_backward_at_small_resolution(model, resolution) -> None:
    model.train()
    out = model(torch.randn(2, 3, resolution, resolution))
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.sum().backward()
    grad = model.features[0].weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    model.zero_grad()


def test_forward_at_imagenet_resolution(model) -> None:
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 10) and torch.isfinite(out).all()


def test_adaptive_pool5_equals_the_original_pool_at_224_px(model) -> None:
    """At 224 px conv5 gives 13x13, where a 6x6 adaptive max-pool is AlexNet's 3x3/2 max-pool."""
    fmap = torch.randn(2, 256, 13, 13)
    assert torch.equal(nn.AdaptiveMaxPool2d(6)(fmap), nn.MaxPool2d(3, 2)(fmap))
    assert isinstance(model.pool5, nn.AdaptiveMaxPool2d) and model.pool5.output_size == 6
    model.eval()
    with torch.no_grad():
        assert model.features(torch.randn(1, 3, 224, 224)).shape[-2:] == (13, 13)


def test_bad_input_and_arguments_get_clear_errors(model) -> None:
    with pytest.raises(ValueError, match="at least 31 px, got \\(30, 30\\)"):
        model(torch.randn(1, 3, 30, 30))
    with pytest.raises(ValueError, match=r"^dropout=1.0 must be in \[0, 1\)"):
        AlexNetBN(dropout=1.0)


@pytest.mark.slow
def test_default_callbacks_run_alexnet_bn_at_its_smallest_maps(tmp_path) -> None:
    """At 32 px conv3-5 see 1x1 maps; the throughput monitor's FLOP count runs the network in
    training mode, where BatchNorm needs more than one value per channel: it must count on
    more than one sample. The callbacks are the default job's, built from its config."""
    from pathlib import Path

    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import CSVLogger

    from lightning_fastscale import ImageClassifier
    from lightning_fastscale.data import ProceduralDataModule

    conf = str(Path(__file__).resolve().parents[1] / "lightning_fastscale" / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose("train", overrides=["model=alexnet_bn"])
    cfg.callbacks.model_checkpoint.dirpath = str(tmp_path / "checkpoints")  # hydra's run folder otherwise
    cfg.callbacks.step_breakdown.dirpath = str(tmp_path)
    cfg.callbacks.time_to_accuracy.dirpath = str(tmp_path)
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c]
    assert any(type(c).__name__ == "ThroughputMonitor" for c in callbacks)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
        log_every_n_steps=1, logger=CSVLogger(tmp_path), callbacks=callbacks, default_root_dir=tmp_path,
    )
    data = ProceduralDataModule(train_size=8, val_size=4, resolution=32, batch_size=4)
    trainer.fit(ImageClassifier("alexnet_bn", num_classes=10), datamodule=data)
    assert trainer.global_step == 2


@pytest.mark.slow  # test_default_callbacks_run_alexnet_bn_at_its_smallest_maps is its fast sibling
def test_fastscale_train_runs_alexnet_bn_with_the_default_callbacks_at_its_smallest_maps(tmp_path) -> None:
    """At 32 px conv3-5 see 1x1 maps; the throughput monitor's FLOP count runs the network in
    training mode, where BatchNorm needs more than one value per channel: it must count on
    more than one sample. Everything else is the default job (callbacks, summary, scheduler)."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fastscale.train", "model=alexnet_bn", "data.resolution=32",
         "logger=csv", "data.batch_size=4", "+trainer.limit_train_batches=2", "trainer.max_epochs=1",
         "+trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", f"hydra.run.dir={run_dir}"],
        check=False, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # the monitor reads flops_per_batch after every batch
    assert "final val/top1:" in out


def test_flops_per_batch_of_alexnet_bn_at_31_px_is_linear_in_the_batch() -> None:
    from lightning_fastscale import ImageClassifier

    module = ImageClassifier("alexnet_bn", num_classes=10)
    counts = {}
    for batch in (1, 6):
        module._last_batch_shape = (batch, 3, 31, 31)
        counts[batch] = module.flops_per_batch
    assert counts[1] > 0 and counts[6] == 6 * counts[1]
    module.eval()
    assert 0 < module.flops_per_batch < counts[6]  # forward only
