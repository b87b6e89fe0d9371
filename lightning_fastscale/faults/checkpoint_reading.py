"""Checkpoints for resuming: find the newest one, read it, and say what does not match.

More in ``docs/faults.md`` ("Reading checkpoints").
"""
from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_fastscale.faults.atomic_checkpoint_io import files_in, remove_partial_files

# Entries of a torch LR scheduler's state that move as training goes on; every other entry
# (T_max, milestones, gamma, base_lrs, total_iters, ...) is the schedule itself.
SCHEDULER_PROGRESS_KEYS = frozenset(
    {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "verbose"}
)

_MAX_LISTED = 5

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and the reason."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"checkpoint {self.path}: {reason}")


def checkpoints_newest_first(folders: Iterable[str | Path]) -> list[Path]:
    """The ``*.ckpt`` files in ``folders`` (not recursive), the latest modification time first, ties by name."""
    return sorted(files_in(folders, "*.ckpt"), key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)


def newest_checkpoint(folders: Iterable[str | Path]) -> Path | None:
    """The most recently written ``*.ckpt`` file in ``folders`` (see `checkpoints_newest_first`), or None."""
    candidates = checkpoints_newest_first(folders)
    return candidates[0] if candidates else None


def newest_complete_checkpoint(folders: Iterable[str | Path]) -> tuple[Path | None, list[CheckpointError]]:
    """The newest checkpoint in ``folders`` that `read_checkpoint` accepts, and the newer ones it refused."""
    skipped: list[CheckpointError] = []
    for path in checkpoints_newest_first(folders):
        try:
            read_checkpoint(path)
        except CheckpointError as err:
            skipped.append(err)
            continue
        return path, skipped
    return None, skipped


def unreadable(path: str | Path, err: BaseException) -> CheckpointError:
    """The error for a checkpoint file that could not be loaded: its size and what to do."""
    path = Path(path)
    size = path.stat().st_size if path.is_file() else None
    if size is None:
        return CheckpointError(path, "no such file; check ckpt_path or the run folder")
    if size == 0:
        return CheckpointError(path, "the file is empty (0 bytes); it was never written. Delete it "
                               "or resume from another checkpoint")
    cause = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
    if isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower():
        return CheckpointError(
            path,
            f"holds objects that torch.load(weights_only=True) refuses ({cause}); load it with "
            "weights_only=False only if you trust where it came from",
        )
    return CheckpointError(
        path,
        f"cannot be read ({cause}); the file ({size} bytes) is truncated or not a checkpoint, e.g. "
        "the job was killed while writing it. Delete it to resume from the previous checkpoint, "
        "or start a new run",
    )


def check_is_lightning_checkpoint(path: str | Path, checkpoint: Any) -> None:
    """Raise `CheckpointError` unless ``checkpoint`` looks like a Lightning checkpoint."""
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        found = sorted(checkpoint)[:_MAX_LISTED] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise CheckpointError(path, f"is not a Lightning checkpoint (no 'state_dict'; found {found})")


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a Lightning checkpoint on the CPU, or raise `CheckpointError` naming the file, its size and what to do."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        raise unreadable(path, FileNotFoundError(str(path)))
    try:
        # mmap: tensors stay on disk until used, so reading a large checkpoint to check it is
        # cheap; weights_only as Lightning itself loads with torch >= 2.6
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # zip, pickle and EOF errors all mean the same thing here
        raise unreadable(path, err) from err
    check_is_lightning_checkpoint(path, checkpoint)
    return dict(checkpoint)


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def state_dict_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Differences between a saved model state dict and the current model's: keys and shapes."""
    problems = []
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    if missing:
        problems.append(f"the model has {len(missing)} tensors the checkpoint lacks ({_listed(missing)})")
    if unexpected:
        problems.append(f"the checkpoint has {len(unexpected)} tensors the model lacks ({_listed(unexpected)})")
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(current[k].shape)}"
        for k in current
        if k in saved and hasattr(saved[k], "shape") and hasattr(current[k], "shape")
        and tuple(saved[k].shape) != tuple(current[k].shape)
    ]
    if shapes:
        problems.append(f"{len(shapes)} tensors differ in shape ({_listed(shapes)})")
    return problems


