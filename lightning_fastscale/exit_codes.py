"""How a ``fastscale-train`` run ends, as one exit status per kind, so a launcher knows whether to retry
(the table is in ``docs/hydra.md``).
"""
from __future__ import annotations

import enum
import errno

__all__ = ["ExitCode", "exit_code_for"]


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
