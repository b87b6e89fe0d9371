"""Starting loader workers from a fork server against forking the training process.

On photo-like JPEGs (``input_common.write_tree``, converted at max side 256 under ``--workdir``),
``StreamingDataModule``'s training loader with ``--workers`` workers is iterated for ``--epochs`` epochs in a fresh process per round and
start method (a one-rank gloo group is set up first, as in training). Per method it gives the
wait for the first epoch's first batch (for ``forkserver`` this includes starting the server,
once per training process) and for a later epoch's first batch (workers restart every
epoch): medians over ``--rounds`` rounds, the methods interleaved.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("fork", "forkserver")


def measure(root: str, method: str, workers: int, epochs: int, batch_size: int, resolution: int) -> dict[str, float]:
    """Seconds to the first epoch's first batch and (median) to a later epoch's, in this process."""
    import torch.distributed as dist

    from lightning_fastscale.data import StreamingDataModule

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    dm = StreamingDataModule(root, resolution=resolution, batch_size=batch_size, num_workers=workers,
                             decode_threads=1, device_prefetch=False, multiprocessing_context=method)
    firsts = []
    for _ in range(epochs):
        start = time.perf_counter()
        batches = iter(dm.train_dataloader())
        next(batches)
        firsts.append(time.perf_counter() - start)
        for _ in batches:
            pass
    dist.destroy_process_group()
    return {"first_epoch": firsts[0], "later_epochs": statistics.median(firsts[1:])}


def main() -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--images", type=int, default=384, help="training images generated (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--measure", choices=METHODS, help=argparse.SUPPRESS)  # one process's part
    args = parser.parse_args()
    root = args.workdir / "stream256"
    if args.measure:
        print(json.dumps(measure(str(root), args.measure, args.workers, args.epochs, args.batch_size, args.resolution)))
        return {}
    if not root.exists():
        from input_common import write_tree

        from lightning_fastscale.data.convert import convert

        write_tree(args.workdir / "tree", classes=4, train_per_class=args.images // 4, val_per_class=1)
        convert(args.workdir / "tree", root, max_side=256, quality=90, num_workers=1)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--measure", method, "--results", ""],
                check=True, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
            ).stdout
            runs[method].append(json.loads(out.strip().splitlines()[-1]))
    medians = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    spread = {m: {k: (min(r[k] for r in rs), max(r[k] for r in rs)) for k in rs[0]} for m, rs in runs.items()}
    print(f"{args.workers} workers, batch {args.batch_size} at {args.resolution} px, {args.epochs} epochs, "
          f"median (min-max) of {args.rounds} rounds, seconds\n")
    print("| start method | first epoch's first batch | a later epoch's first batch |")
    print("|---|---:|---:|")
    for m in METHODS:
        cells = [f"{medians[m][k]:.2f} ({spread[m][k][0]:.2f}-{spread[m][k][1]:.2f})" for k in medians[m]]
        print(f"| {m} | " + " | ".join(cells) + " |")
    return medians


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import results_file

    results_file.run(main, "worker_start")
