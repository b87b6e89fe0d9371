"""Shared by the input-pipeline benchmarks (``input_*.py``): the generated JPEG tree, its conversions, the options.

``write_tree`` writes an ImageNet-like tree of photo-like JPEGs (333-640 px wide, aspect 0.66-1,
quality 85-95, texture at several scales + gradient + pixel noise, ~100 KB like ImageNet's);
``prepare`` writes it once under ``--workdir`` and converts it with ``fastscale-data convert``
at each ``--max-sides`` and at source size (640). ``--quick`` shrinks every script to a check
that it works.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import results_file
import torch
from PIL import Image

from lightning_fastscale.data.convert import convert
from lightning_fastscale.data.transforms import normalize_on_device as fast_normalize


def parser(doc: str, script: str, max_sides: tuple[int, ...] = (256, 320, 400), epochs: bool = False) -> argparse.ArgumentParser:
    """The options every input benchmark takes (tree, stored sizes, batch, ``--quick``, ``--results``).

    ``epochs``: also ``--repeat`` and ``--epoch-rounds``, for the scripts that time whole epochs.
    """
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/fastscale-input-bench"))
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--train-per-class", type=int, default=64)
    p.add_argument("--max-sides", type=int, nargs="+", default=list(max_sides))
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="a short run that checks the script works (few images)")
    if epochs:
        p.add_argument("--repeat", type=int, default=10, help="times each training file is in an epoch")
        p.add_argument("--epoch-rounds", type=int, default=3, help="interleaved rounds")
    results_file.add_option(p, script)
    return p


def prepare(args: argparse.Namespace) -> tuple[Path, dict[int, Path]]:
    """The source tree and its conversion at each stored max side (written once under ``--workdir``)."""
    if args.quick:
        args.classes, args.train_per_class, args.batch_size, args.max_sides = 2, 24, 8, [256]
        for name, value in (("repeat", 2), ("rounds", 1), ("epoch_rounds", 1), ("batches", 2), ("step_batch_size", 8)):
            if hasattr(args, name):
                setattr(args, name, value)
    torch.set_num_threads(1)
    tree = args.workdir / "tree"
    if not (tree / "val").is_dir():
        stats = write_tree(tree, args.classes, args.train_per_class, 2)
        (args.workdir / "tree_stats.json").write_text(json.dumps(stats))
    stats = json.loads((args.workdir / "tree_stats.json").read_text())
    print(f"tree: {stats['files']} files, mean {stats['mean_kb']:.0f} KB, mean {stats['mean_pixels'] / 1e3:.0f} kpixel")
    streams = {}
    for side in [*args.max_sides, 640]:
        streams[side] = args.workdir / f"stream-{side}"
        if not (streams[side] / "dataset.json").is_file():
            convert(tree, streams[side], max_side=side, quality=90, verbose=False)
    return tree, streams


def main(run: Any, args: argparse.Namespace) -> None:
    """``run(args)``, its printed tables recorded in the results file."""
    with results_file.recording(args.results, vars(args)):
        run(args)


def photo_like(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """An RGB uint8 image with texture at several scales, a colour gradient and pixel noise."""
    img = np.zeros((height, width, 3), np.float32)
    for octave in (4, 16, 64):
        base = rng.normal(0, 1, (max(2, height // octave), max(2, width // octave), 3))
        small = Image.fromarray((base * 40 + 128).clip(0, 255).astype(np.uint8))
        img += (np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), np.float32) - 128) * (octave / 64) ** 0.5
    yy, xx = np.mgrid[0:height, 0:width]
    img += rng.uniform(-60, 60, 3) * (xx / width)[..., None] + rng.uniform(-60, 60, 3) * (yy / height)[..., None]
    img += rng.uniform(60, 190, 3) + rng.normal(0, 16, img.shape)
    return img.clip(0, 255).astype(np.uint8)

def write_tree(root: Path, classes: int, train_per_class: int, val_per_class: int, seed: int = 0) -> dict[str, float]:
    """ImageNet layout of photo-like JPEGs; returns the mean file size and pixel count."""
    rng = np.random.default_rng(seed)
    sizes, pixels = [], []
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            d = root / split / f"n{c:08d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w = int(rng.integers(333, 641))
                h = int(w * rng.uniform(0.66, 1.0))
                buf = io.BytesIO()
                Image.fromarray(photo_like(rng, h, w)).save(buf, "JPEG", quality=int(rng.integers(85, 96)))
                (d / f"img_{i:05d}.JPEG").write_bytes(buf.getvalue())
                sizes.append(len(buf.getvalue()))
                pixels.append(w * h)
    return {"mean_kb": statistics.mean(sizes) / 1e3, "mean_pixels": statistics.mean(pixels), "files": len(sizes)}

def dali_images_per_s(root: Path, resolution: int, batch_size: int, threads: int, batches: int, clock: str = "wall") -> float | None:
    """DALI CPU pipeline: fused decode + random crop, resize, flip, uint8 out; None without DALI."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except Exception as err:  # ImportError, or a CUDA-library load error
        print(f"DALI skipped: nvidia-dali not importable ({type(err).__name__}: {err})")
        return None

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=0)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=str(root / "train"), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=resolution, resize_y=resolution)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    timer = time.process_time if clock == "process" else time.perf_counter
    for _ in range(2):
        p.run()
    start = timer()
    for _ in range(batches):
        images, _ = p.run()
        batch = torch.from_numpy(images.as_array()).permute(0, 3, 1, 2)
        fast_normalize(batch)  # normalise like the others, on the CPU
    rate = batches * batch_size / (timer() - start)
    del p
    return rate

def stored_train(stream_root: Path) -> tuple[list[torch.Tensor], list[int]]:
    """The JPEG bytes and labels of a converted training split, read once through litdata."""
    from litdata import StreamingDataset

    ds = StreamingDataset(str(stream_root / "train"))
    items = [ds[i] for i in range(len(ds))]
    return [torch.frombuffer(bytearray(it["image"]), dtype=torch.uint8) for it in items], [int(it["label"]) for it in items]

def repeated_tree(tree: Path, out: Path, repeat: int) -> Path:
    """``tree`` with every training file present ``repeat`` times (hard links; val once)."""
    if (out / "done").is_file():
        return out
    for src in sorted(tree.rglob("*.JPEG")):
        rel = src.relative_to(tree)
        copies = repeat if rel.parts[0] == "train" else 1
        (out / rel.parent).mkdir(parents=True, exist_ok=True)
        for k in range(copies):
            dst = out / rel.parent / f"{src.stem}_r{k}{src.suffix}"
            if not dst.exists():
                os.link(src, dst)
    (out / "done").write_text("")
    return out

def stored_sides(args: argparse.Namespace) -> list[int]:
    """The stored max sides of ``--versus-ffcv``'s data: source size (640), then each ``--max-sides``."""
    return [640, *sorted(set(args.max_sides) - {640}, reverse=True)]

def written_stream(args: argparse.Namespace, side: int) -> Path:
    """The converted folder ``--versus-ffcv`` wrote for ``side``; exits saying how to write it if missing."""
    root = args.workdir / f"stream-x{args.repeat}-{side}"
    if not (root / "dataset.json").is_file():
        raise SystemExit(f"{root} is missing: run benchmarks/input_vs_ffcv.py with the same --workdir, --repeat and "
                         "--max-sides first (--epoch-rounds 0 writes only the data)")
    return root
