"""Progressive resizing: small images early, full size late (Howard et al. 2018, fast.ai; Composer).

Method card: ``docs/methods/progressive_resizing.md``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.callbacks._schedule import PreparedEpoch, resolve_schedule, value_at_epoch
from lightning_fastscale.callbacks.batch_size_ramp import BatchSizeRamp
from lightning_fastscale.data.protocol import BatchSizeControllable, ResolutionControllable, require_protocol

MODES = ("auto", "datamodule", "batch")


def composer_schedule(
    max_epochs: int, full_resolution: int, initial_scale: float = 0.5,
    finish_fraction: float = 0.2, size_increment: int = 4,
) -> dict[int, int]:
    """Composer's schedule by epoch: linear from ``initial_scale`` to full size, kept for the last ``finish_fraction``.

    Sizes are multiples of ``size_increment``; the full-size phase is rounded up to whole epochs.
    """
    if not 0 < initial_scale <= 1:
        raise ValueError(f"initial_scale={initial_scale} must be in (0, 1]")
    if not 0 <= finish_fraction < 1:
        raise ValueError(f"finish_fraction={finish_fraction} must be in [0, 1)")
    positive_int("size_increment", size_increment)
    # The tolerance keeps 0.3 * 10 (= 3.0000000000000004 in floating point) at 3 epochs.
    ramp_epochs = max_epochs - math.ceil(finish_fraction * max_epochs - 1e-9)
    schedule: dict[int, int] = {}
    for epoch in range(max_epochs):
        scale = initial_scale + (1 - initial_scale) * min(1.0, epoch / max(ramp_epochs, 1))
        size = max(size_increment, size_increment * round(scale * full_resolution / size_increment))
        if not schedule or schedule[max(schedule)] != size:
            schedule[epoch] = size
    return schedule


def scaled_batch_size(
    base_batch: int, base_resolution: int, resolution: int, max_batch: int | None = None
) -> int:
    """fast.ai's rule: keep pixels per batch constant, ``base * (base_res / res)**2``, capped."""
    size = max(1, math.floor(base_batch * (base_resolution / resolution) ** 2))
    return size if max_batch is None else min(size, max_batch)


def resize_images(images: torch.Tensor, resolution: int) -> torch.Tensor:
    """Resize a ``(N, C, H, W)`` float batch to ``resolution`` x ``resolution`` (anti-aliased)."""
    if images.shape[-2:] == (resolution, resolution):
        return images
    return F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True)


