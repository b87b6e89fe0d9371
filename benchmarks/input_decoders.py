"""JPEG decoders alone on the source files, ms per image, one thread (best of 5).

TorchCodec and torchvision (the same libjpeg-turbo), OpenCV, and simplejpeg with DCT-domain
scaling and its fast IDCT, on `input_common`'s tree.

Example::

    python benchmarks/input_decoders.py --workdir /tmp/ipb5
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import input_common
import numpy as np
import torch

from lightning_fastscale.data import jpeg_decode


def decoder_ms(tree: Path, files: int = 100, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` ms per image, one thread, of JPEG decoders on the source files:
    TorchCodec and torchvision (the same libjpeg-turbo), and, where ``simplejpeg`` imports,
    libjpeg-turbo's DCT-domain scaling at M/8 and its fast IDCT + upsampling."""
    import warnings

    from torchvision.io import decode_jpeg as torchvision_decode_jpeg


    raw = [p.read_bytes() for p in sorted((tree / "train").rglob("*.JPEG"))[:files]]
    datas = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    cases: dict[str, Any] = {
        "torchcodec decode_jpeg (decode_rgb)": lambda i: jpeg_decode.decode_rgb(datas[i]),
        "torchvision decode_jpeg": lambda i: torchvision_decode_jpeg(datas[i]),
    }
    try:
        import cv2
    except ImportError:
        print("opencv not installed: cv2.imdecode row skipped")
    else:
        arrays = [np.frombuffer(r, np.uint8) for r in raw]
        cases["OpenCV imdecode, RGB"] = lambda i: cv2.imdecode(arrays[i], cv2.IMREAD_COLOR_RGB)
    try:
        import simplejpeg
    except ImportError:
        print("simplejpeg not installed: DCT-domain scaling rows skipped")
    else:
        sizes = [simplejpeg.decode_jpeg_header(r)[:2] for r in raw]
        for num in (8, 7, 6, 5, 4):
            cases[f"simplejpeg, DCT scale {num}/8"] = lambda i, num=num: simplejpeg.decode_jpeg(
                raw[i], min_height=sizes[i][0] * num // 8, min_width=sizes[i][1] * num // 8)
        cases["simplejpeg, fast IDCT + upsampling"] = lambda i: simplejpeg.decode_jpeg(raw[i], fastdct=True, fastupsample=True)
    best = {name: math.inf for name in cases}
    with warnings.catch_warnings():  # torchvision's decoders are deprecated from 0.29
        warnings.simplefilter("ignore")
        for _ in range(repeats):
            for name, fn in cases.items():
                start = time.process_time()
                for i in range(len(raw)):
                    fn(i)
                best[name] = min(best[name], (time.process_time() - start) / len(raw) * 1e3)
    return best


def run(args: argparse.Namespace) -> None:
    tree, _ = input_common.prepare(args)
    print("\n| decoder, source files, 1 thread | ms per image (best of 5) |\n|---|---|")
    for name, ms in decoder_ms(tree).items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_decoders")

    input_common.main(run, parser.parse_args())
