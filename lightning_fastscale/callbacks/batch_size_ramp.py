"""Let the global batch grow during training (Mikami et al. 2018; Smith et al. 2017).

Method card: ``docs/methods/batch_size_ramp.md``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.callbacks._schedule import (
    PreparedEpoch,
    loader_batch_size,
    resolve_schedule,
    value_at_epoch,
)
from lightning_fastscale.data.protocol import BatchSizeControllable, require_protocol

__all__ = [
    "BatchPlan", "BatchSizeRamp", "decompose", "resolve_schedule", "smith_schedule", "value_at_epoch",
    "world_sizes_that_split",
]


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is served: ``per_device * world_size * accumulation``."""

    global_batch: int
    per_device: int
    accumulation: int


def smith_schedule(
    initial_global_batch: int, lr_milestones: Sequence[int], lr_decay_factor: float
) -> dict[int, int]:
    """Smith et al. 2017: batch ``initial_global_batch / lr_decay_factor**i`` (rounded) from milestone ``i``."""
    if not 0 < lr_decay_factor < 1:
        raise ValueError(
            f"lr_decay_factor={lr_decay_factor} must be in (0, 1): it is the factor the LR "
            "schedule would multiply the LR by (e.g. 0.1); the batch grows by its inverse"
        )
    milestones = sorted(int(m) for m in lr_milestones)
    if any(m <= 0 for m in milestones) or len(set(milestones)) != len(milestones):
        raise ValueError(f"lr_milestones={list(lr_milestones)} must be distinct positive epochs")
    return {0: initial_global_batch} | {m: round(initial_global_batch / lr_decay_factor**i)
                                        for i, m in enumerate(milestones, start=1)}


def decompose(global_batch: int, world_size: int, max_per_device_batch: int | None) -> BatchPlan:
    """Split ``global_batch`` into per-device batch (up to the ceiling) x ``world_size`` x fewest accumulation steps."""
    if global_batch % world_size:
        lower = global_batch // world_size * world_size
        raise ValueError(
            f"global batch {global_batch} is not divisible by the world size {world_size} "
            f"(devices x nodes); use a multiple of {world_size}, e.g. {lower or world_size} "
            f"or {lower + world_size}"
        )
    share = global_batch // world_size
    if max_per_device_batch is None or share <= max_per_device_batch:
        return BatchPlan(global_batch, share, 1)
    positive_int("max_per_device_batch", max_per_device_batch)
    accumulation = next(a for a in range(math.ceil(share / max_per_device_batch), share + 1) if share % a == 0)
    per_device = share // accumulation
    if 2 * per_device <= max_per_device_batch:
        step = world_size * max_per_device_batch
        below = global_batch // step * step
        raise ValueError(
            f"global batch {global_batch} on {world_size} processes ({share} per process) only "
            f"splits under max_per_device_batch={max_per_device_batch} as {per_device} x "
            f"{accumulation} accumulation steps, which wastes the device; use a global batch "
            f"that is a multiple of world_size x max_per_device_batch = {step}, e.g. "
            f"{below or step} or {below + step}, or change max_per_device_batch"
        )
    return BatchPlan(global_batch, per_device, accumulation)


def world_sizes_that_split(global_batches: Sequence[int], max_per_device_batch: int | None, near: int) -> list[int]:
    """The world sizes nearest ``near`` (at most six, ascending) on which `decompose` splits every batch.

    Examples:
        >>> world_sizes_that_split([24], None, near=5)
        [1, 2, 3, 4, 6, 8]
    """
    def splits(world_size: int) -> bool:
        try:
            return all(decompose(g, world_size, max_per_device_batch) for g in global_batches)
        except ValueError:
            return False

    fitting = [w for w in range(1, max(global_batches) + 1) if splits(w)]
    return sorted(sorted(fitting, key=lambda w: (abs(w - near), w))[:6])


