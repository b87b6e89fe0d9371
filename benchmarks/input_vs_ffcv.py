"""Whole ImageNet-length epochs: ImageFolder, the streaming datamodule, ``train_batch`` and FFCV 1.0.2 (and DALI CPU).

Every training file of `input_common`'s tree is present ``--repeat`` times (hard links), so an
epoch is ImageNet-like in length and per-epoch set-up weighs what it weighs there. Each loader
runs one untimed warm-up epoch, then ``--epoch-rounds`` interleaved rounds of one epoch each, at
1 core (images per CPU-second) and all cores (wall clock). FFCV and DALI are skipped with a
message where they do not import. ``--epoch-rounds 0`` writes only the data, which
``input_validation.py`` and ``input_read_cost.py`` read.

Example::

    python benchmarks/input_vs_ffcv.py --workdir /tmp/ipb-ffcv --classes 8 --train-per-class 40 \
        --max-sides 320 256 --repeat 10 --epoch-rounds 3
"""
from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import input_common
import torch
from input_common import dali_images_per_s, repeated_tree, stored_sides, stored_train
from PIL import Image

from lightning_fastscale.data.convert import convert


def ffcv_importable() -> bool:
    """Whether FFCV imports; if not, say so in one line."""
    try:
        import ffcv.fields  # noqa: F401
        import ffcv.loader  # noqa: F401
    except Exception as err:  # ImportError, or its compiled extension failing to load
        print(f"FFCV skipped: ffcv not importable ({type(err).__name__}: {err}); install steps in benchmarks/README.md")
        return False
    return True

