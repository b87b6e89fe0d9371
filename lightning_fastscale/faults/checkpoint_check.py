"""Refuse a truncated or mismatched checkpoint before the first training step.

More in ``docs/faults.md`` ("The checkpoint check").
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fastscale.faults import checkpoint_reading
from lightning_fastscale.faults.atomic_checkpoint_io import AtomicCheckpointIO


def _is_schedule_callback(cls: type) -> bool:
    """A callback of this package whose checkpointed state is part of the training schedule."""
    return (
        cls.__module__.startswith(("lightning_fastscale.callbacks", "lightning_fastscale.faults"))
        and cls.state_dict is not Callback.state_dict
        and not getattr(cls, "schedule_neutral", False)
    )


def _class_name(state_key: str) -> str:
    return state_key.split("{", 1)[0]


class _CheckingCheckpointIO(CheckpointIO):
    """Delegates to the strategy's own ``CheckpointIO``; checks every checkpoint it loads."""

    def __init__(self, inner: CheckpointIO, check: Callable[[str, dict[str, Any]], None]) -> None:
        self.inner = inner
        self.check = check

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"weights_only": weights_only}
        if map_location is not None:
            kwargs["map_location"] = map_location
        try:
            checkpoint = self.inner.load_checkpoint(path, **kwargs)
        except Exception as err:  # zip, pickle, seek and EOF errors all mean the same here
            raise checkpoint_reading.unreadable(path, err) from err
        self.check(str(path), checkpoint)
        return checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.inner.teardown()


class CheckpointCheck(Callback):
    """Check the checkpoint a fit resumes from (``ckpt_path``) before any step runs.

    A `CheckpointError` names the file and each difference (``docs/faults.md``, "The checkpoint check").

    Examples:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[CheckpointCheck()])  # doctest: +SKIP
        >>> trainer.fit(model, ckpt_path="run/checkpoints/last.ckpt")  # doctest: +SKIP
    """

    schedule_neutral = True

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._original_io: CheckpointIO | None = None
        self._pending: tuple[str, list[dict[str, Any]], list[dict[str, Any]]] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer, self._pending = trainer, None
        strategy = trainer.strategy
        self._original_io = strategy.checkpoint_io
        inner = self._original_io
        if type(inner) is TorchCheckpointIO:  # Lightning's default: its local writes are not atomic
            inner = AtomicCheckpointIO()
        strategy.checkpoint_io = _CheckingCheckpointIO(inner, self._check)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._original_io is not None:
            trainer.strategy.checkpoint_io = self._original_io
            self._original_io = None

    def _check(self, path: str, checkpoint: dict[str, Any]) -> None:
        trainer = self._trainer
        assert trainer is not None
        pl_module = trainer.lightning_module
        checkpoint_reading.check_is_lightning_checkpoint(path, checkpoint)
        checkpoint_reading.raise_if_mismatched(
            path, checkpoint_reading.state_dict_mismatches(checkpoint["state_dict"], pl_module.state_dict()),
            "model",
        )
        checkpoint_reading.raise_if_mismatched(
            path, checkpoint_reading.hparams_mismatches(checkpoint.get("hyper_parameters", {}), dict(pl_module.hparams)),
            "configuration of the module",
        )
        checkpoint_reading.raise_if_mismatched(
            path, self._callback_mismatches(trainer, checkpoint.get("callbacks", {})), "schedule",
        )
        # only the small parts are kept: parameter-group sizes and scheduler settings
        optimizer_states = [
            {"param_groups": [{"params": list(g["params"])} for g in s.get("param_groups", [])]}
            for s in checkpoint.get("optimizer_states", [])
        ]
        self._pending = (path, optimizer_states, list(checkpoint.get("lr_schedulers", [])))
        if trainer.optimizers:  # a strategy that restores after setting up the optimizers
            self._check_optimization(trainer)

    @staticmethod
    def _callback_mismatches(trainer: pl.Trainer, saved: dict[str, Any]) -> list[str]:
        import lightning_fastscale.callbacks as package_callbacks

        problems = []
        current = {cb.state_key: cb for cb in trainer.callbacks}
        current_names = {_class_name(k) for k, cb in current.items() if _is_schedule_callback(type(cb))}
        for key in saved:
            cls = getattr(package_callbacks, _class_name(key), None)
            if isinstance(cls, type) and _is_schedule_callback(cls) and _class_name(key) not in current_names:
                problems.append(f"the checkpoint was written with {_class_name(key)}, this run has none")
        for key, callback in current.items():
            if not _is_schedule_callback(type(callback)):
                continue
            if key not in saved:
                problems.append(f"this run has {_class_name(key)}, the checkpoint was written without it")
                continue
            trial = copy.copy(callback)  # load_state_dict assigns attributes: the copy takes them
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trial.load_state_dict(saved[key])
            except Exception as err:  # the callback's own refusal says what differs
                problems.append(f"{_class_name(key)}: {err}")
        return problems

    def _check_optimization(self, trainer: pl.Trainer) -> None:
        if self._pending is None:
            return
        (path, optimizer_states, scheduler_states), self._pending = self._pending, None
        checkpoint_reading.raise_if_mismatched(
            path, checkpoint_reading.optimizer_mismatches(optimizer_states, trainer.optimizers), "optimizer setup",
        )
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        checkpoint_reading.raise_if_mismatched(
            path, checkpoint_reading.scheduler_mismatches(scheduler_states, schedulers), "LR schedule",
        )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_optimization(trainer)
