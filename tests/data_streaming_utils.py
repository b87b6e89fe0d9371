"""Small image trees and converted streaming folders for the streaming-data tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from lightning_fastscale.data.convert import convert

CLASSES = ("n01", "n02", "n03")


def write_tree(root: Path, classes=CLASSES, train_per_class: int = 8, val_per_class: int = 2) -> Path:
    """ImageNet layout with smooth random-colour JPEGs of varied sizes (one 120 px wide)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                h, w = 40 + 3 * i, (120 if i == 0 else 50 + 2 * i)
                base = rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
                img = Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)
                img.save(d / f"{c}_{i}.JPEG", quality=95)
    return root


def convert_tree(tmp: Path, max_side: int = 64, chunk_bytes: str = "64MB", **tree_kwargs) -> Path:
    """Write a tree under ``tmp/tree`` and convert it to ``tmp/stream``; return the latter."""
    write_tree(tmp / "tree", **tree_kwargs)
    out = tmp / "stream"
    convert(tmp / "tree", out, max_side=max_side, quality=95, num_workers=1, chunk_bytes=chunk_bytes)
    return out
