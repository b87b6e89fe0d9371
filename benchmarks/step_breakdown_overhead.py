"""Cost of the StepBreakdown callback: the same short fit with and without it, interleaved.

Each repeat runs one fit without the callback and one with it (the order alternates), and
times the optimizer steps after the first ``--skip`` with an independent callback (the time
between training batch ends): wall time, and the process's CPU time, which other jobs on a
shared machine disturb far less (one torch thread, so CPU time is the step's work). Reported:
median step time of each arm and their ratio (with / without); the target is at most 1.02.
On a loaded machine the run-to-run noise can exceed 2 %, so the with-arm also times the
callback's own work directly (its step hooks, including the all-gather windows, and every
gradient hook call) and reports it as a share of the step: an overhead bound that does not
depend on comparing two noisy runs.

Each fit runs in a fresh process (``--same-process`` to run them all in this one: the arms then
share a heap that grows fit after fit, which in one measurement made the later repeats drift).

    python benchmarks/step_breakdown_overhead.py --repeats 8 --steps 40 --batch 32 --resolution 24
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import lightning.pytorch as pl
import torch

from lightning_fastscale.data import ProceduralDataModule
from lightning_fastscale.diagnostics import StepBreakdown
from lightning_fastscale.module import ImageClassifier


class _StepClock(pl.Callback):
    def __init__(self) -> None:
        self.t: list[tuple[float, float]] = []

    def on_train_batch_end(self, *args) -> None:
        self.t.append((time.perf_counter(), time.process_time()))


class _SelfTime:
    """Seconds spent inside the callback's step hooks and its gradient hooks: wall and this thread's CPU.

    The CPU time (``time.thread_time``) is what the hooks cost; their wall time on a loaded
    machine also holds the time other jobs ran while a hook was on the CPU.
    """

    HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_train_batch_end")

    def __init__(self, breakdown: StepBreakdown) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        for name in self.HOOKS:
            setattr(breakdown, name, self._timed(getattr(breakdown, name)))
        on_train_start = breakdown.on_train_start

        def start_then_time_grad_hooks(trainer, module) -> None:
            on_train_start(trainer, module)
            timer = breakdown.timer
            factory = timer._grad_hook
            timer._grad_hook = lambda index: self._timed(factory(index))
            timer.attach(module.parameters())

        breakdown.on_train_start = start_then_time_grad_hooks

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.cpu_seconds += time.thread_time() - c
        return timed


def fit_once(with_breakdown: bool, steps: int, every: int, model_name: str, batch: int,
             resolution: int) -> tuple[list[tuple[float, float]], tuple[float, float] | None]:
    """(wall, CPU) seconds of each step after the first of one fit, and the callback's own seconds."""
    torch.manual_seed(0)
    clock = _StepClock()
    callbacks: list[pl.Callback] = [clock]
    self_time = None
    if with_breakdown:
        breakdown = StepBreakdown(every_n_steps=every, print_table=False, plot=False, dirpath=None)
        self_time = _SelfTime(breakdown)
        callbacks.insert(0, breakdown)
    data = ProceduralDataModule(batch_size=batch, resolution=resolution, train_size=batch * steps, val_size=batch)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         limit_val_batches=0, default_root_dir="/tmp/step_breakdown_overhead")
    trainer.fit(ImageClassifier(model_name, num_classes=10), datamodule=data)
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(clock.t, clock.t[1:])]
    return steps, ((self_time.seconds, self_time.cpu_seconds) if self_time is not None else None)


def fit_in_fresh_process(arm: bool, args: argparse.Namespace) -> tuple[list[tuple[float, float]], tuple[float, float] | None]:
    """`fit_once` in a new Python process: no arm inherits the other's heap, caches or leftover objects."""
    cmd = [sys.executable, __file__, "--one-fit", "with" if arm else "without", "--steps", str(args.steps),
           "--every", str(args.every), "--model", args.model, "--batch", str(args.batch),
           "--resolution", str(args.resolution), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    steps, own = json.loads(out.strip().splitlines()[-1])
    return [tuple(s) for s in steps], (tuple(own) if own is not None else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    parser.add_argument("--every", type=int, default=10, help="StepBreakdown every_n_steps")
    parser.add_argument("--model", default="resnet_small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--same-process", action="store_true",
                        help="run every fit in this process (the arms then share one heap; the default is a fresh "
                             "process per fit)")
    parser.add_argument("--one-fit", choices=("with", "without"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one_fit:
        print(json.dumps(fit_once(args.one_fit == "with", args.steps, args.every, args.model, args.batch,
                                  args.resolution)))
        return
    times: dict[tuple[bool, int], list[float]] = {(arm, k): [] for arm in (False, True) for k in (0, 1)}
    ratios: dict[int, list[float]] = {0: [], 1: []}
    self_shares: dict[int, list[float]] = {0: [], 1: []}
    for r in range(args.repeats):
        medians = {}
        for arm in ((False, True) if r % 2 == 0 else (True, False)):
            all_steps, own = (fit_once(arm, args.steps, args.every, args.model, args.batch, args.resolution)
                              if args.same_process else fit_in_fresh_process(arm, args))
            if own is not None:  # the callback's own time over the whole fit, against the fit's steps
                for k in (0, 1):
                    self_shares[k].append(own[k] / sum(s[k] for s in all_steps))
            steps = all_steps[args.skip:]
            for k in (0, 1):
                medians[arm, k] = statistics.median(s[k] for s in steps)
                times[arm, k] += [s[k] for s in steps]
        for k in (0, 1):
            ratios[k].append(medians[True, k] / medians[False, k])
        print(f"repeat {r}: wall without {1e3 * medians[False, 0]:.2f} ms, with {1e3 * medians[True, 0]:.2f} ms "
              f"(ratio {ratios[0][-1]:.4f}); CPU ratio {ratios[1][-1]:.4f}", flush=True)
    print("\n| arm | median wall ms/step | median CPU ms/step |\n|---|---:|---:|")
    for arm, name in ((False, "without StepBreakdown"), (True, f"with StepBreakdown (every {args.every} steps)")):
        print(f"| {name} | {1e3 * statistics.median(times[arm, 0]):.2f} | {1e3 * statistics.median(times[arm, 1]):.2f} |")
    for k, what in ((0, "wall"), (1, "CPU")):
        print(f"ratio with/without, {what} time: median of repeats {statistics.median(ratios[k]):.4f} "
              f"(min {min(ratios[k]):.4f}, max {max(ratios[k]):.4f})")
    for k, what in ((0, "wall"), (1, "CPU")):
        print(f"callback's own {what} time (hooks, gradient hooks, gathers) as a share of the step's {what} time: "
              f"median {100 * statistics.median(self_shares[k]):.2f} % (max {100 * max(self_shares[k]):.2f} %)")
    print(f"{args.repeats} repeats x {args.steps - args.skip} steps, model {args.model}, batch {args.batch}, "
          f"{args.resolution} px, {args.threads} thread(s)")


if __name__ == "__main__":
    import results_file

    results_file.run(main, "step_breakdown_overhead")
