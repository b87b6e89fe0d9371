"""The end-to-end ``fastscale-train`` step, ``data=streaming`` against ``data=imagefolder`` at equal settings.

Both built by ``train.py``'s ``build`` from the Hydra config, timed in interleaved rounds
(median step after the first batches).

Example::

    python benchmarks/input_train_step.py --workdir /tmp/ipb5 --step-batches 10
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import input_common
import numpy as np


def train_step_check(tree: Path, stream_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Median ``fastscale-train`` step time, data=streaming vs data=imagefolder, interleaved rounds."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_module

    from lightning_fastscale.train import build

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *a: Any) -> None:
            self.starts.append(time.perf_counter())

    common = [
        f"data.resolution={args.step_resolution}", f"data.batch_size={args.step_batch_size}",
        f"data.num_workers={args.step_workers}", "trainer.max_epochs=1", f"+trainer.limit_train_batches={args.step_batches}",
        "+trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "callbacks=none", "logger=none", "trainer.accelerator=cpu", "trainer.devices=1", "+trainer.enable_checkpointing=false",
        f"trainer.default_root_dir={args.workdir / 'train_step'}",
    ]
    configs = {
        "imagefolder": ["data=imagefolder", f"data.root={tree}", "data.persistent_workers=false", *common],
        "streaming": ["data=streaming", f"data.root={stream_root}", *common],
    }
    times: dict[str, list[float]] = {k: [] for k in configs}
    with initialize_config_module("lightning_fastscale.conf", version_base="1.3"):
        for r in range(args.step_rounds):
            for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                cfg = compose("train", overrides=configs[name])
                pl.seed_everything(0)
                datamodule, module, trainer = build(cfg)
                timer = StepTimer()
                trainer.callbacks.append(timer)
                trainer.fit(module, datamodule=datamodule)
                steps = np.diff(timer.starts)[3:]  # after the first batches (worker start-up)
                times[name].append(float(np.median(steps)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_step_s": med, "rounds": times, "streaming_over_imagefolder_step_time": med["streaming"] / med["imagefolder"]}


def run(args: argparse.Namespace) -> None:
    tree, streams = input_common.prepare(args)
    res = train_step_check(tree, streams[args.max_sides[-1]], args)
    print(f"\ntrain step: {json.dumps(res)}")


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_train_step")
    parser.add_argument("--step-resolution", type=int, default=128)
    parser.add_argument("--step-batch-size", type=int, default=32)
    parser.add_argument("--step-batches", type=int, default=12)
    parser.add_argument("--step-workers", type=int, default=1)
    parser.add_argument("--step-rounds", type=int, default=2)
    input_common.main(run, parser.parse_args())
