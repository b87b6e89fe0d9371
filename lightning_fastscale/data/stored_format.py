"""The stored formats: the ImageNet-layout source tree and the converted streaming folder.

Layout (``dataset.json``, litdata's ``index.json`` and chunk files): ``docs/input_pipeline.md`` ("The converted format").
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchvision.datasets.folder import IMG_EXTENSIONS

METADATA_FILE = "dataset.json"

FORMAT_NAME = "lightning_fastscale.streaming"

FORMAT_VERSION = 1

SPLITS = ("train", "val")

SIZES_KEY = "sizes"

@dataclass
class StreamingMetadata:
    """What ``dataset.json`` holds: classes in label order, counts, and how images were stored."""

    classes: list[str]
    counts: dict[str, list[int]]  # split -> samples per class, in label order
    max_side: int
    quality: int
    source: str
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def split_size(self, split: str) -> int:
        """Number of samples stored for ``split``."""
        return sum(self.counts.get(split, []))

def stored_sample_count(dataset: Any) -> int:
    """All samples of a litdata ``StreamingDataset`` (its ``len()`` is the calling rank's shard)."""
    return sum(end - start for start, end in dataset.region_of_interest)

def read_metadata(root: str | os.PathLike[str]) -> StreamingMetadata:
    """Read and check ``dataset.json`` of a converted folder; errors name the path and the fix."""
    path = Path(os.path.expanduser(str(root)))
    if not path.is_dir():
        raise FileNotFoundError(
            f"streaming data folder {path} does not exist; create it with "
            "`fastscale-data convert ROOT OUT` and set data.root to OUT"
        )
    meta_file = path / METADATA_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"{path} has no {METADATA_FILE}: it is not a converted folder or its conversion did not "
            "finish; re-run `fastscale-data convert ROOT OUT` into a new folder"
        )
    raw = json.loads(meta_file.read_text())
    if raw.get("format") != FORMAT_NAME or raw.get("version") != FORMAT_VERSION:
        raise ValueError(f"{meta_file} is not {FORMAT_NAME} version {FORMAT_VERSION}: {raw.get('format')!r}")
    meta = StreamingMetadata(**raw)
    for split in SPLITS:
        _check_split_files(path / split)
        for cls, n in zip(meta.classes, meta.counts.get(split, [])):
            if split == "train" and n == 0:
                raise ValueError(
                    f"class {cls!r} has no training samples in {path}; remove the class folder from "
                    "the source tree or add images, then convert again"
                )
    return meta

def _check_split_files(split_dir: Path) -> None:
    chunks = [c["filename"] for c in read_index(split_dir)]
    missing = [c for c in chunks if not (split_dir / c).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{split_dir} lacks {len(missing)} chunk file(s) listed in its index.json "
            f"({missing[0]}, ...): the folder is half-written or damaged; convert again"
        )
    problems = check_split_files(split_dir)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptDataError(
            f"damaged streaming data: {problems[0]}{more}. Run `fastscale-data verify "
            f"{split_dir.parent}` for the full list, then convert again or restore the file(s)"
        )


INDEX_FILE = "index.json"

class CorruptDataError(RuntimeError):
    """Damaged streaming data; the message names the chunk file and, where known, the sample."""

@dataclass(frozen=True)
class Problem:
    """One damaged chunk (``sample is None``) or sample of a converted split."""

    chunk: str  # path of the chunk file
    sample: int | None  # litdata sample index in its split
    message: str

    def __str__(self) -> str:
        where = self.chunk if self.sample is None else f"{self.chunk}: sample {self.sample}"
        return f"{where}: {self.message}"

def read_index(split_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The chunk entries of a split's ``index.json`` (``filename``, ``chunk_bytes``, ``chunk_size``)."""
    index = Path(split_dir) / INDEX_FILE
    if not index.is_file():
        raise FileNotFoundError(f"{index} is missing: the conversion of {split_dir} did not finish")
    return list(json.loads(index.read_text()).get("chunks", []))

def chunk_of(chunks: list[dict[str, Any]], sample: int) -> tuple[int, dict[str, Any]]:
    """``(chunk index, chunk entry)`` holding litdata sample ``sample`` (chunks in index order)."""
    end = 0
    for i, entry in enumerate(chunks):
        end += int(entry["chunk_size"])
        if sample < end:
            return i, entry
    raise IndexError(f"sample {sample} is beyond the {end} samples of the index")

def check_chunk(path: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with one chunk file against its ``index.json`` entry (from its header alone), or None."""
    if not path.is_file():
        return "missing (listed in index.json)"
    size, expected = path.stat().st_size, int(entry["chunk_bytes"])
    if size != expected:
        return f"{size} bytes, index.json says {expected}: the file is truncated or was overwritten"
    count = int(entry["chunk_size"])
    header = 4 * (count + 2)
    with path.open("rb") as f:
        raw = f.read(header)
    if len(raw) < header:
        return f"{size} bytes cannot hold the header of {count} samples"
    stored = struct.unpack_from("<I", raw, 0)[0]
    if stored != count:
        return f"header counts {stored} samples, index.json says {count}"
    offsets = struct.unpack_from(f"<{count + 1}I", raw, 4)
    if offsets[0] != header or offsets[-1] != size:
        return f"header offsets span {offsets[0]}..{offsets[-1]}, the items lie in {header}..{size}"
    outside = next((i for i, o in enumerate(offsets) if not header <= o <= size), None)
    if outside is not None:
        return f"header offset {outside} ({offsets[outside]}) lies outside the items ({header}..{size})"
    bad = next((i for i in range(count) if offsets[i + 1] < offsets[i]), None)
    if bad is not None:
        return f"header offset {bad + 1} ({offsets[bad + 1]}) lies before offset {bad} ({offsets[bad]})"
    return None

def check_split_files(split_dir: str | os.PathLike[str]) -> list[Problem]:
    """Structural problems of every chunk of a local split (no sample is decoded)."""
    split = Path(split_dir)
    return [Problem(str(split / entry["filename"]), None, message) for entry in read_index(split)
            if (message := check_chunk(split / entry["filename"], entry)) is not None]


def image_tree_classes(root: Path) -> list[str]:
    """The classes of an ImageNet-layout tree (``root/train/<class>/*``, ``root/val/<class>/*``), checked."""
    for directory in (root / "train", root / "val"):
        if not directory.is_dir():
            raise FileNotFoundError(
                f"data directory {directory} does not exist; give root a folder holding "
                "train/<class>/*.JPEG and val/<class>/* (the ImageNet layout)"
            )
        classes = [p for p in directory.iterdir() if p.is_dir()]
        if not classes:
            raise FileNotFoundError(f"{directory} has no class sub-folders (expected {directory}/<class>/<image>)")
        for c in classes:
            if not any(f.suffix.lower() in IMG_EXTENSIONS for f in c.iterdir() if f.is_file()):
                raise FileNotFoundError(
                    f"class folder {c} holds no images ({', '.join(IMG_EXTENSIONS)}); remove it or add images"
                )
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    unknown = sorted({p.name for p in (root / "val").iterdir() if p.is_dir()} - set(classes))
    if unknown:
        raise ValueError(f"{root / 'val'} has classes not in {root / 'train'}: {unknown[:5]}")
    return classes
