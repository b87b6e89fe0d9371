"""Every touch of Lightning's private state in this package, one function each, with what forces it.

Lightning 2.6 has no public interface for these (its resumable-loader support stops at a
loader's own ``state_dict``; the fault-tolerant loop that did more was removed for 2.0, Lightning
issue #9123). Kept here so an upgrade that moves one breaks this module and nothing else.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader


def fit_loader_owner(trainer: pl.Trainer) -> Any:
    """The object ``fit`` takes its training loaders from (the module, or loaders passed to ``fit``).

    Private: ``fit_loop._data_source``. No public hook exposes loaders given to ``trainer.fit``
    directly before the fit loop builds them.
    """
    return getattr(getattr(trainer.fit_loop, "_data_source", None), "instance", None)


def restart_train_iterator(trainer: pl.Trainer, before: Callable[[], None] | None = None) -> bool:
    """Make the training loader's iterator again (calling ``before`` first), as from ``on_train_start``.

    Private: ``fit_loop._data_fetcher``. Lightning makes the epoch's iterator before
    ``on_train_start``, and no public call remakes it. Returns whether there was one (``before``
    runs only then).
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None:
        return False
    if before is not None:
        before()
    iter(fetcher)
    return True


def load_pending_loader_state(trainer: pl.Trainer) -> bool:
    """Hand a resumed fit's saved training-loader state to a loader built before the restore.

    Lightning issue #20550: ``trainer.estimated_stepping_batches`` (which ``configure_optimizers``
    calls to size an LR schedule) builds the loader before the checkpoint's loop state is
    restored, and the saved state is then never loaded. This does what Lightning's restore path
    does when it builds the loader afterwards. Private: ``fit_loop._combined_loader_states_to_load``,
    ``_combined_loader``, ``_load_combined_loader_states``. Returns whether there was a state.
    """
    fit_loop = trainer.fit_loop
    pending = getattr(fit_loop, "_combined_loader_states_to_load", None)
    if not pending or getattr(fit_loop, "_combined_loader", None) is None or not fit_loop.restarting:
        return False
    fit_loop._load_combined_loader_states()
    return restart_train_iterator(trainer)  # the iterator made before the restore would start the epoch over


def loader_with_sampler(loader: Any, sampler: Any) -> Any:
    """``loader`` made again from its class and ``__init__`` arguments, with ``sampler``.

    Private: ``lightning.pytorch.utilities.data._update_dataloader``, what Lightning itself does
    to add a ``DistributedSampler``; a ``DataLoader`` refuses a new sampler after ``__init__``, and
    this keeps a user's ``DataLoader`` subclass and its arguments.
    """
    return _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)


def cluster_environment(trainer: pl.Trainer) -> Any:
    """The Trainer's cluster environment on any strategy (SLURM requeue needs it on one device too).

    Private: ``trainer._accelerator_connector``; the public ``strategy.cluster_environment``
    exists only on multi-process strategies.
    """
    return trainer._accelerator_connector.cluster_environment


def checkpoint_fit_loop(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The fit loop's entry of a Lightning checkpoint (``loops.fit_loop``), a layout Lightning does not document."""
    return (checkpoint.get("loops") or {}).get("fit_loop") or {}


def inside_lightning_hook(module: pl.LightningModule) -> bool:
    """Whether a Lightning hook is running on ``module`` (where ``self.log`` is allowed).

    Private: ``LightningModule._current_fx_name``, which ``self.log`` itself checks.
    """
    return module._current_fx_name is not None


def transfer_batch(module: pl.LightningModule, batch: Any) -> Any:
    """``batch`` moved to the module's device through its own batch hooks, as the fit loop moves it.

    Private: ``LightningModule._apply_batch_transfer_handler`` (``on_before_batch_transfer``,
    ``transfer_batch_to_device``, ``on_after_batch_transfer``); the public hooks each do one part.
    """
    return module._apply_batch_transfer_handler(batch)


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or None (the public ``module.trainer`` raises instead).

    Private: ``LightningModule._trainer``.
    """
    return module._trainer


def copy_without_trainer(module: pl.LightningModule) -> pl.LightningModule:
    """A deep copy of ``module`` that does not copy the Trainer it is attached to.

    Private: ``LightningModule._trainer``, detached for the copy and put back.
    """
    attached = module._trainer
    module._trainer = None
    try:
        return copy.deepcopy(module)
    finally:
        module._trainer = attached


def logs_hyperparameters(module: pl.LightningModule) -> bool:
    """False where the module opted out with ``save_hyperparameters(logger=False)``.

    Private: ``LightningModule._log_hyperparams``, the flag Lightning's own logging reads.
    """
    return bool(module._log_hyperparams)
