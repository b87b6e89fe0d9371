"""``fastscale-data``: convert image data to the streaming format, and measure input pipelines.

Subcommands ``convert``, ``verify`` and ``bench``: ``docs/input_pipeline.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from .convert import DEFAULT_MAX_SIDE, DEFAULT_QUALITY, PROCEDURAL_SOURCE, convert
from .verify import verify


def make_datamodule(
    pipeline: str, root: str, resolution: int, batch_size: int, num_workers: int, decode_threads: int = 1
) -> Any:
    """The datamodule ``pipeline`` names ("streaming" or "imagefolder") at these settings."""
    if pipeline == "streaming":
        from .streaming import StreamingDataModule

        return StreamingDataModule(root, resolution=resolution, batch_size=batch_size, num_workers=num_workers,
                                   decode_threads=decode_threads)
    if pipeline == "imagefolder":
        from .datamodules import ImageFolderDataModule

        return ImageFolderDataModule(
            root, resolution=resolution, batch_size=batch_size, num_workers=num_workers, persistent_workers=False,
        )
    raise ValueError(f"--pipeline must be 'streaming' or 'imagefolder', got {pipeline!r}")


def bench_pipeline(
    pipeline: str, root: str, resolution: int = 224, batch_size: int = 64, num_workers: int = 0,
    batches: int = 20, warmup: int = 2, clock: str = "wall", normalize: bool = True, decode_threads: int = 1,
) -> float:
    """Training images/s of a pipeline, up to a normalised float batch in this process (uint8 with ``normalize=False``).

    ``clock="process"`` divides by CPU time (the per-core figure); the timed batches lie within one epoch.
    """
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 batch, got {warmup}")
    if clock not in ("wall", "process"):
        raise ValueError(f"clock must be 'wall' or 'process', got {clock!r}")
    timer = time.process_time if clock == "process" else time.perf_counter
    dm = make_datamodule(pipeline, root, resolution, batch_size, num_workers, decode_threads)
    after = dm.on_after_batch_transfer if normalize else None
    loader = dm.train_dataloader()
    if warmup + batches > len(loader):
        raise ValueError(
            f"--warmup {warmup} + --batches {batches} is more than one epoch of {root} "
            f"({len(loader)} batches of {batch_size}); the timing would include a loader restart. "
            f"Lower --batches or --batch-size, or measure on more images"
        )
    seen, start = 0, 0.0
    for done, batch in enumerate(loader, start=1):
        images, _ = after(batch, 0) if after is not None else batch
        if done == warmup:
            start = timer()
        elif done > warmup:
            seen += images.shape[0]
        if done == warmup + batches:
            break
    return seen / (timer() - start)


def _convert(args: argparse.Namespace) -> int:
    procedural = None
    if args.root == PROCEDURAL_SOURCE:
        procedural = {"num_classes": args.num_classes, "train_size": args.train_size,
                      "val_size": args.val_size, "resolution": args.resolution, "seed": args.seed}
    meta = convert(args.root, args.out, max_side=args.max_side, quality=args.quality,
                   num_workers=args.workers, procedural=procedural)
    print(f"wrote {meta.split_size('train')} train + {meta.split_size('val')} val images, "
          f"{len(meta.classes)} classes, max side {meta.max_side}, quality {meta.quality} to {args.out}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    checked, problems = verify(args.out)
    for problem in problems:
        print(f"bad: {problem}")
    chunks = len({p.chunk for p in problems})
    print(f"{args.out}: {checked} samples read and decoded, {len(problems)} problem(s) in {chunks} chunk file(s)"
          + (" (the samples of a chunk with a damaged size or header are not read)"
             if any(p.sample is None for p in problems) else ""))
    return 1 if problems else 0


def _bench(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rate = bench_pipeline(args.pipeline, args.root, args.resolution, args.batch_size, args.workers,
                          args.batches, args.warmup, args.clock, normalize=not args.uint8,
                          decode_threads=args.decode_threads)
    cores = max(1, args.workers) * args.decode_threads
    result = {"pipeline": args.pipeline, "root": args.root, "resolution": args.resolution,
              "workers": args.workers, "decode_threads": args.decode_threads,
              "images_per_s": round(rate, 1), "images_per_s_per_core": round(rate / cores, 1)}
    print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fastscale-data`` argument parser."""
    parser = argparse.ArgumentParser(prog="fastscale-data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="image tree (or 'procedural') -> streaming format")
    c.add_argument("root", help="ImageNet-layout folder with train/ and val/, or 'procedural'")
    c.add_argument("out", help="new output folder (refused if it exists)")
    c.add_argument("--max-side", type=int, default=DEFAULT_MAX_SIDE,
                   help="longer side of stored images in px (default: %(default)s)")
    c.add_argument("--quality", type=int, default=DEFAULT_QUALITY,
                   help="JPEG quality of stored images (default: %(default)s)")
    c.add_argument("--workers", type=int, default=None, help="parallel encoders (default: all cores)")
    g = c.add_argument_group("procedural source")
    g.add_argument("--num-classes", type=int, default=10, help="classes (default: %(default)s)")
    g.add_argument("--train-size", type=int, default=10000, help="training images (default: %(default)s)")
    g.add_argument("--val-size", type=int, default=2000, help="validation images (default: %(default)s)")
    g.add_argument("--resolution", type=int, default=64,
                   help="rendered side of procedural images (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="rendering seed (default: %(default)s)")
    c.set_defaults(func=_convert)

    v = sub.add_parser("verify", help="check every chunk and decode every sample of a converted folder")
    v.add_argument("out", help="folder written by `fastscale-data convert`")
    v.set_defaults(func=_verify)

    b = sub.add_parser("bench", help="images/s of a training input pipeline")
    b.add_argument("root", help="converted folder (streaming) or image tree (imagefolder)")
    b.add_argument("--pipeline", choices=("streaming", "imagefolder"), default="streaming")
    b.add_argument("--resolution", type=int, default=224)
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--workers", type=int, default=0, help="loader processes (0: in this process)")
    b.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    b.add_argument("--decode-threads", type=int, default=1,
                   help="threads decoding each streaming batch, per loader process (default: %(default)s)")
    b.add_argument("--batches", type=int, default=20)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="divide by wall time, or by this process's CPU time (per-core figure, --workers 0)")
    b.add_argument("--uint8", action="store_true",
                   help="stop at the uint8 batch (streaming): the CPU's share when normalising on a GPU")
    b.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``fastscale-data``."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileExistsError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"fastscale-data: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
