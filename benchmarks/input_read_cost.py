"""litdata's read cost per sample (no decode), its default window of samples per read against one sample per read.

Over the shuffled training split ``input_vs_ffcv.py`` wrote (same ``--workdir``, ``--repeat``
and ``--max-sides``); best of ``--epoch-rounds`` epochs after a warm-up one.

Example::

    python benchmarks/input_read_cost.py --workdir /tmp/ipb-ffcv --max-sides 320 256 --repeat 10
"""
from __future__ import annotations

import argparse
import math
import time

import input_common
from input_common import stored_sides, written_stream


def read_cost_table(args: argparse.Namespace) -> None:
    """Microseconds of CPU per sample to read ``--versus-ffcv``'s shuffled training split through
    litdata's loader (no decode), with litdata's default window of samples per read
    (``batch_decode="auto"``) and one sample per read (``batch_decode=0``, the datamodule's);
    best of ``--epoch-rounds`` epochs after a warm-up one."""
    from litdata import StreamingDataLoader, StreamingDataset

    print("\n| read only, shuffled, batch_decode | stored max side | auto (litdata default) | 0 (one sample per read) |"
          "\n|---|---|---:|---:|")
    for side in stored_sides(args):
        split = written_stream(args, side) / "train"
        cost = {}
        for batch_decode in ("auto", 0):
            dataset = StreamingDataset(str(split), shuffle=True, seed=0, drop_last=True, batch_decode=batch_decode)
            loader = StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=0, collate_fn=list)
            best = math.inf
            for _ in range(args.epoch_rounds + 1):
                start = time.process_time()
                seen = sum(len(samples) for samples in loader)
                best = min(best, (time.process_time() - start) / seen * 1e6)
            cost[batch_decode] = best
        print(f"| litdata `StreamingDataLoader` | {'source' if side == 640 else side} | {cost['auto']:.1f} | {cost[0]:.1f} |")


def run(args: argparse.Namespace) -> None:
    input_common.prepare(args)
    read_cost_table(args)


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_read_cost", max_sides=(320, 256), epochs=True)
    input_common.main(run, parser.parse_args())
