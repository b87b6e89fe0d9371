"""Functional cores of BatchSizeRamp, WarmupDecayLR and ProgressiveResizing vs hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from lightning_fastscale.callbacks.batch_size_ramp import (
    BatchPlan,
    BatchSizeRamp,
    decompose,
    resolve_schedule,
    smith_schedule,
    value_at_epoch,
)
from lightning_fastscale.callbacks.lr_schedule import WarmupDecayLR, lr_at
from lightning_fastscale.callbacks.progressive_resizing import (
    ProgressiveResizing,
    composer_schedule,
    resize_images,
    scaled_batch_size,
)


def test_value_at_epoch_boundaries():
    schedule = {0: 8, 10: 16, 30: 64}
    assert [value_at_epoch(schedule, e) for e in (0, 9, 10, 29, 30, 100)] == [8, 8, 16, 16, 64, 64]


def test_resolve_schedule_accepts_yaml_string_keys_and_sorts():
    assert resolve_schedule({"10": 16, "0": 8}) == {0: 8, 10: 16}
    assert list(resolve_schedule({"10": 16, "0": 8})) == [0, 10]


@pytest.mark.parametrize(
    "schedule, message",
    [
        ({}, "empty"),
        ({5: 8}, "no entry for epoch 0"),
        ({0: 8, -1: 4}, "negative"),
        ({0: 8, "x": 4}, "not an epoch"),
        ({0: 0}, "positive integer"),
        ({0: 8.5}, "positive integer"),
    ],
)
def test_resolve_schedule_rejects(schedule, message):
    with pytest.raises(ValueError, match=message):
        resolve_schedule(schedule, "BatchSizeRamp.schedule")


def test_smith_schedule_grows_batch_by_inverse_decay():
    assert smith_schedule(256, [30, 60, 80], 0.1) == {0: 256, 30: 2560, 60: 25600, 80: 256000}
    assert smith_schedule(1000, [2], 0.2) == {0: 1000, 2: 5000}
    with pytest.raises(ValueError, match="lr_decay_factor"):
        smith_schedule(256, [30], 10)
    with pytest.raises(ValueError, match="lr_milestones"):
        smith_schedule(256, [30, 30], 0.1)


def test_smith_form_of_the_callback():
    ramp = BatchSizeRamp(initial_global_batch=64, lr_milestones=[3, 6], lr_decay_factor=0.5)
    assert ramp.schedule == {0: 64, 3: 128, 6: 256}
    with pytest.raises(ValueError, match="either schedule"):
        BatchSizeRamp({0: 8}, initial_global_batch=8)
    with pytest.raises(ValueError, match="all of"):
        BatchSizeRamp(initial_global_batch=8, lr_milestones=[2])
    with pytest.raises(ValueError, match="max_per_device_batch"):
        BatchSizeRamp({0: 8}, max_per_device_batch=0)


@pytest.mark.parametrize(
    "global_batch, world, ceiling, expected",
    [
        (8, 2, 8, BatchPlan(8, 4, 1)),        # fits: no accumulation
        (32, 2, 8, BatchPlan(32, 8, 2)),      # 16 per process = 8 x 2
        (48, 2, 16, BatchPlan(48, 12, 2)),    # 24 per process: 2 steps of 12, not 3 of 8
        (96, 2, 16, BatchPlan(96, 16, 3)),    # 48 per process = 16 x 3
        (65536, 256, 128, BatchPlan(65536, 128, 2)),
        (65536, 512, None, BatchPlan(65536, 128, 1)),  # no ceiling
    ],
)
def test_decompose(global_batch, world, ceiling, expected):
    plan = decompose(global_batch, world, ceiling)
    assert plan == expected
    assert plan.per_device * world * plan.accumulation == global_batch


def test_decompose_rejects_indivisible_and_wasteful_sizes():
    with pytest.raises(ValueError, match=r"not divisible by the world size 4.*e\.g\. 8 or 12"):
        decompose(10, 4, None)
    # 34 per process under a ceiling of 16 would be 2 x 17: refused, with sizes that split.
    with pytest.raises(ValueError, match=r"multiple of world_size x max_per_device_batch = 32, e\.g\. 64 or 96"):
        decompose(68, 2, 16)


def test_lr_at_goyal_warmup_and_mlperf_poly_hand_values():
    # Goyal: 0.1 per 256 -> peak 3.2 at 8K, warmup from the unscaled 0.1 (factor 1/32) in 5 epochs.
    kw = dict(warmup_epochs=5, total_epochs=10, warmup_start_factor=1 / 32, decay="poly",
              power=2.0, end_lr=1e-4)
    assert lr_at(0.0, 3.2, **kw) == pytest.approx(0.1)
    assert lr_at(2.5, 3.2, **kw) == pytest.approx(0.1 + 3.1 * 0.5)
    assert lr_at(5.0, 3.2, **kw) == pytest.approx(3.2)
    assert lr_at(7.5, 3.2, **kw) == pytest.approx(1e-4 + (3.2 - 1e-4) * 0.25)
    assert lr_at(10.0, 3.2, **kw) == pytest.approx(1e-4)
    assert lr_at(12.0, 3.2, **kw) == pytest.approx(1e-4)
    cos = dict(kw, decay="cosine")
    assert lr_at(7.5, 3.2, **cos) == pytest.approx(1e-4 + (3.2 - 1e-4) * 0.5)
    assert lr_at(5.0 + 5 / 3, 3.2, **cos) == pytest.approx(1e-4 + (3.2 - 1e-4) * 0.75)
    assert lr_at(8.0, 3.2, **dict(kw, decay="none")) == 3.2


def _torch_lrs(scheduler_factory, steps: int, peak: float) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = scheduler_factory(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("decay", ["poly", "cosine"])
def test_lr_at_equals_torch_schedulers_at_whole_steps(decay):
    """Same curve as torch's LinearLR warmup + PolynomialLR/CosineAnnealingLR, 4 steps/epoch."""
    spe, warm, total, peak, f = 4, 8, 20, 0.8, 0.25
    from torch.optim import lr_scheduler as L

    def factory(opt):
        tail = (L.PolynomialLR(opt, total_iters=total - warm, power=2.0) if decay == "poly"
                else L.CosineAnnealingLR(opt, T_max=total - warm, eta_min=0.0))
        return L.SequentialLR(
            opt, [L.LinearLR(opt, start_factor=f, end_factor=1.0, total_iters=warm), tail],
            milestones=[warm],
        )

    expected = _torch_lrs(factory, total + 1, peak)
    ours = [lr_at(t / spe, peak, warmup_epochs=warm / spe, total_epochs=total / spe,
                  warmup_start_factor=f, decay=decay, power=2.0) for t in range(total + 1)]
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(decay="step"), "decay"),
        (dict(warmup_epochs=-1), "warmup_epochs"),
        (dict(warmup_start_factor=1.5), "warmup_start_factor"),
        (dict(power=0), "power"),
        (dict(reference_batch=0), "reference_batch"),
    ],
)
def test_warmup_decay_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupDecayLR(**kwargs)


