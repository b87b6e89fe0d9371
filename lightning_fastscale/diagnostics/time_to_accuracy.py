"""Time to accuracy: wall time from the start of fit to the end of the first validation at a target.

MLPerf Training's rule and the measure of the large-batch records (Goyal et al. 2017; Jia et al.
2018; Mikami et al. 2018; DAWNBench). Pure core: `AccuracyClock`, `summary_line`, `write_summary`,
`plot_curve`; adapters: `TimeToAccuracy` (Lightning callback) and `FabricTimeToAccuracy`. What is
counted and reported: ``docs/time_to_accuracy.md``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_fastscale.diagnostics.step_breakdown import free_stem
from lightning_fastscale.diagnostics.step_breakdown_callback import _all_gather, samples_in_batch

STEM = "time_to_accuracy"
MODES = ("max", "min")


def process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc/self/stat``), or ``None`` elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class CurvePoint:
    """One validation: seconds on the clock at its end, the metric, and the run's progress then."""

    seconds: float
    value: float
    epochs: float
    steps: int
    samples: float
    validation_seconds: float


class AccuracyClock:
    """The clock, the crossing rule and the summary of one run (no Lightning, no process group).

    `start`, `validation_started` / `validation_ended`, `count` each batch's samples, `record` each
    validation's metric (True at the crossing), `finish`. ``gather`` maps this rank's vector to
    ``(world, n)``; then every rank holds rank zero's clock and metric and the summed samples.

    Example:
        >>> now = [0.0]
        >>> c = AccuracyClock("val/top1", target=0.9, clock=lambda: now[0])
        >>> c.start(); now[0] = 50.0
        >>> c.record(0.5, epochs=1, steps=10), c.record(0.85, epochs=2, steps=20)
        (False, False)
        >>> now[0] = 100.0; c.record(0.95, epochs=3, steps=30)
        True
        >>> s = c.finish(epochs=3, steps=30); s["reached"], s["seconds"], s["epochs"]
        (True, 100.0, 3)
    """

    def __init__(self, metric: str = "val/top1", target: float | None = None, mode: str = "max",
                 price_per_device_hour: float | None = None, clock: Callable[[], float] = time.time) -> None:
        if mode not in MODES:
            raise ValueError(f"TimeToAccuracy(mode={mode!r}): use 'max' (higher is better) or 'min'")
        if price_per_device_hour is not None and price_per_device_hour < 0:
            raise ValueError(f"TimeToAccuracy(price_per_device_hour={price_per_device_hour}): must be 0 or more")
        self.metric, self.target, self.mode = metric, target, mode
        self.price_per_device_hour = price_per_device_hour
        self.clock = clock
        age = process_age()
        self.process_started_at = None if age is None else clock() - age
        self.world_size = 1
        self.started_at: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.carried = 0.0  # seconds counted in earlier runs of a resumed run
        self.downtime = 0.0
        self.validation_seconds = 0.0
        self.points: list[CurvePoint] = []
        self.crossing: CurvePoint | None = None
        self.end: CurvePoint | None = None
        self._validating_since: float | None = None
        self._samples = 0.0  # the sum over ranks at the last gather
        self._local_samples = 0.0  # this rank's since then
        self._startup: float | None = None

    def start(self, at: float | None = None) -> None:
        """Start a new measurement at ``at`` (default: now); `load_state_dict` may continue an earlier one."""
        self.started_at = self.clock() if at is None else at
        self._reset()

    def elapsed(self) -> float:
        """Seconds counted so far: this run's since `start` plus earlier runs' (resume)."""
        if self.started_at is None:
            return self.carried
        return self.carried + self.clock() - self.started_at

    def startup_seconds(self) -> float | None:
        """Process start to `start` (rank zero's once gathered), or ``None`` if unknown."""
        if self._startup is not None:
            return self._startup
        if self.started_at is None or self.process_started_at is None:
            return None
        return max(0.0, self.started_at - self.process_started_at)

    def validation_started(self) -> None:
        """A validation begins (its time is reported as ``validation_seconds``)."""
        self._validating_since = self.clock()

    def validation_ended(self) -> None:
        """The validation begun by `validation_started` ended."""
        if self._validating_since is not None:
            self.validation_seconds += self.clock() - self._validating_since
            self._validating_since = None

    def count(self, samples: float) -> None:
        """This rank trained on ``samples`` more samples."""
        self._local_samples += samples

    def reaches(self, value: float) -> bool:
        """Whether ``value`` is at the target, compared in float32 as Lightning logs it (a logged 0.9 is 0.89999998)."""
        if self.target is None or math.isnan(value):
            return False
        target = torch.tensor(self.target, dtype=torch.float32).item()
        return value >= target if self.mode == "max" else value <= target

    def _sync(self, value: float, gather: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[float, float]:
        startup = self.startup_seconds()
        row = torch.tensor([self.elapsed(), value, self._local_samples, self.validation_seconds,
                            float("nan") if startup is None else startup], dtype=torch.float64)
        rows = (gather(row) if gather is not None else row).reshape(-1, row.numel()).to("cpu", torch.float64)
        self.world_size = max(self.world_size, rows.shape[0])
        seconds, value, _, self.validation_seconds, startup = rows[0].tolist()
        self._startup = None if math.isnan(startup) else startup
        self._samples += rows[:, 2].sum().item()
        self._local_samples = 0.0
        return seconds, value

    def record(self, value: float | None, epochs: float, steps: int,
               gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
        """The metric at the end of a validation (collective with ``gather``); True at the crossing."""
        seconds, value = self._sync(float("nan") if value is None else float(value), gather)
        point = CurvePoint(seconds, value, epochs, steps, self._samples, self.validation_seconds)
        self.points.append(point)
        if self.crossing is None and self.reaches(value):
            self.crossing = point
            return True
        return False

    def finish(self, epochs: float, steps: int,
               gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, Any]:
        """The end of fit (collective with ``gather``): returns the `summary`."""
        seconds, _ = self._sync(float("nan"), gather)
        self.end = CurvePoint(seconds, float("nan"), epochs, steps, self._samples, self.validation_seconds)
        return self.summary()

    def best(self) -> CurvePoint | None:
        """The validation with the best value so far (the earliest among equals)."""
        sign = 1 if self.mode == "max" else -1
        scored = (p for p in self.points if not math.isnan(p.value))
        return max(scored, key=lambda p: (sign * p.value, -p.seconds), default=None)

    def summary(self) -> dict[str, Any]:
        """Plain data (JSON, keys in ``docs/time_to_accuracy.md``): at the crossing if ``reached``, else at the end."""
        last = self.points[-1] if self.points else None
        at = self.crossing or self.end or last or CurvePoint(self.elapsed(), float("nan"), 0, 0, self._samples, 0.0)
        device_hours = at.seconds * self.world_size / 3600
        best = self.best()
        startup = self.startup_seconds()
        return {
            "metric": self.metric, "target": self.target, "mode": self.mode, "reached": self.crossing is not None,
            "seconds": at.seconds, "epochs": at.epochs, "steps": at.steps, "samples": at.samples,
            "device_hours": device_hours,
            "cost": None if self.price_per_device_hour is None else device_hours * self.price_per_device_hour,
            "price_per_device_hour": self.price_per_device_hour, "world_size": self.world_size,
            "validation_seconds": at.validation_seconds, "startup_seconds": startup,
            "downtime_seconds": self.downtime, "run_seconds": (self.end or last or at).seconds,
            "validations": len(self.points),
            "best": None if best is None else best.value, "best_seconds": None if best is None else best.seconds,
            "curve": [[p.seconds, None if math.isnan(p.value) else p.value] for p in self.points],
        }

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint carries: the elapsed time, when it was saved, the curve, the samples."""
        return {
            "elapsed": self.elapsed(), "saved_at": self.clock(), "downtime": self.downtime,
            "validation_seconds": self.validation_seconds, "samples": self._samples,
            "local_samples": self._local_samples, "world_size": self.world_size,
            "points": [asdict(p) for p in self.points],
            "crossing": None if self.crossing is None else self.points.index(self.crossing),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a run from `state_dict`, after `start`: the time from its save to this start is downtime."""
        self.carried = float(state["elapsed"])
        self.downtime = float(state["downtime"])
        if self.started_at is not None:
            self.downtime += max(0.0, self.started_at - float(state["saved_at"]))
        self.validation_seconds = float(state["validation_seconds"])
        self._samples, self._local_samples = float(state["samples"]), float(state["local_samples"])
        self.world_size = int(state["world_size"])
        self.points = [CurvePoint(**p) for p in state["points"]]
        self.crossing = None if state["crossing"] is None else self.points[state["crossing"]]


def format_duration(seconds: float) -> str:
    """``17 min 58 s``, ``1 h 02 min 03 s``, ``12.3 s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h} h {m:02d} min {sec:02d} s" if h else f"{m} min {sec} s"


def _count(n: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= limit:
            return f"{n / limit:.1f}{suffix}"
    return f"{n:,.0f}"


def summary_line(summary: Mapping[str, Any]) -> str:
    """The console line: ``reached val/top1 >= 0.93 in 17 min 58 s: 31 epochs, 9,920 steps, ...``."""
    s = summary
    epochs = s["epochs"]
    epochs_text = f"{epochs:.0f}" if float(epochs).is_integer() else f"{epochs:.2f}"
    parts = [f"{epochs_text} epochs", f"{s['steps']:,} steps", f"{_count(s['samples'])} samples",
             f"{s['device_hours']:.3g} device-hours"]
    if s.get("cost") is not None:
        parts.append(f"${s['cost']:,.2f}")
    progress = ", ".join(parts)
    op = ">=" if s["mode"] == "max" else "<="
    if s["reached"]:
        return f"reached {s['metric']} {op} {s['target']:g} in {format_duration(s['seconds'])}: {progress}"
    best = "no value logged" if s["best"] is None else (
        f"best {s['best']:.4g} at {format_duration(s['best_seconds'])}")
    if s["target"] is None:
        return f"{s['metric']}: {best} (no target set); run {format_duration(s['seconds'])}: {progress}"
    return (f"did not reach {s['metric']} {op} {s['target']:g} in {format_duration(s['seconds'])}: {progress}; "
            f"{best}")


def counted_line(summary: Mapping[str, Any]) -> str:
    """What the time includes and what is reported beside it."""
    s = summary
    line = (f"counted from fit start, {format_duration(s['validation_seconds'])} of validation included; "
            f"not counted: start-up (process start to fit start) ")
    line += "unknown" if s["startup_seconds"] is None else format_duration(s["startup_seconds"])
    if s["downtime_seconds"]:
        line += f", downtime between resumed runs {format_duration(s['downtime_seconds'])}"
    return line


def write_summary(directory: str | Path, summary: Mapping[str, Any], plot: bool = True,
                  stem: str = STEM) -> dict[str, Path]:
    """Write ``<stem>.json`` (and, with ``plot``, ``<stem>.png``) into ``directory``, never over a file (``-1``, ...)."""
    directory = Path(directory)
    base = free_stem(directory, stem, ("json", "png"))
    paths = {"json": directory / f"{base}.json"}
    paths["json"].write_text(json.dumps(dict(summary), indent=2) + "\n")
    if plot and summary["curve"]:
        paths["png"] = plot_curve(summary, directory / f"{base}.png")
    return paths


def plot_curve(summary: Mapping[str, Any], path: str | Path) -> Path:
    """The metric against wall time (minutes), with the target and the crossing (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    points = [(t / 60, v) for t, v in summary["curve"] if v is not None]
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    try:
        if points:
            ax.plot(*zip(*points), marker="o", label=summary["metric"])
        if summary["target"] is not None:
            ax.axhline(summary["target"], color="grey", linestyle="--", label=f"target {summary['target']:g}")
        if summary["reached"]:
            ax.axvline(summary["seconds"] / 60, color="tab:red", linestyle=":",
                       label=f"reached at {format_duration(summary['seconds'])}")
        ax.set_xlabel("wall time since fit start (min)")
        ax.set_ylabel(summary["metric"])
        ax.set_title(summary_line(summary).split(":")[0], fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return Path(path)


class TimeToAccuracy(pl.Callback):
    """Time to accuracy of a fit: when the metric first reached the target, at what cost; optionally stop there.

    The clock starts in the ``setup`` hook of fit, or at `start` (``fastscale-train`` calls it just
    before ``trainer.fit``). Each validation's metric is rank zero's, so every rank decides alike;
    ``stop=True`` ends the fit at the crossing (MLPerf's rule). At the end rank zero prints
    `summary_line` and writes ``time_to_accuracy.json`` / ``.png`` into ``dirpath`` (default
    ``trainer.log_dir``), the W&B run summary and beside a ``CSVLogger``'s ``metrics.csv``.
    Arguments and what is counted: ``docs/time_to_accuracy.md``; besides: ``batch_size_fn`` (default
    Lightning's ``extract_batch_size``), ``plot`` / ``verbose`` (the PNG / the line), ``clock`` (tests).

    Example:
        >>> import lightning.pytorch as pl
        >>> tta = TimeToAccuracy(target=0.93, stop=True, price_per_device_hour=2.0)
        >>> trainer = pl.Trainer(callbacks=[tta])  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        reached val/top1 >= 0.93 in 17 min 58 s: 31 epochs, 9,920 steps, 2.9M samples, 2.4 device-hours, $4.80
        >>> tta.summary["seconds"]  # doctest: +SKIP
        1078.2
    """

    def __init__(self, metric: str = "val/top1", target: float | None = None, stop: bool = False,
                 price_per_device_hour: float | None = None, mode: str = "max", dirpath: str | Path | None = None,
                 batch_size_fn: Callable[[Any], int | None] | None = None, plot: bool = True, verbose: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        if stop and target is None:
            raise ValueError("TimeToAccuracy(stop=True, target=None): stopping needs a target; set target "
                             "(e.g. callbacks.time_to_accuracy.target=0.93) or stop=False")
        self.clock = AccuracyClock(metric, target, mode, price_per_device_hour, clock)
        self.stop = stop
        self.dirpath = dirpath
        self.batch_size_fn = batch_size_fn or samples_in_batch
        self.plot = plot
        self.verbose = verbose
        self.summary: dict[str, Any] | None = None
        self.paths: dict[str, Path] = {}
        self._dir: Path | None = None
        self._started_early = False
        self._epochs = 0.0
        self._warned_missing = False

    @property
    def metric(self) -> str:
        """The metric's name."""
        return self.clock.metric

    @property
    def target(self) -> float | None:
        """The value to reach."""
        return self.clock.target

    def start(self) -> None:
        """Start the clock now, before ``trainer.fit`` (else it starts in the ``setup`` hook of fit)."""
        self.clock.start()
        self._started_early = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        if not self._started_early:
            self.clock.start()
        self._started_early = False
        self.summary = None
        self.clock.world_size = trainer.world_size
        # trainer.log_dir broadcasts from rank zero: every rank asks, here, where all ranks are
        self._dir = Path(self.dirpath) if self.dirpath is not None else Path(trainer.log_dir or trainer.default_root_dir)

    def _gather(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: _all_gather(t, pl_module.device, trainer.strategy.all_gather)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epochs = float(trainer.current_epoch)  # restored by now, when resuming

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.clock.count(float(self.batch_size_fn(batch) or 0))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        per_epoch = trainer.num_training_batches
        done = 0.0 if not per_epoch or math.isinf(per_epoch) else min(1.0, (batch_idx + 1) / per_epoch)
        self._epochs = trainer.current_epoch + done  # a resumed epoch continues its batch numbering

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.clock.validation_started()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.clock.validation_ended()
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None and not self._warned_missing:
            self._warned_missing = True
            rank_zero_warn(f"TimeToAccuracy: metric {self.metric!r} was not logged in validation (logged: "
                           f"{sorted(trainer.callback_metrics) or 'nothing'}); set metric to one of them")
        crossed = self.clock.record(None if value is None else float(value), self._epochs,
                                    trainer.global_step, self._gather(trainer, pl_module))
        if crossed and self.stop:
            trainer.should_stop = True  # the same decision on every rank: rank zero's metric
            rank_zero_info(f"TimeToAccuracy: {self.metric} reached {self.target:g}; stopping the fit")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary = self.clock.finish(self._epochs, trainer.global_step, self._gather(trainer, pl_module))
        if not trainer.is_global_zero:
            return
        if self.verbose:
            rank_zero_info(summary_line(self.summary) + "\n" + counted_line(self.summary))
        assert self._dir is not None
        self.paths = write_summary(self._dir, self.summary, plot=self.plot)
        self._to_loggers(trainer)

    def _to_loggers(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.loggers import CSVLogger, WandbLogger

        assert self.summary is not None
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.summary.update({f"{STEM}/{k}": v for k, v in self.summary.items()})
            elif isinstance(logger, CSVLogger) and Path(logger.log_dir).resolve() != self.paths["json"].parent.resolve():
                write_summary(logger.log_dir, self.summary, plot=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.clock.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.clock.load_state_dict(state_dict)


class FabricTimeToAccuracy:
    """Time to accuracy in a Lightning Fabric loop; the clock starts at construction.

    `count` each batch's samples, validate inside `validating`, then `record` the metric
    (collective; True on every rank at the crossing); `finish` (collective) returns the summary,
    `save` writes it.

    Example:
        >>> tta = FabricTimeToAccuracy(fabric, "val/top1", target=0.93)  # doctest: +SKIP
        >>> for epoch in range(epochs):  # doctest: +SKIP
        ...     for step, (x, y) in enumerate(loader):
        ...         train_step(x, y); tta.count(len(x))
        ...     with tta.validating():
        ...         top1 = evaluate(model)
        ...     if tta.record(top1, epochs=epoch + 1, steps=(epoch + 1) * len(loader)):
        ...         break
        >>> summary = tta.finish(epochs=epoch + 1, steps=(epoch + 1) * len(loader)); tta.save("runs/this")  # doctest: +SKIP
    """

    def __init__(self, fabric: Any, metric: str = "val/top1", target: float | None = None,
                 price_per_device_hour: float | None = None, mode: str = "max",
                 clock: Callable[[], float] = time.time) -> None:
        self.fabric = fabric
        self.clock = AccuracyClock(metric, target, mode, price_per_device_hour, clock)
        self.clock.world_size = fabric.world_size
        self.clock.start()
        self.summary: dict[str, Any] | None = None

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return _all_gather(t, self.fabric.device, self.fabric.all_gather)

    def count(self, samples: float) -> None:
        """This rank trained on ``samples`` more samples."""
        self.clock.count(samples)

    @contextlib.contextmanager
    def validating(self) -> Iterator[None]:
        """Time the block as validation (reported as ``validation_seconds``)."""
        self.clock.validation_started()
        try:
            yield
        finally:
            self.clock.validation_ended()

    def record(self, value: float | torch.Tensor, epochs: float, steps: int) -> bool:
        """Collective: the validation's metric; True on every rank at the first value at the target."""
        return self.clock.record(float(value), epochs, steps, self._gather)

    def finish(self, epochs: float, steps: int, verbose: bool = True) -> dict[str, Any]:
        """Collective: the end of the run; returns the summary (and prints its line on rank zero)."""
        self.summary = self.clock.finish(epochs, steps, self._gather)
        if verbose and self.fabric.is_global_zero:
            print(summary_line(self.summary))
        return self.summary

    def save(self, dirpath: str | Path, plot: bool = True) -> dict[str, Path]:
        """On rank zero write ``time_to_accuracy.json`` / ``.png`` (after `finish`)."""
        if self.summary is None:
            raise RuntimeError("FabricTimeToAccuracy.save(): call finish() first (on every rank)")
        if not self.fabric.is_global_zero:
            return {}
        return write_summary(dirpath, self.summary, plot=plot)