class BatchSizeRamp(Callback):
    """Grow the global batch during training (Mikami et al. 2018; Smith et al. 2017).

    Args:
        schedule: ``{epoch: global_batch}``, piecewise constant; or give the three Smith
            arguments (``initial_global_batch``, ``lr_milestones``, ``lr_decay_factor``).
        max_per_device_batch: memory ceiling of one device, above which gradients are
            accumulated; ``None``: never accumulate.
        scale_lr: linear scaling rule (Goyal et al. 2017): each group's LR becomes
            ``lr_at_fit_start * global_batch / schedule[0]``; refused beside ``WarmupDecayLR``
            or a scheduler (use ``WarmupDecayLR(reference_batch=...)``).

    The datamodule must implement ``BatchSizeControllable``. As in plain Lightning, a partial
    last batch of an epoch is stepped on as it is.

    Examples:
        Mikami et al.'s shape of ramp on 8 processes with a 128-sample memory ceiling:

        >>> ramp = BatchSizeRamp({0: 1024, 10: 2048}, max_per_device_batch=128)
        >>> ramp.plan(0, world_size=8)
        BatchPlan(global_batch=1024, per_device=128, accumulation=1)
        >>> ramp.plan(10, world_size=8)
        BatchPlan(global_batch=2048, per_device=128, accumulation=2)
        >>> BatchSizeRamp(initial_global_batch=256, lr_milestones=[30, 60], lr_decay_factor=0.1).schedule
        {0: 256, 30: 2560, 60: 25600}
    """

    def __init__(
        self,
        schedule: Mapping[Any, int] | None = None,
        *,
        initial_global_batch: int | None = None,
        lr_milestones: Sequence[int] | None = None,
        lr_decay_factor: float | None = None,
        max_per_device_batch: int | None = None,
        scale_lr: bool = False,
    ) -> None:
        smith_args = (initial_global_batch, lr_milestones, lr_decay_factor)
        if schedule is not None and any(a is not None for a in smith_args):
            raise ValueError(
                "BatchSizeRamp: give either schedule={epoch: global_batch} or "
                "initial_global_batch + lr_milestones + lr_decay_factor (Smith et al.), not both"
            )
        if schedule is None:
            if any(a is None for a in smith_args):
                raise ValueError(
                    "BatchSizeRamp needs schedule={epoch: global_batch}, or all of "
                    "initial_global_batch, lr_milestones and lr_decay_factor"
                )
            schedule = smith_schedule(initial_global_batch, lr_milestones, lr_decay_factor)
        self.schedule = resolve_schedule(schedule, "BatchSizeRamp.schedule")
        if max_per_device_batch is not None:
            positive_int("BatchSizeRamp.max_per_device_batch", max_per_device_batch, hint="or None for no ceiling")
        self.max_per_device_batch = max_per_device_batch
        self.scale_lr = scale_lr
        self._world_size = 1
        self._prepared = PreparedEpoch("BatchSizeRamp")
        self._base_lrs: list[list[float]] | None = None

    def plan(self, epoch: int, world_size: int | None = None) -> BatchPlan:
        """The batch plan of ``epoch`` on ``world_size`` processes."""
        return decompose(
            value_at_epoch(self.schedule, epoch), world_size or self._world_size,
            self.max_per_device_batch,
        )

    def check_trainer(self, trainer: pl.Trainer) -> list[BatchPlan]:
        """Every scheduled batch split over ``trainer``'s processes (``ValueError`` if one cannot be); no fit needed."""
        self._world_size = trainer.world_size
        try:
            plans = [self.plan(epoch) for epoch in self.schedule]
        except ValueError as error:
            sizes = world_sizes_that_split(list(self.schedule.values()), self.max_per_device_batch, trainer.world_size)
            raise ValueError(f"{error}; world sizes (devices x nodes) on which every stage splits: {sizes}") from error
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and "
                "BatchSizeRamp both set gradient accumulation; remove accumulate_grad_batches "
                "(BatchSizeRamp accumulates when the per-device share of the global batch exceeds "
                "max_per_device_batch)"
            )
        return plans

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Validate the datamodule and every scheduled size before any training step."""
        if stage != "fit":
            return
        require_protocol(trainer.datamodule, BatchSizeControllable, "BatchSizeRamp")
        self._prepared.epoch = 0  # a new fit; a restored checkpoint overrides it
        self._base_lrs = None
        plans = self.check_trainer(trainer)
        if any(p.accumulation > 1 for p in plans) and not pl_module.automatic_optimization:
            raise ValueError(
                "BatchSizeRamp needs gradient accumulation for this schedule (max_per_device_batch="
                f"{self.max_per_device_batch}), which Lightning only does under automatic "
                "optimization; raise max_per_device_batch or use automatic optimization"
            )
        # WarmupDecayLR.setup refuses scale_lr=True beside it, so the check lives there only.
        trainer.reload_dataloaders_every_n_epochs = 1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Serve the first epoch of this fit (0, or the resumed one) and capture base LRs."""
        if self.scale_lr:
            if trainer.lr_scheduler_configs:
                raise ValueError(
                    "BatchSizeRamp(scale_lr=True) would fight the LR scheduler returned by "
                    "configure_optimizers; set scale_lr=false, or drop that scheduler and use "
                    "WarmupDecayLR(reference_batch=...) which also follows the batch"
                )
            if self._base_lrs is None:
                self._base_lrs = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]
        plan = self.plan(self._prepared.epoch)
        trainer.datamodule.set_train_batch_size(plan.per_device)
        # before the loader is sized: ExactResume's epoch order counts in global batches
        trainer.accumulate_grad_batches = plan.accumulation

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply the plan of the epoch training starts in (a resumed run may start mid-epoch)."""
        self._enter_epoch(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Apply this epoch's plan and log it."""
        plan = self._enter_epoch(trainer)
        pl_module.log_dict(
            {
                "batch_size/global": float(plan.global_batch),
                "batch_size/per_device": float(plan.per_device),
                "batch_size/accumulation": float(plan.accumulation),
            },
            on_step=False, on_epoch=True, sync_dist=True,
        )

    def _enter_epoch(self, trainer: pl.Trainer) -> BatchPlan:
        """Check the loader serves this epoch's batch; set accumulation and (optionally) LR."""
        epoch = trainer.current_epoch
        plan = self.plan(epoch)
        self._prepared.check_entering(epoch)
        served = loader_batch_size(trainer)
        if served is not None and served != plan.per_device:
            raise RuntimeError(
                f"BatchSizeRamp asked {type(trainer.datamodule).__name__}.set_train_batch_size("
                f"{plan.per_device}) for epoch {epoch}, but the training dataloader has batch_size "
                f"{served}; train_dataloader() must build a new DataLoader with "
                "self.train_batch_size on every call (do not cache it)"
            )
        # The fit loop reads this on every batch (as GradientAccumulationScheduler relies on).
        trainer.accumulate_grad_batches = plan.accumulation
        if self.scale_lr and self._base_lrs is not None:
            ratio = plan.global_batch / self.schedule[0]
            for opt, bases in zip(trainer.optimizers, self._base_lrs):
                for group, base in zip(opt.param_groups, bases):
                    group["lr"] = base * ratio
        return plan

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Tell the datamodule the next epoch's per-device batch before its loader is built."""
        self._prepared.epoch = trainer.current_epoch + 1
        plan = self.plan(self._prepared.epoch)
        trainer.datamodule.set_train_batch_size(plan.per_device)
        trainer.accumulate_grad_batches = plan.accumulation  # the epoch's steps are done

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Hand accumulation back to the Trainer's default, so a later fit starts clean."""
        if stage == "fit":
            trainer.accumulate_grad_batches = 1

    @override
    def state_dict(self) -> dict[str, Any]:
        """Schedule, the epoch the datamodule is prepared for, and base LRs (for resuming)."""
        return {
            "schedule": dict(self.schedule),
            "max_per_device_batch": self.max_per_device_batch,
            "prepared_epoch": self._prepared.epoch,
            "base_lrs": self._base_lrs,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the ramp position; refuse a checkpoint written under a different schedule."""
        saved = {int(k): v for k, v in state_dict["schedule"].items()}
        if saved != self.schedule or state_dict["max_per_device_batch"] != self.max_per_device_batch:
            raise ValueError(
                f"the checkpoint was written with BatchSizeRamp schedule {saved} and "
                f"max_per_device_batch={state_dict['max_per_device_batch']}, but this run has "
                f"{self.schedule} and {self.max_per_device_batch}; resume with the same settings "
                "or start a new run"
            )
        self._prepared.epoch = state_dict["prepared_epoch"]
        self._base_lrs = state_dict["base_lrs"]
