"""Diagnostics of a training run: where the time of a step goes, what bounds it, and the time to accuracy."""
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
from lightning_fastscale.diagnostics.time_to_accuracy import (
    AccuracyClock,
    FabricTimeToAccuracy,
    TimeToAccuracy,
    summary_line,
    write_summary,
)

__all__ = ["MARKS", "PHASES", "VERDICTS", "AccuracyClock", "BreakdownSummary", "FabricStepBreakdown",
           "FabricTimeToAccuracy", "InputTimingProfiler", "RankTotals", "StepBreakdown", "StepTimer", "StepTimes",
           "TimeToAccuracy", "breakdown_report", "breakdown_table", "plot_breakdown", "summarize", "summarize_steps",
           "summary_line", "write_report", "write_summary"]
