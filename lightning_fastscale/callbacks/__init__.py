"""Large-batch recipe callbacks, one technique per module (see each module for its paper)."""
from lightning_fastscale.callbacks.batch_size_ramp import BatchSizeRamp
from lightning_fastscale.callbacks.checkpoint_check import CheckpointCheck
from lightning_fastscale.callbacks.exact_resume import ExactResume
from lightning_fastscale.callbacks.ghost_batch_norm import (
    GhostBatchNorm,
    GhostBatchNormLayer,
    apply_ghost_batch_norm,
    ghost_batch_norm,
)
from lightning_fastscale.callbacks.label_smoothing import LabelSmoothing, smooth_targets, smoothing_at_epoch
from lightning_fastscale.callbacks.lr_schedule import WarmupDecayLR
from lightning_fastscale.callbacks.non_finite_guard import NonFiniteGuard, NonFiniteStepsError
from lightning_fastscale.callbacks.preemption import PreemptionCheckpoint
from lightning_fastscale.callbacks.progressive_resizing import ProgressiveResizing
from lightning_fastscale.callbacks.zero_init_residual_bn import ZeroInitResidualBN, zero_init_residual_bn
from lightning_fastscale.diagnostics.step_breakdown_callback import StepBreakdown
from lightning_fastscale.diagnostics.time_to_accuracy import TimeToAccuracy

__all__ = [
    "BatchSizeRamp",
    "CheckpointCheck",
    "ExactResume",
    "GhostBatchNorm",
    "GhostBatchNormLayer",
    "LabelSmoothing",
    "PreemptionCheckpoint",
    "NonFiniteGuard",
    "NonFiniteStepsError",
    "ProgressiveResizing",
    "StepBreakdown",
    "TimeToAccuracy",
    "WarmupDecayLR",
    "ZeroInitResidualBN",
    "apply_ghost_batch_norm",
    "ghost_batch_norm",
    "smooth_targets",
    "smoothing_at_epoch",
    "zero_init_residual_bn",
]