class ProgressiveResizing(Callback):
    """Train at a resolution that changes by epoch (fast.ai 2018; Composer).

    Args:
        schedule: ``{epoch: resolution}``, piecewise constant; or give ``full_resolution`` (and
            ``initial_scale``, ``finish_fraction``, ``size_increment``) for `composer_schedule`.
        val_resolution: resolution of validation images; ``None`` leaves validation alone.
        mode: ``"auto"``, ``"datamodule"`` or ``"batch"`` (``docs/methods/progressive_resizing.md``).
        scale_batch: keep pixels per batch constant (fast.ai), up to ``max_per_device_batch``;
            needs a ``BatchSizeControllable`` datamodule, refused beside ``BatchSizeRamp``.

    Examples:
        fast.ai's DAWNBench phases, or Composer's form over 10 epochs:

        >>> resizing = ProgressiveResizing({0: 128, 10: 224, 18: 288}, val_resolution=288)
        >>> resizing.resolution(12)
        224
        >>> composer_schedule(10, full_resolution=224, initial_scale=0.5, finish_fraction=0.2)
        {0: 112, 1: 128, 2: 140, 3: 152, 4: 168, 5: 184, 6: 196, 7: 208, 8: 224}
    """

    def __init__(
        self,
        schedule: Mapping[Any, int] | None = None,
        *,
        full_resolution: int | None = None,
        initial_scale: float = 0.5,
        finish_fraction: float = 0.2,
        size_increment: int = 4,
        val_resolution: int | None = None,
        mode: str = "auto",
        scale_batch: bool = False,
        max_per_device_batch: int | None = None,
    ) -> None:
        if (schedule is None) == (full_resolution is None):
            raise ValueError(
                "ProgressiveResizing needs exactly one of schedule={epoch: resolution} or "
                "full_resolution=<px> (Composer form with initial_scale/finish_fraction)"
            )
        if mode not in MODES:
            raise ValueError(f"ProgressiveResizing.mode={mode!r}; choose one of {MODES}")
        if scale_batch and mode == "batch":
            raise ValueError(
                "ProgressiveResizing(scale_batch=True) changes the datamodule's batch size and "
                "cannot work with mode='batch'; use mode='datamodule' (or 'auto') with a "
                "datamodule implementing BatchSizeControllable, or scale_batch=false"
            )
        if val_resolution is not None:
            positive_int("ProgressiveResizing.val_resolution", val_resolution)
        self._fixed_schedule = None if schedule is None else resolve_schedule(schedule, "ProgressiveResizing.schedule")
        self.schedule = self._fixed_schedule
        self.full_resolution = full_resolution
        self.initial_scale = initial_scale
        self.finish_fraction = finish_fraction
        self.size_increment = size_increment
        self.val_resolution = val_resolution
        self.mode = mode
        self.scale_batch = scale_batch
        self.max_per_device_batch = max_per_device_batch
        self._resolved_mode = mode
        self._base_batch: int | None = None
        self._base_resolution: int | None = None
        self._prepared = PreparedEpoch("ProgressiveResizing")
        self._current = 0

    def resolution(self, epoch: int) -> int:
        """Training resolution of ``epoch``."""
        assert self.schedule is not None, "schedule is resolved at setup"
        return value_at_epoch(self.schedule, epoch)

    def batch_size(self, epoch: int) -> int | None:
        """Per-device batch of ``epoch`` under ``scale_batch``, else ``None``."""
        if not self.scale_batch:
            return None
        return scaled_batch_size(self._base_batch, self._base_resolution, self.resolution(epoch), self.max_per_device_batch)

    def check_trainer(self, trainer: pl.Trainer) -> dict[int, int]:
        """The resolution schedule over ``trainer``'s epochs (``ValueError`` if it cannot be made); no fit needed."""
        if self.scale_batch and any(isinstance(cb, BatchSizeRamp) for cb in trainer.callbacks):
            raise ValueError(
                "ProgressiveResizing(scale_batch=True) and BatchSizeRamp would both set the "
                "per-device batch size; set ProgressiveResizing.scale_batch=false to keep "
                "the ramp, or remove BatchSizeRamp"
            )
        if self._fixed_schedule is not None:
            return self._fixed_schedule
        if not trainer.max_epochs or trainer.max_epochs < 1:
            raise ValueError(
                f"ProgressiveResizing spreads its resolutions over max_epochs={trainer.max_epochs}; set "
                "max_epochs to a number of epochs or give schedule={epoch: resolution}"
            )
        return composer_schedule(trainer.max_epochs, self.full_resolution, self.initial_scale,
                                 self.finish_fraction, self.size_increment)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the schedule and the mode; validate the datamodule before training."""
        if stage != "fit":
            return
        self._prepared.epoch = 0  # a new fit; a restored checkpoint overrides it
        self._base_batch = self._base_resolution = None
        self.schedule = self.check_trainer(trainer)
        dm = trainer.datamodule
        if self.mode == "auto":
            self._resolved_mode = "datamodule" if isinstance(dm, ResolutionControllable) else "batch"
        if self._resolved_mode == "datamodule":
            require_protocol(dm, ResolutionControllable, "ProgressiveResizing(mode='datamodule')")
            trainer.reload_dataloaders_every_n_epochs = 1
            if self.val_resolution is not None:
                dm.set_val_resolution(self.val_resolution)
        if self.scale_batch:
            if self._resolved_mode != "datamodule":
                raise ValueError(
                    "ProgressiveResizing(scale_batch=True) needs a datamodule implementing "
                    f"ResolutionControllable; {type(dm).__name__} does not, so only "
                    "mode='batch' is possible; set scale_batch=false"
                )
            require_protocol(dm, BatchSizeControllable, "ProgressiveResizing(scale_batch=True)")
            self._base_batch = dm.train_batch_size
            self._base_resolution = dm.train_resolution

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Prepare the first epoch of this fit (0, or the one a resumed run restarts in)."""
        self._prepare(trainer, self._prepared.epoch)

    def _prepare(self, trainer: pl.Trainer, epoch: int) -> None:
        self._prepared.epoch = epoch
        if self._resolved_mode != "datamodule":
            return
        trainer.datamodule.set_train_resolution(self.resolution(epoch))
        if self.scale_batch:
            trainer.datamodule.set_train_batch_size(self.batch_size(epoch))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Enter the epoch training starts in (a resumed run may start mid-epoch)."""
        self._enter_epoch(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Enter the epoch and log its resolution."""
        self._enter_epoch(trainer)
        pl_module.log("resolution/train", float(self._current), on_step=False, on_epoch=True, sync_dist=True)

    def _enter_epoch(self, trainer: pl.Trainer) -> None:
        epoch = trainer.current_epoch
        self._prepared.check_entering(epoch)
        self._current = self.resolution(epoch)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Tell the datamodule the next epoch's resolution before its loader is built."""
        self._prepare(trainer, trainer.current_epoch + 1)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Batch mode: resize the images in place. Datamodule mode: check the first batch."""
        if self._resolved_mode == "batch":
            _replace_images(batch, self._current, "training")
        elif batch_idx == 0 and _images(batch) is not None:
            got = tuple(_images(batch).shape[-2:])
            if got != (self._current, self._current):
                raise RuntimeError(
                    f"ProgressiveResizing asked {type(trainer.datamodule).__name__}."
                    f"set_train_resolution({self._current}) but the training batch has images of "
                    f"{got[0]}x{got[1]}; train_dataloader() must build its transforms from "
                    "self.train_resolution on every call"
                )

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Batch mode with ``val_resolution``: resize validation images in place."""
        if self._resolved_mode == "batch" and self.val_resolution is not None:
            _replace_images(batch, self.val_resolution, "validation")

    @override
    def state_dict(self) -> dict[str, Any]:
        """Schedule, the epoch the datamodule is prepared for, and the batch reference."""
        return {
            "schedule": self.schedule,
            "prepared_epoch": self._prepared.epoch,
            "base_batch": self._base_batch,
            "base_resolution": self._base_resolution,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; refuse a checkpoint written under a different schedule."""
        saved = {int(k): v for k, v in state_dict["schedule"].items()}
        if saved != self.schedule:
            raise ValueError(
                f"the checkpoint was written with ProgressiveResizing schedule {saved}, but this "
                f"run has {self.schedule}; resume with the same schedule or start a new run"
            )
        self._prepared.epoch = state_dict["prepared_epoch"]
        self._base_batch = state_dict["base_batch"]
        self._base_resolution = state_dict["base_resolution"]


def _images(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].ndim == 4:
        return batch[0]
    return None


def _replace_images(batch: Any, resolution: int, stage: str) -> None:
    if not isinstance(batch, list) or _images(batch) is None:
        layout = type(batch).__name__
        if isinstance(batch, (list, tuple)) and batch:
            layout += f" of ({', '.join(type(b).__name__ for b in batch)})"
        raise TypeError(
            f"ProgressiveResizing(mode='batch') resizes {stage} images inside the batch and needs "
            f"a list [images (N, C, H, W), targets, ...]; got a {layout}. Return "
            "(image, target) samples with the default collate (which makes such a list), or "
            "implement ResolutionControllable on the datamodule and use mode='datamodule'"
        )
    if not batch[0].is_floating_point():
        raise TypeError(
            f"ProgressiveResizing(mode='batch') interpolates {stage} images and needs a float "
            f"tensor, got {batch[0].dtype}; convert images to float in the dataset or use "
            "mode='datamodule'"
        )
    batch[0] = resize_images(batch[0], resolution)
