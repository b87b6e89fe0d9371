"""The protocol a datamodule implements so that a batch-size ramp and progressive resizing can drive it.

More in ``docs/methods/batch_size_ramp.md`` ("The datamodule protocol").
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning_fastscale._validation import positive_int


@runtime_checkable
class BatchSizeControllable(Protocol):
    """A datamodule whose per-device training batch size can change between epochs."""

    train_batch_size: int

    def set_train_batch_size(self, per_device_batch_size: int) -> None:
        """Make the next ``train_dataloader()`` use ``per_device_batch_size``."""


@runtime_checkable
class ResolutionControllable(Protocol):
    """A datamodule whose training and validation resolutions can change between epochs."""

    train_resolution: int
    val_resolution: int

    def set_train_resolution(self, resolution: int) -> None:
        """Make the next ``train_dataloader()`` produce ``resolution`` x ``resolution`` images."""

    def set_val_resolution(self, resolution: int) -> None:
        """Make the next ``val_dataloader()`` produce ``resolution`` x ``resolution`` images."""


def require_protocol(datamodule: Any, protocol: type, needed_by: str) -> None:
    """Raise a ``TypeError`` naming what is missing if ``datamodule`` lacks ``protocol``."""
    if datamodule is None:
        raise TypeError(
            f"{needed_by} needs a LightningDataModule passed as Trainer.fit(datamodule=...); "
            "plain dataloaders cannot change batch size or resolution between epochs"
        )
    if not isinstance(datamodule, protocol):
        setters = ("set_train_batch_size", "set_train_resolution", "set_val_resolution")
        wanted = [n for n in protocol.__annotations__ if not hasattr(datamodule, n)]
        wanted += [n for n in setters if hasattr(protocol, n) and not callable(getattr(datamodule, n, None))]
        raise TypeError(
            f"{needed_by} needs a datamodule implementing {protocol.__name__} "
            f"(see lightning_fastscale.data.protocol); {type(datamodule).__name__} lacks "
            f"{', '.join(wanted) or 'part of it'}"
        )


def check_positive(name: str, value: int) -> int:
    """Validate a batch size or resolution given to a setter (raises ``ValueError`` naming it)."""
    return positive_int(name, value)


def whole_global_batches(count: int, group: int) -> int:
    """``count`` cut down to a multiple of ``group``: an epoch trains on whole global batches only.

    The tail rule of an epoch (Goyal et al. 2017 keep the global batch of every step): samples of
    `GlobalOrderSampler` (``group`` the global batch) and batches per rank of the streaming
    training loader (``group`` the accumulation), so every world size that keeps the global
    batch has the same samples and optimizer steps per epoch.

    Examples:
        >>> whole_global_batches(104, 16), whole_global_batches(13, 2)
        (96, 12)
    """
    return count // group * group
