"""Diagnostics of a training run: where the time of a step goes and what bounds it."""
from lightning_fastscale.diagnostics.step_breakdown import (
    PHASES,
    VERDICTS,
    BreakdownSummary,
    RankTotals,
    breakdown_report,
    breakdown_table,
    plot_breakdown,
    summarize,
    summarize_steps,
    write_report,
)
from lightning_fastscale.diagnostics.step_breakdown_callback import (
    FabricStepBreakdown,
    InputTimingProfiler,
    StepBreakdown,
)
from lightning_fastscale.diagnostics.step_timer import MARKS, StepTimer, StepTimes

__all__ = [
    "MARKS",
    "PHASES",
    "VERDICTS",
    "BreakdownSummary",
    "FabricStepBreakdown",
    "InputTimingProfiler",
    "RankTotals",
    "StepBreakdown",
    "StepTimer",
    "StepTimes",
    "breakdown_report",
    "breakdown_table",
    "plot_breakdown",
    "summarize",
    "summarize_steps",
    "write_report",
]
