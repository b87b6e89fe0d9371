"""Fault tolerance: a run that is killed, preempted or fed a bad checkpoint ends cleanly and resumes.

One module per job; the callbacks are also exported from `lightning_fastscale.callbacks`. Guide: ``docs/faults.md``.
"""
from lightning_fastscale.faults.atomic_checkpoint_io import AtomicCheckpointIO
from lightning_fastscale.faults.checkpoint_check import CheckpointCheck
from lightning_fastscale.faults.checkpoint_reading import CheckpointError
from lightning_fastscale.faults.exact_resume import ExactResume, WorldSizeChangeError
from lightning_fastscale.faults.non_finite_guard import NonFiniteGuard, NonFiniteStepsError
from lightning_fastscale.faults.preemption import PreemptionCheckpoint
from lightning_fastscale.faults.run_folder_lock import ClaimRunFolder, RunFolderInUseError

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointCheck",
    "CheckpointError",
    "ClaimRunFolder",
    "ExactResume",
    "NonFiniteGuard",
    "NonFiniteStepsError",
    "PreemptionCheckpoint",
    "RunFolderInUseError",
    "WorldSizeChangeError",
]
