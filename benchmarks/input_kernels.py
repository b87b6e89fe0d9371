"""Each step of the training transform on one thread, ms per image: decoders, resizes, whole paths, pixel differences.

On the same stored bytes, crop boxes and flips (``kernel_ms``), at source size and max side 256
of `input_common`'s tree.

Example::

    python benchmarks/input_kernels.py --workdir /tmp/ipb-ffcv --classes 8 --train-per-class 40
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Any

import input_common
import numpy as np
import torch
from input_common import stored_train

from lightning_fastscale.data import jpeg_decode


def kernel_ms(stored: tuple[list[torch.Tensor], list[int]], resolution: int, files: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` ms per image, one thread, of each step of the training transform on
    the same stored bytes, crop boxes and flips: the decode (TorchCodec, and simplejpeg with its
    accurate and its fast IDCT), the per-image resize against `train_batch`'s (OpenCV bilinear
    for crops enlarged on both axes, torchvision's antialiased kernel into the batch slot
    otherwise), and the whole per-image and batch paths (`train_batch` with each decoder, and
    with DCT-domain scaling); then the pixel differences of the fast IDCT and of DCT-domain
    scaling after the whole transform, in grey levels."""
    import cv2
    import simplejpeg
    from torchvision.transforms.v2 import functional as F

    from lightning_fastscale.data import transforms

    jpegs = stored[0][:files]
    images = [jpeg_decode.decode_rgb(j) for j in jpegs]
    plans = [transforms.draw_crop(im.shape[1], im.shape[2], transforms.sample_generator(0, 0, i))
             for i, im in enumerate(images)]
    out = torch.empty(len(jpegs), 3, resolution, resolution, dtype=torch.uint8, memory_format=torch.channels_last)
    scratch = np.empty((resolution, resolution, 3), np.uint8)
    pixels, slots = [transforms._pixels(im) for im in images], out.permute(0, 2, 3, 1).numpy()  # train_batch's views
    enlarged = [i for i, (box, _) in enumerate(plans) if box[2] <= resolution and box[3] <= resolution]

    def area(i: int) -> None:  # FFCV's resize: INTER_AREA on the crop region, whatever the scale
        (top, left, h, w), _ = plans[i]
        cv2.resize(images[i].permute(1, 2, 0).numpy()[top : top + h, left : left + w], (resolution, resolution),
                   dst=scratch, interpolation=cv2.INTER_AREA)

    cases: dict[str, Any] = {
        "decode (TorchCodec `decode_jpeg`)": (lambda i: jpeg_decode.decode_rgb(jpegs[i]), range(len(jpegs))),
        "decode (simplejpeg, accurate IDCT: `train_batch`'s)": (
            lambda i: simplejpeg.decode_jpeg(jpegs[i].numpy(), "RGB"), range(len(jpegs))),
        "decode (simplejpeg, fast IDCT, as FFCV's)": (
            lambda i: simplejpeg.decode_jpeg(jpegs[i].numpy(), "RGB", fastdct=True), range(len(jpegs))),
        "resize + flip, torchvision `resized_crop` (per-image path)": (
            lambda i: transforms.crop_resize_flip(images[i], *plans[i][:1], resolution, plans[i][1]), range(len(jpegs))),
        "resize + flip, `train_batch`'s (into the batch slot)": (
            lambda i: transforms._crop_resize_flip_into(pixels[i], plans[i][0], resolution, plans[i][1], out[i], slots[i]),
            range(len(jpegs))),
        "resize, OpenCV INTER_AREA on the crop (FFCV's)": (area, range(len(jpegs))),
        "crops enlarged on both axes only: torchvision `resized_crop`": (
            lambda i: transforms.crop_resize_flip(images[i], *plans[i][:1], resolution, plans[i][1]), enlarged),
        "the same crops: `train_batch`'s (OpenCV bilinear)": (
            lambda i: transforms._crop_resize_flip_into(pixels[i], plans[i][0], resolution, plans[i][1], out[i], slots[i]),
            enlarged),
        "whole transform, per image (`train_transform`)": (
            lambda i: transforms.train_transform(jpegs[i], resolution, transforms.sample_generator(0, 0, i)),
            range(len(jpegs))),
    }
    best = {name: math.inf for name in cases}
    gens = lambda: [transforms.sample_generator(0, 0, i) for i in range(len(jpegs))]  # noqa: E731
    sj = transforms._simplejpeg

    def batch(decoder: Any, dct_scaling: bool = False) -> torch.Tensor:
        transforms._simplejpeg = decoder  # None: TorchCodec decodes, as without simplejpeg
        try:
            return transforms.train_batch(jpegs, gens(), resolution, out=out, dct_scaling=dct_scaling)
        finally:
            transforms._simplejpeg = sj

    batches = {"whole transform, `train_batch` (1 thread, TorchCodec decode)": lambda: batch(None),
               "whole transform, `train_batch` (1 thread, simplejpeg decode)": lambda: batch(sj),
               "whole transform, `train_batch` (1 thread, simplejpeg, `dct_scaling=True`)": lambda: batch(sj, True)}
    best.update({name: math.inf for name in batches})
    for _ in range(repeats):
        for name, (fn, which) in cases.items():
            if not which:
                continue
            start = time.process_time()
            for i in which:
                fn(i)
            best[name] = min(best[name], (time.process_time() - start) / len(which) * 1e3)
        for name, run in batches.items():
            start = time.process_time()
            run()
            best[name] = min(best[name], (time.process_time() - start) / len(jpegs) * 1e3)
    val_best = {"validation resize + centre crop, torchvision (before)": math.inf,
                "validation resize + centre crop, `val_transform`'s": math.inf}
    short = round(resolution / 0.875)
    for _ in range(repeats):
        start = time.process_time()
        for im in images:
            F.center_crop(F.resize(im, [short], antialias=True), [resolution, resolution])
        mid = time.process_time()
        for im in images:
            transforms.resize_centre_crop(im, resolution)
        end = time.process_time()
        for name, took in zip(val_best, (mid - start, end - mid)):
            val_best[name] = min(val_best[name], took / len(images) * 1e3)
    best.update(val_best)
    best["share of crops enlarged on both axes"] = len(enlarged) / len(jpegs)
    # where a 1/2-scale DCT-domain decode could serve: the crop keeps >= the output size at half scale
    best["share of crops >= 2x the output on both axes"] = sum(
        box[2] >= 2 * resolution and box[3] >= 2 * resolution for box, _ in plans) / len(jpegs)
    # accuracy against the per-image path (torchvision's antialiased bilinear), in grey levels
    reduced = [i for i in range(len(jpegs)) if i not in set(enlarged)]
    for name, which, fn in (("`train_batch`", range(len(jpegs)), None), ("OpenCV INTER_AREA, reduced crops", reduced, area)):
        diffs = []
        for i in which:
            ref = transforms.crop_resize_flip(images[i], plans[i][0], resolution, False).permute(1, 2, 0).numpy()
            if fn is None:
                transforms._crop_resize_flip_into(pixels[i], plans[i][0], resolution, False, out[i], slots[i])
                got = out[i].permute(1, 2, 0).numpy()
            else:
                fn(i)
                got = scratch
            diffs.append(np.abs(got.astype(np.int16) - ref.astype(np.int16)))
        best[f"{name}: mean abs diff to torchvision"] = float(np.mean([d.mean() for d in diffs])) if diffs else math.nan
        best[f"{name}: max abs diff to torchvision"] = float(max(d.max() for d in diffs)) if diffs else math.nan
    # the whole transform with the fast IDCT or DCT-domain scaling against `train_batch` as it is
    accurate = batch(sj).clone()
    reductions = [transforms._dct_reduction(box, resolution) for box, _ in plans]
    best["share of crops decoded at 1/2, 1/4 or 1/8 scale (`dct_scaling`)"] = sum(d > 1 for d in reductions) / len(jpegs)
    scaled = batch(sj, True)
    changed = [i for i, d in enumerate(reductions) if d > 1]
    d = (scaled[changed].int() - accurate[changed].int()).abs() if changed else None
    best["`dct_scaling`, crops decoded reduced: mean abs diff"] = d.float().mean().item() if changed else math.nan
    best["`dct_scaling`, crops decoded reduced: max abs diff"] = d.max().item() if changed else math.nan
    best["`dct_scaling`, other crops: max abs diff"] = max(
        ((scaled[i].int() - accurate[i].int()).abs().max().item() for i in range(len(jpegs)) if reductions[i] == 1),
        default=math.nan)
    fast_images = [torch.from_numpy(simplejpeg.decode_jpeg(j.numpy(), "RGB", fastdct=True)).permute(2, 0, 1) for j in jpegs]
    d = torch.stack([(transforms.crop_resize_flip(fi, box, resolution, False).int()
                      - transforms.crop_resize_flip(im, box, resolution, False).int()).abs()
                     for fi, im, (box, _) in zip(fast_images, images, plans)])
    best["fast IDCT after the crop + resize: mean abs diff"] = d.float().mean().item()
    best["fast IDCT after the crop + resize: max abs diff"] = d.max().item()
    return best


def run(args: argparse.Namespace) -> None:
    _, streams = input_common.prepare(args)
    rows = {side: kernel_ms(stored_train(streams[side]), args.resolution, 48 if args.quick else 200)
            for side in (640, 256) if side in streams}
    print(f"\n| step, 1 thread, {args.resolution} px | ms per image, source | ms per image, max side 256 |\n|---|---:|---:|")
    for name in rows[640]:
        print(f"| {name} | " + " | ".join(f"{rows[side][name]:.3f}" for side in rows) + " |")
    print(f"({48 if args.quick else 200} stored images of each size, best of 5, ms of this process's CPU time)")


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_kernels", max_sides=(256,))

    input_common.main(run, parser.parse_args())
