"""Per-rank validation batches of a streaming split: square (centre crop) or rectangular (Howard et al. 2018).

Every rank gets the same number of batches and every sample goes to exactly one rank
(``docs/input_pipeline.md``, "Rectangular validation").
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from . import rect_val
from .rect_val import RectBatch

log = logging.getLogger(__name__)


def square_rank_batches(
    count: int, batch_size: int, resolution: int, rank: int, world_size: int, source: str = "the data"
) -> list[RectBatch]:
    """Rank ``rank``'s square batches of a split of ``count`` samples (``source`` names it in errors).

    Examples:
        >>> [b.indices for b in square_rank_batches(9, 2, 32, rank=1, world_size=2)]
        [(6,), (7,), (8,)]
    """
    if 0 < count < world_size:
        raise ValueError(
            f"{source} has {count} validation samples for {world_size} ranks; every rank needs "
            "at least one. Validate on fewer ranks, or set trainer.limit_val_batches=0"
        )
    if count == 0:
        return []
    batches = rect_val.split_batches(range(count), batch_size, world_size)
    per_rank = len(batches) // world_size
    shape = (resolution, resolution)
    return [RectBatch(tuple(b), shape) for b in batches[rank * per_rank : (rank + 1) * per_rank]]


def rect_rank_batches(
    sizes: Sequence[Sequence[int]], batch_size: int, resolution: int, rank: int, world_size: int,
    max_side: int | None = None, source: str = "the data",
) -> list[RectBatch]:
    """Rank ``rank``'s rectangular batches of images of ``sizes`` (``(height, width)`` each).

    Examples:
        >>> [(b.indices, b.shape) for b in rect_rank_batches([(10, 20), (20, 10), (10, 10)], 2, 32, 0, 1)]
        [((1, 2), (40, 32)), ((0,), (32, 64))]
    """
    if len(sizes) < world_size:
        raise ValueError(
            f"rect_val=True needs at least one validation sample per rank: {source} has "
            f"{len(sizes)} for {world_size} ranks; set rect_val=False"
        )
    plan = rect_val.plan_batches(sizes, batch_size, resolution, world_size, max_side)
    mine = rect_val.rank_batches(plan, rank, world_size)
    log.info(
        "rect_val: %d validation batches on rank %d of %d, %d shapes from %s to %s",
        len(mine), rank, world_size, len({b.shape for b in plan}), plan[0].shape, plan[-1].shape,
    )
    return mine