def test_composer_schedule_hand_values():
    # 10 epochs, last 2 at full size: scale(e) = 0.5 + 0.5 * min(1, e / 8);
    # size = 4 * round(scale * 224 / 4) (round half to even).
    assert composer_schedule(10, 224, 0.5, 0.2, 4) == {
        0: 112, 1: 128, 2: 140, 3: 152, 4: 168, 5: 184, 6: 196, 7: 208, 8: 224,
    }
    # 3 epochs: ceil(0.2 * 3) = 1 epoch at full size, scale 0.5, 0.75 over the 2 before it.
    assert composer_schedule(3, 32, 0.5, 0.2, 4) == {0: 16, 1: 24, 2: 32}
    # 0.3 * 10 epochs is 3 full-size epochs, not 4 (floating point gives 3.0000000000000004).
    assert min(e for e, s in composer_schedule(10, 64, 0.5, 0.3, 4).items() if s == 64) == 7
    assert composer_schedule(4, 32, 1.0, 0.0, 4) == {0: 32}
    with pytest.raises(ValueError, match="initial_scale"):
        composer_schedule(4, 32, 0.0)


def test_scaled_batch_size_keeps_pixels_per_batch():
    assert scaled_batch_size(128, 224, 128) == 392          # floor(128 * 3.0625)
    assert scaled_batch_size(128, 224, 128, max_batch=256) == 256
    assert scaled_batch_size(128, 224, 288) == math.floor(128 * (224 / 288) ** 2) == 77
    assert scaled_batch_size(128, 224, 224) == 128


def test_resize_images_shape_and_values():
    x = torch.full((2, 3, 16, 16), 0.7)
    y = resize_images(x, 8)
    assert y.shape == (2, 3, 8, 8)
    assert torch.allclose(y, torch.full_like(y, 0.7))
    assert resize_images(x, 16) is x


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of"),
        (dict(schedule={0: 8}, full_resolution=16), "exactly one of"),
        (dict(schedule={0: 8}, mode="gpu"), "mode"),
        (dict(schedule={0: 8}, mode="batch", scale_batch=True), "scale_batch"),
        (dict(schedule={0: 8}, val_resolution=0), "val_resolution"),
        (dict(schedule={3: 8}), "epoch 0"),
    ],
)
def test_progressive_resizing_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProgressiveResizing(**kwargs)
