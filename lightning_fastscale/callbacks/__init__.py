"""The large-batch recipe callbacks, one technique per module (see each module for its paper).

The fault-tolerance callbacks live in `lightning_fastscale.faults` and the step breakdown in
`lightning_fastscale.diagnostics`; both are re-exported here, the import path the README teaches.
"""
from lightning_fastscale.callbacks.batch_size_ramp import BatchSizeRamp
from lightning_fastscale.callbacks.bn_span import BNSpan, SpanBatchNormLayer, apply_bn_span, bn_span_plan
from lightning_fastscale.callbacks.ghost_batch_norm import (
    GhostBatchNorm,
    GhostBatchNormLayer,
    apply_ghost_batch_norm,
    ghost_batch_norm,
)
from lightning_fastscale.callbacks.label_smoothing import LabelSmoothing, smooth_targets, smoothing_at_epoch
from lightning_fastscale.callbacks.lr_schedule import WarmupDecayLR
from lightning_fastscale.callbacks.progressive_resizing import ProgressiveResizing
from lightning_fastscale.callbacks.zero_init_residual_bn import ZeroInitResidualBN, zero_init_residual_bn
from lightning_fastscale.diagnostics.step_breakdown_callback import StepBreakdown
from lightning_fastscale.diagnostics.time_to_accuracy import TimeToAccuracy
from lightning_fastscale.faults import (
    CheckpointCheck,
    ExactResume,
    NonFiniteGuard,
    NonFiniteStepsError,
    PreemptionCheckpoint,
)

__all__ = [
    "BNSpan",
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
    "SpanBatchNormLayer",
    "StepBreakdown",
    "TimeToAccuracy",
    "WarmupDecayLR",
    "ZeroInitResidualBN",
    "apply_bn_span",
    "apply_ghost_batch_norm",
    "bn_span_plan",
    "ghost_batch_norm",
    "smooth_targets",
    "smoothing_at_epoch",
    "zero_init_residual_bn",
]
