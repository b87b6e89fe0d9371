"""Helpers shared by the epoch-scheduled callbacks (batch-size ramp, progressive resizing, LR).

* ``{epoch: value}`` schedules: `resolve_schedule` checks and sorts one as YAML/Hydra
  gives it, `value_at_epoch` reads it piecewise-constant.
* `PreparedEpoch`: Lightning builds the training dataloader of an epoch *before*
  ``on_train_epoch_start`` runs, so a callback that changes what the loader serves (batch
  size, resolution) tells the datamodule about epoch ``e + 1`` at the end of epoch ``e``.
  This object remembers which epoch was prepared and refuses to enter any other one, which
  catches a checkpoint written between the two (a callback that saves before this one at
  ``on_train_epoch_end``).
* `loader_batch_size`: the per-device batch size the Trainer's training loader serves.

Private to `lightning_fastscale.callbacks`: the public callbacks re-export what users need.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from lightning_fastscale._validation import positive_int


def resolve_schedule(schedule: Mapping[Any, Any], setting: str = "schedule") -> dict[int, int]:
    """Turn ``{epoch: value}`` (keys may be strings, as YAML/Hydra gives them) into a sorted dict.

    The schedule must start at epoch 0 and hold positive integer values.

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
    current = None
    for start, value in sorted(schedule.items()):
        if start > epoch:
            break
        current = value
    if current is None:
        raise ValueError(f"schedule {dict(schedule)} has no value at epoch {epoch}")
    return current


def loader_batch_size(trainer: pl.Trainer) -> int | None:
    """Per-device batch size of the training dataloader Lightning is using, if it has one."""
    loader = trainer.train_dataloader
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


class PreparedEpoch:
    """Which epoch's dataloader a scheduling callback has set the datamodule up for.

    Args:
        owner: the callback's class name, used in the error message.

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

    def reset(self) -> None:
        """A new fit starts at epoch 0 (a checkpoint restored later overrides this)."""
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
