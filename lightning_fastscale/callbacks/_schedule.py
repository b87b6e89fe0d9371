"""Helpers of the epoch-scheduled callbacks: ``{epoch: value}`` schedules and `PreparedEpoch`.

Why `PreparedEpoch` exists: ``docs/methods/batch_size_ramp.md`` ("In code").
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from lightning_fastscale._validation import positive_int


def resolve_schedule(schedule: Mapping[Any, Any], setting: str = "schedule") -> dict[int, int]:
    """Check ``{epoch: value}`` (keys may be strings, as from YAML) and sort it; epoch 0 is required.

    Examples:
        >>> resolve_schedule({"10": 2048, "0": 1024})
        {0: 1024, 10: 2048}
    """
    if not schedule:
        raise ValueError(f"{setting} is empty; give at least {{0: <value>}}")
    out: dict[int, int] = {}
    for key, value in schedule.items():
        try:
            epoch = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{setting} key {key!r} is not an epoch number") from None
        if epoch < 0:
            raise ValueError(f"{setting} key {epoch} is negative; epochs start at 0")
        out[epoch] = positive_int(f"{setting}[{epoch}]", value)
    if 0 not in out:
        raise ValueError(
            f"{setting} has no entry for epoch 0 (got epochs {sorted(out)}); "
            f"add 0: <value> so the first epoch has a defined value"
        )
    return dict(sorted(out.items()))


def value_at_epoch(schedule: Mapping[int, int], epoch: int) -> int:
    """The value of a piecewise-constant ``{start_epoch: value}`` schedule at ``epoch``.

    Examples:
        >>> value_at_epoch({0: 128, 10: 224, 18: 288}, 12)
        224
    """
    started = [value for start, value in sorted(schedule.items()) if start <= epoch]
    if not started:
        raise ValueError(f"schedule {dict(schedule)} has no value at epoch {epoch}")
    return started[-1]


def loader_batch_size(trainer: pl.Trainer) -> int | None:
    """Per-device batch size of the training dataloader Lightning is using, if it has one."""
    loader = trainer.train_dataloader
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


class PreparedEpoch:
    """Which epoch's dataloader a scheduling callback (class name ``owner``) has prepared.

    Examples:
        >>> prepared = PreparedEpoch("BatchSizeRamp")
        >>> prepared.check_entering(0)        # a new fit starts at epoch 0
        >>> prepared.epoch = 1                # told the datamodule about epoch 1 at the end of 0
        >>> prepared.check_entering(1)
        >>> prepared.check_entering(2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: BatchSizeRamp prepared the dataloader for epoch 1 but epoch 2 is starting; ...
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.epoch = 0

    def check_entering(self, epoch: int) -> None:
        """Raise unless ``epoch`` is the one the datamodule was prepared for."""
        if epoch != self.epoch:
            raise RuntimeError(
                f"{self.owner} prepared the dataloader for epoch {self.epoch} but epoch {epoch} "
                "is starting; this happens when a checkpoint was saved by a callback that runs "
                f"before {self.owner} at on_train_epoch_end. Put {self.owner} before it in the "
                "callback list"
            )