def ffcv_beton(stream_root: Path, path: Path) -> Path:
    """An FFCV 1.0.2 dataset of the same stored images (decoded, re-encoded by FFCV at quality
    90: the same pixel count)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    if path.is_file():
        return path

    class Stored(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.jpegs, self.labels = stored_train(stream_root)

        def __len__(self) -> int:
            return len(self.jpegs)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            return Image.open(io.BytesIO(self.jpegs[i].numpy().tobytes())).convert("RGB"), self.labels[i]

    tmp = path.with_suffix(".partial")
    writer = DatasetWriter(str(tmp), {"image": RGBImageField(write_mode="jpg", jpeg_quality=90),
                                      "label": IntField()}, num_workers=os.cpu_count() or 1)
    writer.from_indexed_dataset(Stored())
    tmp.rename(path)
    return path

def _warmed(run_epoch: Any, clock: str) -> Any:
    """Run one untimed warm-up epoch; return a function that times one more epoch (images/s).

    ``run_epoch()`` runs an epoch and returns the number of images it delivered.
    ``clock="process"``: per CPU-second of this process (all its threads), the per-core figure;
    ``"wall"``: what a training loop waits on."""
    timer = time.process_time if clock == "process" else time.perf_counter
    run_epoch()

    def timed() -> float:
        start = timer()
        seen = run_epoch()
        return seen / (timer() - start)

    return timed

def _loader_epochs(loader: Any) -> Any:
    def run() -> int:
        seen = 0
        for images, _ in loader:
            seen += images.shape[0]
        return seen
    return run

def datamodule_epochs(pipeline: str, root: Path, args: argparse.Namespace, workers: int, threads: int = 1) -> Any:
    """A datamodule's training loader (what ``fastscale-train`` iterates), uint8 batches for the
    streaming pipeline (normalised on the device; ``threads`` decode threads per loader process),
    float for ImageFolder (its transform's own)."""
    from lightning_fastscale.data.cli import make_datamodule

    extra = {"decode_threads": threads} if pipeline == "streaming" else {}
    dm = make_datamodule(pipeline, str(root), args.resolution, args.batch_size, workers, **extra)
    if hasattr(dm, "setup"):
        dm.setup("fit")
    return _warmed(_loader_epochs(dm.train_dataloader()), "process" if workers == 0 and threads == 1 else "wall")

def train_batch_epochs(stored: tuple[list[torch.Tensor], list[int]], args: argparse.Namespace, threads: int,
                       torchcodec: bool = False) -> Any:
    """`transforms.train_batch` over the stored bytes held in memory (no chunk reads): shuffled
    batches, one generator per sample, ``threads`` threads, one reused output buffer;
    ``torchcodec``: decoded by TorchCodec, as where simplejpeg is not installed."""
    from lightning_fastscale.data import transforms

    jpegs, _ = stored
    out = torch.empty(args.batch_size, 3, args.resolution, args.resolution, dtype=torch.uint8,
                      memory_format=torch.channels_last)
    epoch = [0]
    simplejpeg = transforms._simplejpeg

    def run() -> int:
        epoch[0] += 1
        order = torch.randperm(len(jpegs), generator=torch.Generator().manual_seed(epoch[0])).tolist()
        seen = 0
        transforms._simplejpeg = None if torchcodec else simplejpeg
        try:
            for b in range(len(order) // args.batch_size):
                idx = order[b * args.batch_size : (b + 1) * args.batch_size]
                gens = [transforms.sample_generator(0, epoch[0], i) for i in idx]
                transforms.train_batch([jpegs[i] for i in idx], gens, args.resolution, threads=threads, out=out)
                seen += len(idx)
        finally:
            transforms._simplejpeg = simplejpeg
        return seen

    return _warmed(run, "process" if threads == 1 else "wall")

def ffcv_epochs(beton: Path, args: argparse.Namespace, threads: int) -> Any:
    """FFCV's loader: fused decode + random resized crop (its defaults: scale 0.08-1, ratio
    3/4-4/3), flip, uint8 ``(N, 3, H, W)`` torch batches, ``threads`` Numba threads, random order."""
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.decoders import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    loader = Loader(str(beton), batch_size=args.batch_size, num_workers=threads, order=OrderOption.RANDOM,
                    drop_last=True, os_cache=True, pipelines={
                        "image": [RandomResizedCropRGBImageDecoder((args.resolution, args.resolution)),
                                  RandomHorizontalFlip(), ToTensor(), ToTorchImage()],
                        "label": [IntDecoder(), ToTensor()]})
    return _warmed(_loader_epochs(loader), "process" if threads == 1 else "wall")

NOT_HERE = object()  # a row not measured in this column

def versus_ffcv(args: argparse.Namespace, tree: Path) -> None:
    """The epoch table: images/s at 1 core and all cores, ratios to ImageFolder and to FFCV."""
    cores = os.cpu_count() or 1
    big = repeated_tree(tree, args.workdir / f"tree-x{args.repeat}", args.repeat)
    streams, stored, betons = {}, {}, {}
    with_ffcv = ffcv_importable()
    sides = stored_sides(args)
    for side in sides:
        streams[side] = args.workdir / f"stream-x{args.repeat}-{side}"
        if not (streams[side] / "dataset.json").is_file():
            convert(big, streams[side], max_side=side, quality=90, verbose=False)
        stored[side] = stored_train(streams[side])
        betons[side] = ffcv_beton(streams[side], args.workdir / f"ffcv-x{args.repeat}-{side}.beton") if with_ffcv else None
    n = len(stored[640][0])
    if args.epoch_rounds < 1:  # the data only (set-up of a later run)
        return
    label = {side: "source" if side == 640 else str(side) for side in sides}
    # each row: (stored side, make(cores) -> a warmed-up epoch timer, or None where skipped)
    rows: dict[str, tuple[str, Any]] = {"ImageFolderDataModule (PIL decode, float out)": ("source", lambda c: datamodule_epochs(
        "imagefolder", big, args, 0 if c == 1 else c))}
    for side in sides:
        rows[f"StreamingDataModule, {label[side]}"] = (label[side], lambda c, side=side: datamodule_epochs(
            "streaming", streams[side], args, 0 if c == 1 else c))
        rows[f"StreamingDataModule, no worker, {cores} decode threads (background thread), {label[side]}"] = (
            label[side], lambda c, side=side: NOT_HERE if c == 1 else datamodule_epochs("streaming", streams[side], args, 0, c))
        rows[f"`train_batch`, bytes in memory, {label[side]}"] = (label[side], lambda c, side=side: train_batch_epochs(
            stored[side], args, c))
        rows[f"`train_batch`, bytes in memory, TorchCodec decode, {label[side]}"] = (
            label[side], lambda c, side=side: train_batch_epochs(stored[side], args, c, torchcodec=True))
        rows[f"FFCV 1.0.2, {label[side]}"] = (label[side], lambda c, side=side: None if betons[side] is None else ffcv_epochs(
            betons[side], args, c))

    def dali(c: int) -> Any:  # builds its pipeline per call, with its own warm-up batches
        probe = lambda: dali_images_per_s(big, args.resolution, args.batch_size, c, n // args.batch_size,  # noqa: E731
                                          "process" if c == 1 else "wall")
        return probe if probe() is not None else None

    rows["DALI CPU, source"] = ("source", dali)
    names = list(rows)
    cols = (1,) if args.per_core_only else (1, cores)
    timers: dict[tuple[str, int], Any] = {}
    results: dict[tuple[str, int], list[float | None]] = {(r, c): [] for r in names for c in cols}
    for rnd in range(args.epoch_rounds):  # interleaved, order rotated: load drift lands on all alike
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for c in cols:
            for r in order:
                # FFCV's loaders set torch's intra-op threads to their own thread count, process-wide,
                # and leave them so: reset to one, or every later torch resize here spreads over (and
                # spin-waits on) that many threads, which about halved `train_batch`'s images per
                # CPU-second measured after an FFCV row of 2 threads
                torch.set_num_threads(1)
                if (r, c) not in timers:  # made (and warmed up by one epoch) on first use
                    timers[(r, c)] = rows[r][1](c)
                    torch.set_num_threads(1)
                timer = timers[(r, c)]
                results[(r, c)].append(None if timer is None else math.nan if timer is NOT_HERE else timer())
                print(f"round {rnd} {r}, {c} core(s): {results[(r, c)][-1]}", flush=True)

    def ratio(r: str, base: str, c: int) -> str:
        vals, refs = results[(r, c)], results[(base, c)]
        if any(v is None or math.isnan(v) for v in vals + refs):
            return ""
        return f"{statistics.median(v / b for v, b in zip(vals, refs)):.2f}"

    print(f"\n{n} images per epoch ({n // args.repeat} files x {args.repeat}), {args.resolution} px, batch "
          f"{args.batch_size}, uint8 out unless noted; one warm-up epoch per pipeline, then medians of "
          f"{args.epoch_rounds} interleaved rounds of one epoch each; 1 core: images per CPU-second of one process (FFCV and `train_batch`: 1 thread); "
          f"{cores} cores: wall clock, {cores} loader workers or threads")
    head = " | 1 core | x ImageFolder | x FFCV |" + ("" if args.per_core_only else f" {cores} cores | x ImageFolder | x FFCV |")
    print(f"\n| pipeline | stored max side{head}")
    print("|---|---|" + "---:|" * 3 * len(cols))
    for r in names:
        side = rows[r][0]
        ffcv = f"FFCV 1.0.2, {side}"
        cells = []
        for c in cols:
            vals = results[(r, c)]
            shown = ("skipped" if any(v is None for v in vals) else "" if any(math.isnan(v) for v in vals)
                     else f"{statistics.median(vals):,.0f}")
            cells += [shown,
                      ratio(r, names[0], c), ratio(r, ffcv, c)]
        print(f"| {r} | {side} | " + " | ".join(cells) + " |")


def run(args: argparse.Namespace) -> None:
    tree, _ = input_common.prepare(args)
    versus_ffcv(args, tree)


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_vs_ffcv", max_sides=(320, 256), epochs=True)
    parser.add_argument("--per-core-only", action="store_true", help="only the 1-core column")
    input_common.main(run, parser.parse_args())
