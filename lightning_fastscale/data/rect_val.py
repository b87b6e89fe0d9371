"""Rectangular validation: no centre crop, batches grouped by aspect ratio (Howard et al. 2018, fast.ai).

More in ``docs/input_pipeline.md`` ("Rectangular validation in code").
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

# long sides fit stride-2 convolutions and tensor-core tiles without ragged edges
SHAPE_MULTIPLE = 8


@dataclass(frozen=True)
class RectBatch:
    """One validation batch: sample positions and the ``(height, width)`` all its images get."""

    indices: tuple[int, ...]
    shape: tuple[int, int]


def aspect_order(sizes: Sequence[Sequence[int]]) -> list[int]:
    """Positions of ``sizes`` (``(height, width)`` each) sorted by width / height, ties by position.

    Examples:
        >>> aspect_order([(100, 200), (200, 100), (100, 100)])
        [1, 2, 0]
    """
    return sorted(range(len(sizes)), key=lambda i: (sizes[i][1] / sizes[i][0], i))


def split_batches(order: Sequence[int], batch_size: int, world_size: int = 1) -> list[list[int]]:
    """Cut ``order`` into the fewest ``k * world_size`` consecutive batches of at most ``batch_size``, sizes within one.

    (With ``batch_size=1`` and a count ``world_size`` does not divide, some batches hold two.)

    Examples:
        >>> [len(b) for b in split_batches(range(10), batch_size=4, world_size=2)]
        [3, 3, 2, 2]
    """
    n = len(order)
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"batch_size and world_size must be >= 1, got {batch_size} and {world_size}")
    if n < world_size:
        raise ValueError(f"{n} samples cannot fill one batch on each of {world_size} ranks")
    per_rank = -(-n // (batch_size * world_size))  # ceil
    count = min(per_rank, n // world_size) * world_size  # tiny splits: fewer batches, still a multiple of world_size
    # numpy's split: the first n % count batches hold one sample more
    return [part.tolist() for part in np.array_split(np.asarray(order, dtype=np.int64), count)]


def rank_batches(batches: Sequence[RectBatch], rank: int, world_size: int) -> list[RectBatch]:
    """The batches rank ``rank`` of ``world_size`` validates: ``rank, rank + W, ...``."""
    if len(batches) % world_size:
        raise ValueError(f"{len(batches)} batches do not divide among {world_size} ranks")
    return list(batches[rank::world_size])


def batch_shape(
    sizes: Sequence[Sequence[int]], resolution: int, max_long_side: int | None = None
) -> tuple[int, int]:
    """``(height, width)`` of a batch: short side ``resolution``, long side from the median ratio (multiple of 8, capped).

    Examples:
        >>> batch_shape([(300, 400), (300, 450), (300, 420)], 224)
        (224, 312)
        >>> batch_shape([(400, 300)], 224)
        (296, 224)
    """
    ratio = statistics.median(w / h for h, w in sizes)
    elongation = max(ratio, 1.0 / ratio)
    long = SHAPE_MULTIPLE * round(resolution * elongation / SHAPE_MULTIPLE)
    if max_long_side is not None:
        long = min(long, max_long_side // SHAPE_MULTIPLE * SHAPE_MULTIPLE)
    long = max(long, resolution)
    return (resolution, long) if ratio >= 1.0 else (long, resolution)


def plan_batches(
    sizes: Sequence[Sequence[int]],
    batch_size: int,
    resolution: int,
    world_size: int = 1,
    max_long_side: int | None = None,
) -> list[RectBatch]:
    """All ranks' rectangular validation batches, in aspect-ratio order.

    Examples:
        >>> plan = plan_batches([(100, 100), (100, 150), (100, 100), (150, 100)], 2, 64)
        >>> [(b.indices, b.shape) for b in plan]
        [((3, 0), (80, 64)), ((2, 1), (64, 80))]
    """
    batches = split_batches(aspect_order(sizes), batch_size, world_size)
    return [RectBatch(tuple(b), batch_shape([sizes[i] for i in b], resolution, max_long_side)) for b in batches]


def resize_to_cover(image: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Resize a ``(C, h, w)`` uint8 image to cover ``shape`` (antialiased) and centre-crop the excess.

    Examples:
        >>> resize_to_cover(torch.zeros(3, 100, 150, dtype=torch.uint8), (64, 96)).shape
        torch.Size([3, 64, 96])
    """
    h, w = image.shape[-2:]
    height, width = shape
    scale = max(height / h, width / w)
    size = [max(height, round(h * scale)), max(width, round(w * scale))]
    if size != [h, w]:
        image = F.resize(image, size, antialias=True)
    return F.center_crop(image, [height, width])