def hparams_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Hyper-parameters (``save_hyperparameters``) whose saved and current values differ."""
    keys = sorted(set(saved) | set(current), key=str)
    return [
        f"hyper-parameter {k!r}: checkpoint {saved.get(k, '<absent>')!r} vs this run {current.get(k, '<absent>')!r}"
        for k in keys
        if saved.get(k, _ABSENT) != current.get(k, _ABSENT)
    ]


_ABSENT = object()


def _schedule_part(state: Any) -> Any:
    """A scheduler state without its progress entries (recursively, for SequentialLR & co.)."""
    if isinstance(state, Mapping):
        return {k: _schedule_part(v) for k, v in state.items() if k not in SCHEDULER_PROGRESS_KEYS}
    if isinstance(state, (list, tuple)):
        return [_schedule_part(v) for v in state]
    if isinstance(state, torch.Tensor):
        return state.tolist()
    return state


def scheduler_mismatches(saved_states: Sequence[Mapping[str, Any]], schedulers: Sequence[Any]) -> list[str]:
    """How the saved LR schedulers differ from ``schedulers`` (progress entries ignored)."""
    if len(saved_states) != len(schedulers):
        return [f"the checkpoint has {len(saved_states)} LR schedulers, this run {len(schedulers)}"]
    problems = []
    for i, (saved, scheduler) in enumerate(zip(saved_states, schedulers)):
        now = _schedule_part(scheduler.state_dict())
        then = _schedule_part(saved)
        name = type(scheduler).__name__
        for key in sorted(set(now) | set(then)):
            if now.get(key, "<absent>") != then.get(key, "<absent>"):
                problems.append(
                    f"LR scheduler {i} ({name}) {key}: checkpoint {then.get(key, '<absent>')!r} "
                    f"vs this run {now.get(key, '<absent>')!r}"
                )
    return problems


def optimizer_mismatches(saved_states: Sequence[Mapping[str, Any]], optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
    """Structural differences of optimizers: how many, their parameter groups and sizes (not hyper-parameters)."""
    if len(saved_states) != len(optimizers):
        return [f"the checkpoint has {len(saved_states)} optimizers, this run {len(optimizers)}"]
    problems = []
    for i, (saved, optimizer) in enumerate(zip(saved_states, optimizers)):
        saved_groups = [len(g["params"]) for g in saved.get("param_groups", [])]
        groups = [len(g["params"]) for g in optimizer.param_groups]
        if saved_groups != groups:
            problems.append(
                f"optimizer {i} ({type(optimizer).__name__}) parameter groups hold {saved_groups} "
                f"tensors in the checkpoint vs {groups} in this run (another model, or another "
                "weight-decay grouping)"
            )
    return problems


def raise_if_mismatched(path: str | Path, problems: Sequence[str], what: str) -> None:
    """Raise `CheckpointError` listing ``problems`` (a no-op when there are none)."""
    if problems:
        raise CheckpointError(
            path,
            f"was written by another {what}:\n  - " + "\n  - ".join(problems)
            + "\nResume with the settings it was written with, or start a new run "
            "(a fresh run folder) to train with these",
        )


def resume_point(folders: Sequence[str | Path]) -> str | None:
    """The checkpoint ``resume=auto`` continues from in ``folders`` (skipping incomplete ones), or None for a fresh start."""
    remove_partial_files(folders)
    newest, skipped = newest_complete_checkpoint(folders)
    for err in skipped:
        log.warning("resume=auto: skipping %s (%s)", err.path, err.reason)
    if newest is None and skipped:
        raise CheckpointError(
            skipped[0].path,
            f"resume=auto found no complete checkpoint in {', '.join(map(str, folders))}: "
            + "; ".join(f"{err.path.name}: {err.reason}" for err in skipped)
            + ". Delete them to start the run over, or resume from a copy you trust with ckpt_path=...",
        )
    if newest is None:
        log.info("resume=auto: no complete checkpoint in %s yet; starting a fresh run", ", ".join(map(str, folders)) or "-")
        return None
    log.info("resume=auto: continuing from %s", newest)
    return str(newest)
