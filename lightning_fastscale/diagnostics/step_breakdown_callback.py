"""``StepBreakdown`` (Lightning callback) and ``FabricStepBreakdown``: thin adapters over
[`StepTimer`][lightning_fastscale.diagnostics.step_timer.StepTimer] (the marks) and
[`summarize`][lightning_fastscale.diagnostics.step_breakdown.summarize] (the verdict): every N steps
the ranks all-gather their window sums, rank zero logs them and at the end writes the report.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import PassThroughProfiler, Profiler
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_fastscale.diagnostics.step_breakdown import (
    PHASES,
    BreakdownSummary,
    RankTotals,
    breakdown_table,
    summarize,
    write_report,
)
from lightning_fastscale.diagnostics.step_timer import StepTimer, StepTimes


def images_in_batch(batch: Any) -> int | None:
    """Images in a batch: the leading size of the first 4-D (N, C, H, W) tensor in it, or ``None``."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() == 4 else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return next((n for item in batch if (n := images_in_batch(item)) is not None), None)
    return None


def samples_in_batch(batch: Any) -> int | None:
    """Samples in a batch (Lightning's ``extract_batch_size``), or ``None`` if it cannot tell."""
    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - any batch Lightning cannot size just has no sample count
        return None


class _Windows:
    """One rank's sums over the window and over the run after the warm-up, gathered across ranks on `flush`."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.seen = 0
        self.window, self.run = RankTotals.empty(), RankTotals.empty()
        self.windows: list[BreakdownSummary] = []
        self.totals: list[RankTotals] | None = None  # per rank, summed over flushes

    def flush(self, steps: list[StepTimes], device: torch.device,
              fallback: Callable[[torch.Tensor], torch.Tensor]) -> BreakdownSummary | None:
        """Collective: add ``steps``, gather the window, append its summary, fold it into the run totals."""
        for s in steps:
            self.seen += 1
            for totals in (self.window, self.run) if self.seen > self.warmup_steps else (self.window,):
                totals.add(s.seconds, s.samples, s.images, s.step)
        gathered = _all_gather(torch.tensor([self.window.to_row(), self.run.to_row()], dtype=torch.float64), device,
                               fallback)
        if gathered.dim() == 2:  # one process: the strategy returns the tensor unchanged
            gathered = gathered.unsqueeze(0)
        rows = gathered.to("cpu", torch.float64).tolist()
        self.window, self.run = RankTotals.empty(), RankTotals.empty()
        window = [RankTotals.from_row(rank, r[0]) for rank, r in enumerate(rows)]
        run = [RankTotals.from_row(rank, r[1]) for rank, r in enumerate(rows)]
        if self.totals is None:
            self.totals = run
        else:
            for totals, more in zip(self.totals, run):
                totals.merge(more)
        if min(r.steps for r in window) < 1:
            return None
        summary = summarize(window, *_span(window))
        self.windows.append(summary)
        return summary

    def total(self) -> BreakdownSummary | None:
        """The whole run after the warm-up steps (all steps if the run had no more)."""
        if self.totals is not None and min(r.steps for r in self.totals) >= 1:
            return summarize(self.totals, *_span(self.totals))
        if not self.windows:
            return None
        # a run no longer than its warm-up: sum the windows instead
        ranks = [RankTotals(r["rank"], 0, dict.fromkeys(PHASES, 0.0), 0.0, 0.0) for r in self.windows[0].per_rank]
        for w in self.windows:
            for r, pr in zip(ranks, w.per_rank):
                r.steps += pr["steps"]
                for p in PHASES:
                    r.seconds[p] += pr["phases"][p] * pr["steps"]
        return summarize(ranks, self.windows[0].first_step, self.windows[-1].last_step)


def _span(ranks: list[RankTotals]) -> tuple[int | None, int | None]:
    firsts = [r.first_step for r in ranks if r.first_step is not None]
    lasts = [r.last_step for r in ranks if r.last_step is not None]
    return (min(firsts), max(lasts)) if firsts and lasts else (None, None)


def _all_gather(t: torch.Tensor, device: torch.device, fallback: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``(world, *t.shape)`` from every rank, on ``device`` for NCCL; ``fallback`` without a process group.

    A plain ``all_gather``: the strategies' own adds autograd.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return fallback(t.to(device))
    t = t.to(device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out)


def _metrics(summary: BreakdownSummary, prefix: str) -> dict[str, float]:
    metrics = {"step_s": summary.step_s, "straggler_share": summary.straggler_share,
               "slowest_rank": float(summary.slowest_rank), **{f"{p}_s": summary.phases[p] for p in PHASES},
               "samples_per_s": summary.samples_per_s, "images_per_s": summary.images_per_s}
    return {prefix + k: v for k, v in metrics.items() if v is not None}


class InputTimingProfiler(Profiler):
    """A Lightning profiler that times the training loop's batch fetch and transfer, around another profiler.

    Every action goes on to ``inner`` (default ``PassThroughProfiler``); the seconds of each
    fetch and transfer go to ``on_input``, which `StepBreakdown` sets.

    Example:
        >>> seen = []
        >>> profiler = InputTimingProfiler()
        >>> profiler.on_input = seen.append
        >>> with profiler.profile("[_TrainingEpochLoop].train_dataloader_next"):
        ...     pass
        >>> len(seen)
        1
    """

    INPUT_ACTIONS = ("train_dataloader_next", ".batch_to_device", ".on_before_batch_transfer",
                     ".on_after_batch_transfer")

    def __init__(self, inner: Profiler | None = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else PassThroughProfiler()
        self.on_input: Callable[[float], None] | None = None
        self._started: dict[str, float] = {}

    @override
    def start(self, action_name: str) -> None:
        if self.on_input is not None and action_name.endswith(self.INPUT_ACTIONS):
            self._started[action_name] = time.perf_counter()
        self.inner.start(action_name)

    @override
    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        started = self._started.pop(action_name, None)
        if started is not None and self.on_input is not None:
            self.on_input(time.perf_counter() - started)

    @override
    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank, log_dir)

    @override
    def summary(self) -> str:
        return self.inner.summary()

    @override
    def describe(self) -> None:
        self.inner.describe()

    @override
    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)


class StepBreakdown(pl.Callback):
    """Per optimizer step and rank: input, compute, exposed communication, optimizer and the rest.

    Every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``) rank
    zero logs ``breakdown/*`` (medians over ranks) to every logger; at the end of fit it prints
    the table and writes ``step_breakdown.json`` / ``.md`` / ``.png`` into ``dirpath`` (default
    ``trainer.log_dir``). The first ``warmup_steps`` are left out of the final summary. Input is
    timed through an [`InputTimingProfiler`][lightning_fastscale.diagnostics.step_breakdown_callback.InputTimingProfiler]
    (the Trainer's own, or one around its profiler during fit). How: ``docs/step_breakdown.md``.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[StepBreakdown(every_n_steps=10)])  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> trainer.callbacks[0].summary.bottleneck  # doctest: +SKIP
        'input'
    """

    def __init__(self, every_n_steps: int | None = None, dirpath: str | Path | None = None,
                 batch_size_fn: Callable[[Any], int | None] | None = None,
                 images_fn: Callable[[Any], int | None] | None = None, warmup_steps: int = 1, plot: bool = True,
                 print_table: bool = True, log_prefix: str = "breakdown/") -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"StepBreakdown(every_n_steps={every_n_steps}): must be at least 1 (or None "
                             "for the Trainer's log_every_n_steps)")
        if warmup_steps < 0:
            raise ValueError(f"StepBreakdown(warmup_steps={warmup_steps}): must be 0 or more")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.batch_size_fn = batch_size_fn or samples_in_batch
        self.images_fn = images_fn or images_in_batch
        self.warmup_steps = warmup_steps
        self.plot = plot
        self.print_table = print_table
        self.log_prefix = log_prefix
        self.timer: StepTimer | None = None
        self.summary: BreakdownSummary | None = None
        self.windows: list[BreakdownSummary] = []
        self.paths: dict[str, Path] = {}
        self._agg: _Windows | None = None
        self._profiler: InputTimingProfiler | None = None
        self._replaced_profiler: Profiler | None = None
        self._stepped = False
        self._samples = 0.0
        self._images: float | None = None
        self._report_dir = Path(".")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            rank_zero_info("StepBreakdown: manual optimization; the step boundaries are the training batches")
        self.timer = StepTimer(pl_module.device)
        self.timer.attach(pl_module.parameters())
        self._agg = _Windows(self.warmup_steps)
        profiler = trainer.profiler
        if not isinstance(profiler, InputTimingProfiler):
            profiler = InputTimingProfiler(trainer.profiler)
            self._replaced_profiler = trainer.profiler
            trainer.profiler = profiler  # the loop reads trainer.profiler at every action
        profiler.on_input = self.timer.add_input
        self._profiler = profiler
        # on every rank: ``trainer.log_dir`` broadcasts, so rank zero alone at the end would hang
        self._report_dir = Path(self.dirpath if self.dirpath is not None else trainer.log_dir or trainer.default_root_dir)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is not None:
            self.timer.reset_origin()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is not None:  # set only during fit, after the sanity check
            self.timer.reset_origin()  # validation inside an epoch is not part of any step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.timer is None:
            return
        self.timer.mark("batch_start")
        self._samples += float(self.batch_size_fn(batch) or 0)
        images = self.images_fn(batch)
        if images is not None:
            self._images = (self._images or 0.0) + images

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.timer is not None:
            self.timer.mark("before_backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is not None:
            self.timer.mark("after_backward")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.timer is not None:
            self.timer.mark("before_optimizer")
            self._stepped = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.timer is None or self._agg is None:
            return
        self.timer.mark("end")
        stepped = self._stepped or not pl_module.automatic_optimization
        # numbered by the global step (0-based), so a resumed run continues the numbering
        self.timer.end_batch(self._samples, self._images, optimizer_stepped=stepped, step=trainer.global_step - 1)
        self._stepped, self._samples, self._images = False, 0.0, None
        if stepped and self.timer.steps % self._every(trainer) == 0:
            self._flush(trainer, pl_module)

    def _every(self, trainer: pl.Trainer) -> int:
        return self.every_n_steps or max(1, trainer.log_every_n_steps)

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> BreakdownSummary | None:
        assert self.timer is not None and self._agg is not None
        summary = self._agg.flush(self.timer.drain(block=True), pl_module.device, trainer.strategy.all_gather)
        self.windows = self._agg.windows
        if summary is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(_metrics(summary, self.log_prefix), step=trainer.global_step)
        return summary

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timer is None or self._agg is None:
            return
        self._flush(trainer, pl_module)  # collective: every rank reaches the end of fit
        self.summary = self._agg.total()
        self._close(trainer)
        if self.summary is None or not trainer.is_global_zero:
            return
        if self.print_table:
            rank_zero_info("Step breakdown (median over ranks, after the warm-up steps):\n"
                           + breakdown_table(self.summary))
        self.paths = write_report(self._report_dir, self.summary, self.windows, plot=self.plot,
                                  warmup_steps=self.warmup_steps, every_n_steps=self._every(trainer))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(trainer)

    def _close(self, trainer: pl.Trainer) -> None:
        if self.timer is not None:
            self.timer.detach()
        if self._profiler is not None:
            self._profiler.on_input = None
            self._profiler = None
        if self._replaced_profiler is not None:
            trainer.profiler = self._replaced_profiler
            self._replaced_profiler = None


class FabricStepBreakdown:
    """The step breakdown in a Lightning Fabric loop: mark the parts with `phase`, then `step_end`.

    `step_end` after each optimizer step (collective every ``every_n_steps``: the ranks gather
    and ``fabric.log_dict`` gets ``breakdown/*``); `finish` (collective) returns the summary,
    `save` writes the report.

    Example:
        >>> bd = FabricStepBreakdown(fabric, model, every_n_steps=20)  # doctest: +SKIP
        >>> for _ in range(steps):  # doctest: +SKIP
        ...     with bd.phase("input"):
        ...         x, y = fabric.to_device(next(batches))
        ...     with bd.phase("compute"):
        ...         fabric.backward(loss_fn(model(x), y))
        ...     with bd.phase("optimizer"):
        ...         optimizer.step(); optimizer.zero_grad()
        ...     bd.step_end(samples=len(x))
        >>> summary = bd.finish(); bd.save("runs/this")  # doctest: +SKIP
    """

    def __init__(self, fabric: Any, model: torch.nn.Module, every_n_steps: int = 50, warmup_steps: int = 1,
                 log: bool = True, log_prefix: str = "breakdown/") -> None:
        if every_n_steps < 1:
            raise ValueError(f"FabricStepBreakdown(every_n_steps={every_n_steps}): must be at least 1")
        self.fabric = fabric
        self.every_n_steps = every_n_steps
        self.log = log
        self.log_prefix = log_prefix
        self.warmup_steps = warmup_steps
        self.timer = StepTimer(fabric.device)
        self.timer.attach(model.parameters())
        self._agg = _Windows(warmup_steps)
        self.summary: BreakdownSummary | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``input``, ``compute`` or ``optimizer``."""
        if name == "input":
            t = time.perf_counter()
            try:
                yield
            finally:
                self.timer.add_input(time.perf_counter() - t)
        elif name == "compute":
            self.timer.mark("batch_start")
            yield
            self.timer.mark("after_backward")
        elif name == "optimizer":
            self.timer.mark("before_optimizer")
            yield
            self.timer.mark("end")
        else:
            raise ValueError(f"FabricStepBreakdown.phase({name!r}): expected 'input', 'compute' or 'optimizer'")

    def step_end(self, samples: float = 0.0, images: float | None = None) -> BreakdownSummary | None:
        """Close the optimizer step; every ``every_n_steps`` steps gather and log (collective)."""
        self.timer.end_batch(samples, images)
        if self.timer.steps % self.every_n_steps == 0:
            return self._flush()
        return None

    def _flush(self) -> BreakdownSummary | None:
        summary = self._agg.flush(self.timer.drain(block=True), self.fabric.device, self.fabric.all_gather)
        if summary is not None and self.log:
            self.fabric.log_dict(_metrics(summary, self.log_prefix), step=summary.last_step)
        return summary

    @property
    def windows(self) -> list[BreakdownSummary]:
        """The per-window summaries so far."""
        return self._agg.windows

    def finish(self) -> BreakdownSummary | None:
        """Collective: gather the last window, remove the hooks, return the run's summary."""
        self._flush()
        self.timer.detach()
        self.summary = self._agg.total()
        return self.summary

    def save(self, dirpath: str | Path, plot: bool = True) -> dict[str, Path]:
        """On rank zero write ``step_breakdown.json`` / ``.md`` / ``.png`` (after `finish`)."""
        if self.summary is None:
            raise RuntimeError("FabricStepBreakdown.save(): call finish() first (on every rank)")
        if not self.fabric.is_global_zero:
            return {}
        return write_report(dirpath, self.summary, self.windows, plot=plot, warmup_steps=self.warmup_steps,
                            every_n_steps=self.every_n_steps)
