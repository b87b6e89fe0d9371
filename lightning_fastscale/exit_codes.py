"""How a ``fastscale-train`` run ends, as one exit status per kind, so a launcher knows whether to retry
(the table is in ``docs/hydra.md``).
"""
from __future__ import annotations

import enum
import errno
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ExitCode", "end_agreed", "exit_code_for", "launcher_reports_for"]


class ExitCode(enum.IntEnum):
    """Exit status of ``fastscale-train`` by kind of ending; `retryable` says whether to restart.

    Examples:
        >>> ExitCode.PREEMPTED, ExitCode.PREEMPTED.retryable, ExitCode.BAD_SETTING.retryable
        (<ExitCode.PREEMPTED: 75>, True, False)
    """

    FINISHED = 0
    BAD_SETTING = 2
    BAD_DATA = 3
    DIVERGED = 4
    PREEMPTED = 75
    FAULT = 76

    @property
    def retryable(self) -> bool:
        """True where a restart that resumes from the last checkpoint can succeed."""
        return self in (ExitCode.PREEMPTED, ExitCode.FAULT)


# Words of torch.distributed's and the OS's messages when a peer rank died, hung or a link broke.
_FAULT_WORDS = ("connection closed by peer", "connection reset", "timed out", "timeout", "nccl", "gloo",
                "broken pipe", "socket", "process group", "watchdog")


# Lightning's cluster environments (torchrun's, SLURM's) refuse trainer.devices x trainer.num_nodes
# that is not the launcher's layout with a ValueError saying so (``validate_settings``).
_LAUNCHER_REFUSAL = ("you set `", "in lightning, but", "does not match")


def exit_code_for(error: BaseException) -> ExitCode | None:
    """The kind of ending ``error`` stands for; ``None`` for none of them (a bug: exit 1, its traceback kept).

    Examples:
        >>> exit_code_for(OSError(errno.ENOSPC, "No space left on device"))
        <ExitCode.FAULT: 76>
        >>> exit_code_for(KeyError("x")) is None
        True
    """
    from lightning_fastscale.config_check import ConfigError
    from lightning_fastscale.data.stored_format import CorruptDataError
    from lightning_fastscale.faults.checkpoint_reading import CheckpointError
    from lightning_fastscale.faults.non_finite_guard import NonFiniteStepsError

    text = str(error).lower()
    if isinstance(error, ConfigError) or (isinstance(error, ValueError) and all(w in text for w in _LAUNCHER_REFUSAL)):
        return ExitCode.BAD_SETTING
    if isinstance(error, (CorruptDataError, CheckpointError)):
        return ExitCode.BAD_DATA
    if isinstance(error, NonFiniteStepsError):
        return ExitCode.DIVERGED
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
        return ExitCode.FAULT
    if isinstance(error, (RuntimeError, OSError, TimeoutError)) and any(w in text for w in _FAULT_WORDS):
        return ExitCode.FAULT
    return None


def launcher_reports_for(trainer: pl.Trainer) -> bool:
    """Whether this process is a rank that Lightning's own launcher started (``trainer.devices=N``
    without torchrun or SLURM), so that its local rank 0 reports the run's exit status.

    That launcher SIGKILLs every rank, itself included, as soon as a rank it started exits
    non-zero (its child-process observer), so such a rank leaving first with 75 or 4 would turn
    rank 0's status into -9 while it still shuts down. Lightning does not mark the processes it
    started: a rank with ``LOCAL_RANK`` > 0 that a user's own launcher started under Lightning's
    default environment counts too (it exits 0, its local rank 0 reports).
    """
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_fastscale.lightning_internals import cluster_environment

    return trainer.local_rank > 0 and isinstance(cluster_environment(trainer), LightningEnvironment)


def end_agreed(trainer: pl.Trainer, error: BaseException) -> NoReturn:
    """Raise ``error``, an ending every rank agreed on through a collective (a preemption, a
    divergence); on a rank that `launcher_reports_for`, ``SystemExit(0)`` instead, so the process
    leaves with 0 and its local rank 0 reports the status. Only for agreed endings: a crash on one
    rank keeps its non-zero status, and Lightning's launcher then stops the others as it should.
    """
    if launcher_reports_for(trainer):
        raise SystemExit(0) from error
    raise error
