"""Cost of the StepBreakdown callback: the same short fit with and without it, interleaved.

Each repeat runs one fit without the callback and one with it (the order alternates), and
times the optimizer steps after the first ``--skip`` with an independent callback (the time
between training batch ends). Reported: median step time of each arm and their ratio
(with / without); the target is at most 1.02.

    python benchmarks/step_breakdown_overhead.py --repeats 5 --steps 40
"""
from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch

from lightning_fastscale.data import ProceduralDataModule
from lightning_fastscale.diagnostics import StepBreakdown
from lightning_fastscale.module import ImageClassifier


class _StepClock(pl.Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.t.append(time.perf_counter())


def fit_once(with_breakdown: bool, steps: int, every: int, model_name: str, batch: int, resolution: int) -> list[float]:
    torch.manual_seed(0)
    clock = _StepClock()
    callbacks: list[pl.Callback] = [clock]
    if with_breakdown:
        callbacks.insert(0, StepBreakdown(every_n_steps=every, print_table=False, plot=False, dirpath=None))
    data = ProceduralDataModule(batch_size=batch, resolution=resolution, train_size=batch * steps, val_size=batch)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         limit_val_batches=0, default_root_dir="/tmp/step_breakdown_overhead")
    trainer.fit(ImageClassifier(model_name, num_classes=10), datamodule=data)
    return [b - a for a, b in zip(clock.t, clock.t[1:])]


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    for r in range(args.repeats):
        medians = {}
        for arm in ((False, True) if r % 2 == 0 else (True, False)):
            steps = fit_once(arm, args.steps, args.every, args.model, args.batch, args.resolution)[args.skip:]
            medians[arm] = statistics.median(steps)
            times[arm] += steps
        ratios.append(medians[True] / medians[False])
        print(f"repeat {r}: without {1e3 * medians[False]:.2f} ms, with {1e3 * medians[True]:.2f} ms, "
              f"ratio {ratios[-1]:.4f}", flush=True)
    print("\n| arm | median ms/step |\n|---|---:|")
    print(f"| without StepBreakdown | {1e3 * statistics.median(times[False]):.2f} |")
    print(f"| with StepBreakdown (every {args.every} steps) | {1e3 * statistics.median(times[True]):.2f} |")
    print(f"\nratio with/without: median of repeats {statistics.median(ratios):.4f} "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f}), {args.repeats} repeats x {args.steps - args.skip} steps")


if __name__ == "__main__":
    main()
