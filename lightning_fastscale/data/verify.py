"""Check converted streaming data (``fastscale-data verify``): every chunk's structure, then every JPEG, strictly.

What it can and cannot find: ``docs/input_pipeline.md`` ("Damaged data").
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from litdata import StreamingDataset

from .jpeg_decode import decode_rgb, strict_decode
from .stored_format import SPLITS, Problem, check_split_files, read_index


def verify_split(split_dir: str | os.PathLike[str]) -> tuple[int, list[Problem]]:
    """``(samples checked, problems)`` of one split: chunk structure, then the sound chunks' samples decoded."""
    split = Path(split_dir)
    chunks = read_index(split)
    problems = check_split_files(split)
    damaged = {p.chunk for p in problems}
    dataset = StreamingDataset(str(split), shuffle=False)
    first, checked = 0, 0
    for entry in chunks:
        path = str(split / entry["filename"])
        count = int(entry["chunk_size"])
        if path not in damaged:
            for sample in range(first, first + count):
                checked += 1
                try:
                    item = dataset[sample]
                    strict_decode(decode_rgb, torch.frombuffer(bytearray(item["image"]), dtype=torch.uint8))
                except Exception as err:  # every failure is reported, whatever raised it
                    problems.append(Problem(path, sample, f"{type(err).__name__}: {err}"))
        first += count
    return checked, problems


def verify(root: str | os.PathLike[str]) -> tuple[int, list[Problem]]:
    """``(samples checked, problems)`` of a folder written by ``fastscale-data convert``.

    Examples:
        >>> checked, problems = verify("/data/imagenet-stream")  # doctest: +SKIP
        >>> for p in problems: print(p)  # doctest: +SKIP
        /data/imagenet-stream/train/chunk-0-3.bin: sample 1207: ValueError: Corrupt JPEG data: ...
    """
    results = [verify_split(Path(root) / split) for split in SPLITS]
    return sum(n for n, _ in results), [p for _, found in results for p in found]
