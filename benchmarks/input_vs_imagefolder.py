"""Training-transform throughput: ImageFolder (PIL) vs the streaming datamodule vs DALI CPU vs nvJPEG.

Times the training pipeline (random resized crop to ``--resolution`` + flip, up to a normalised
float batch) on the tree of `input_common` stored at each ``--max-sides`` and at source size:
per core (one process, one thread; DALI ``num_threads=1``) and with ``os.cpu_count()`` loader
workers (DALI: that many threads), as images/s and the ratio to ``ImageFolderDataModule`` in the
same rounds. ``uint8 out`` stops at the uint8 batch (the CPU's share where a GPU normalises);
``decode_jpeg alone`` is the ceiling of any pipeline that decodes these files in full. DALI and
nvJPEG are skipped with a message where they cannot run.

Example::

    flock /tmp/cpu.lock nice -n 5 python benchmarks/input_vs_imagefolder.py --workdir /tmp/ipb --rounds 3
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import input_common
import torch
from input_common import dali_images_per_s

from lightning_fastscale.data import jpeg_decode
from lightning_fastscale.data.cli import bench_pipeline


def nvjpeg_images_per_s(stream_root: Path, resolution: int, batch_size: int, batches: int) -> float | None:
    """Batched nvJPEG decode + crop/resize/flip on the GPU from stored bytes; None without CUDA."""
    if not torch.cuda.is_available():
        print("nvJPEG skipped: no CUDA device")
        return None
    from litdata import StreamingDataset
    from torchvision.transforms.v2 import functional as F

    from lightning_fastscale.data import transforms

    ds = StreamingDataset(str(stream_root / "train"))
    datas = [torch.frombuffer(bytearray(ds[i]["image"]), dtype=torch.uint8) for i in range(min(len(ds), batch_size * 4))]
    g = torch.Generator().manual_seed(0)

    def run(k: int) -> None:
        chunk = [datas[(k * batch_size + j) % len(datas)] for j in range(batch_size)]
        images = jpeg_decode.decode_jpeg_batch_on_device(chunk, "cuda")
        out = []
        for img in images:
            box = transforms.random_resized_crop_box(img.shape[1], img.shape[2], g)
            out.append(F.resized_crop(img, *box, [resolution, resolution], antialias=True))
        transforms.normalize_on_device(torch.stack(out))

    run(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(batches):
        run(k)
    torch.cuda.synchronize()
    return batches * batch_size / (time.perf_counter() - start)

def decode_only_images_per_s(stream_root: Path, count: int) -> float:
    """Images per CPU-second of libjpeg-turbo ``decode_jpeg`` alone on stored bytes: the ceiling
    of any CPU pipeline that fully decodes these files, whatever it does after the decode."""
    from litdata import StreamingDataset


    ds = StreamingDataset(str(stream_root / "train"))
    datas = [torch.frombuffer(bytearray(ds[i]["image"]), dtype=torch.uint8) for i in range(min(len(ds), count))]
    start = time.process_time()
    for data in datas:
        jpeg_decode.decode_rgb(data)
    return len(datas) / (time.process_time() - start)

def _measure(pipeline: str, root: Path, args: argparse.Namespace, workers: int, normalize: bool = True) -> float:
    # one process (workers=0): images per CPU-second of this process, robust to other load;
    # with workers: wall clock, since the work happens in the worker processes
    clock = "process" if workers == 0 else "wall"
    return bench_pipeline(pipeline, str(root), args.resolution, args.batch_size, workers, args.batches,
                          warmup=max(2, workers), clock=clock, normalize=normalize)


def run(args: argparse.Namespace) -> None:
    tree, streams = input_common.prepare(args)
    cores = os.cpu_count() or 1
    pipelines: dict[str, Any] = {"ImageFolderDataModule (PIL decode)": lambda w: _measure("imagefolder", tree, args, w)}
    for side in [640, *args.max_sides]:
        label = "StreamingDataModule @ source size" if side == 640 else f"StreamingDataModule, max side {side}"
        pipelines[label] = lambda w, side=side: _measure("streaming", streams[side], args, w)
    pipelines["StreamingDataModule @ source size, uint8 out (normalised on the GPU)"] = (
        lambda w: _measure("streaming", streams[640], args, w, normalize=False))
    pipelines["`decode_jpeg` alone @ source size (ceiling of a full decode)"] = (
        lambda w: decode_only_images_per_s(streams[640], args.batches * args.batch_size) if w == 0 else math.nan)
    dali = "DALI CPU (decode+random crop fused)"
    pipelines[dali] = lambda w: dali_images_per_s(tree, args.resolution, args.batch_size, max(1, w), args.batches,
                                                   "process" if w == 0 else "wall")
    names = list(pipelines)
    results: dict[tuple[str, int], list[float | None]] = {(n, w): [] for n in names for w in (0, cores)}
    for r in range(args.rounds):  # interleaved, order rotated: load drift lands on all alike
        order = names[r % len(names):] + names[: r % len(names)]
        for w in (0, cores):
            for n in order:
                results[(n, w)].append(pipelines[n](w))
                print(f"round {r} {n} workers={w}: {results[(n, w)][-1]}", flush=True)

    def summary(n: str, w: int) -> tuple[str, str]:
        vals, base = results[(n, w)], results[(names[0], w)]
        if any(v is None for v in vals):
            return "skipped", ""
        if any(math.isnan(v) for v in vals):  # not measured in this column
            return "", ""
        paired = statistics.median(v / b for v, b in zip(vals, base))  # per-round ratios
        return f"{statistics.median(vals):.0f}", f"{paired:.2f}"

    rate = nvjpeg_images_per_s(streams[640], args.resolution, args.batch_size, args.batches)
    print(f"\n| pipeline ({args.resolution} px train) | images/CPU-s, 1 process 1 thread | x ImageFolder "
          f"| images/s, {cores} workers | x ImageFolder |")
    print("|---|---|---|---|---|")
    for n in names:
        o, oa = summary(n, 0)
        a, aa = summary(n, cores)
        print(f"| {n} | {o} | {oa} | {a} | {aa} |")
    print(f"| nvJPEG batched decode on the GPU @ source size | {'skipped' if rate is None else f'{rate:.0f}'} | | | |")
    print(f"\nmedians of {args.rounds} interleaved rounds; ratios are medians of per-round ratios")


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_vs_imagefolder")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    input_common.main(run, parser.parse_args())
