"""Validation batches (``ValidationBatches``, resize 256 / crop 224 geometry), 1 decode thread and one per core.

Over the stored training images ``input_vs_ffcv.py`` wrote (same ``--workdir``, ``--repeat`` and
``--max-sides``), no loader worker, medians of ``--epoch-rounds`` interleaved rounds.

Example::

    python benchmarks/input_validation.py --workdir /tmp/ipb-ffcv --max-sides 320 256 --repeat 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import input_common
import torch
from input_common import stored_sides, written_stream

from lightning_fastscale.data.stored_format import read_metadata


def validation_table(args: argparse.Namespace) -> None:
    """Validation batches (`ValidationBatches`, square: resize 256 / crop 224 geometry) over the
    3,200 stored training images of ``--versus-ffcv``'s data, 1 decode thread and one per core,
    no loader worker: images/s, medians of ``--epoch-rounds`` interleaved rounds."""
    from torch.utils.data import DataLoader

    from lightning_fastscale.data import validation_plan
    from lightning_fastscale.data.streaming_datasets import ValidationBatches

    cores = os.cpu_count() or 1
    print(f"\n| validation, {args.resolution} px, batch {args.batch_size}, no worker | stored max side | 1 thread | "
          f"{cores} threads | ratio |\n|---|---|---:|---:|---:|")
    for side in stored_sides(args):
        root = written_stream(args, side)
        split, count = str(root / "train"), read_metadata(root).split_size("train")
        batches = validation_plan.square_rank_batches(count, args.batch_size, args.resolution, 0, 1, split)
        rates: dict[int, list[float]] = {1: [], cores: []}
        for _ in range(args.epoch_rounds):
            for threads in rates:
                torch.set_num_threads(1)
                loader = DataLoader(ValidationBatches(split, batches, split, crop_ratio=0.875, threads=threads),
                                    batch_size=None)
                start = time.perf_counter()
                seen = sum(images.shape[0] for images, _ in loader)
                rates[threads].append(seen / (time.perf_counter() - start))
        ratio = statistics.median(b / a for a, b in zip(rates[1], rates[cores]))
        print(f"| `ValidationBatches` | {'source' if side == 640 else side} | {statistics.median(rates[1]):,.0f} | "
              f"{statistics.median(rates[cores]):,.0f} | {ratio:.2f} |")


def run(args: argparse.Namespace) -> None:
    input_common.prepare(args)
    validation_table(args)


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_validation", max_sides=(320, 256), epochs=True)
    input_common.main(run, parser.parse_args())
