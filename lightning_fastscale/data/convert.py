"""Convert an image tree (or the built-in procedural set) into the streaming format.

More in ``docs/input_pipeline.md`` ("The converted format").
"""
from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import shutil
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torchvision.datasets.folder import IMG_EXTENSIONS

from .jpeg_decode import jpeg_size
from .procedural import SHAPES, ProceduralShapes
from .stored_format import (
    METADATA_FILE,
    SIZES_KEY,
    SPLITS,
    StreamingMetadata,
    image_tree_classes,
    stored_sample_count,
)

PROCEDURAL_SOURCE = "procedural"
DEFAULT_MAX_SIDE = 512
DEFAULT_QUALITY = 90


def _encode_jpeg(image: Image.Image, max_side: int, quality: int) -> bytes:
    image = image.convert("RGB")
    longer = max(image.size)
    if longer > max_side:
        w, h = image.size
        image = image.resize(
            (max(1, round(w * max_side / longer)), max(1, round(h * max_side / longer))),
            Image.Resampling.BICUBIC, reducing_gap=3.0,
        )
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _encode_file(item: tuple[str, int, int, str], max_side: int, quality: int) -> dict[str, Any]:
    path, label, index, name = item
    try:
        with Image.open(path) as image:
            image.draft("RGB", (max_side, max_side))  # DCT-domain downscale of big JPEGs
            data = _encode_jpeg(image, max_side, quality)
    except Exception as err:  # PIL raises several types for broken files
        raise RuntimeError(f"cannot read image {path}: {err}") from err
    return {"image": data, "label": label, "index": index, "name": name}


def _encode_procedural(
    item: tuple[str, int], num_classes: int, size: int, resolution: int, seed: int,
    max_side: int, quality: int,
) -> dict[str, Any]:
    split, index = item
    dataset = ProceduralShapes(num_classes, size, resolution, seed, split, normalize=False)
    pixels = (dataset.render([index])[0] * 255).round().to(torch.uint8)
    image = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    return {
        "image": _encode_jpeg(image, max_side, quality), "label": dataset.label(index),
        "index": index, "name": f"{split}/{index}",
    }


def image_tree_samples(root: Path) -> tuple[list[str], dict[str, list[tuple[str, int, int, str]]]]:
    """Classes and ``(path, label, index, name)`` per split of an ImageNet-layout tree (checked as by `ImageFolderDataModule`)."""
    classes = image_tree_classes(root)
    samples: dict[str, list[tuple[str, int, int, str]]] = {}
    for split in SPLITS:
        split_dir = root / split
        rows = []
        for label, cls in enumerate(classes):
            folder = split_dir / cls
            if not folder.is_dir():
                continue
            for f in sorted(folder.iterdir()):
                if f.is_file() and f.suffix.lower() in IMG_EXTENSIONS:
                    rows.append((str(f), label, len(rows), f"{cls}/{f.name}"))
        samples[split] = rows
    return classes, samples


class _Counted:
    """``fn`` counting finished items in shared memory (forked writers inherit it)."""

    def __init__(self, fn: Any, counter: Any) -> None:
        self.fn, self.counter = fn, counter

    def __call__(self, item: Any) -> Any:
        out = self.fn(item)
        with self.counter.get_lock():
            self.counter.value += 1
        return out


@contextlib.contextmanager
def _progress(label: str, total: int, counter: Any | None) -> Iterator[None]:
    """One labelled progress bar on stderr, fed from ``counter`` by a thread while the block runs."""
    from tqdm.auto import tqdm

    done = threading.Event()
    with tqdm(desc=label, total=total, unit="img", mininterval=0.5) as bar:

        def follow() -> None:
            while not done.wait(0.5):
                bar.update(counter.value - bar.n)

        thread = threading.Thread(target=follow, daemon=True) if counter is not None else None
        if thread is not None:
            thread.start()
        try:
            yield
        finally:
            done.set()
            if thread is not None:
                thread.join()
        bar.update(total - bar.n)


def _optimize(
    fn: Any, inputs: list[Any], output_dir: Path, num_workers: int, chunk_bytes: str, verbose: bool, label: str
) -> None:
    import litdata

    # litdata's own output (an account advert, its start method, per-worker lines and an
    # unlabelled progress bar per call) stays off (verbose=False); this one labelled bar per
    # split replaces it. Its count crosses processes only under fork (Linux).
    fork = sys.platform == "linux"
    counter = multiprocessing.get_context("fork").Value("l", 0) if verbose and fork else None
    progress = _progress(label, len(inputs), counter) if verbose else contextlib.nullcontext()
    previous = multiprocessing.get_start_method(allow_none=True)  # litdata.optimize sets it for the process
    try:
        with progress:
            litdata.optimize(
                fn=_Counted(fn, counter) if counter is not None else fn, inputs=inputs, output_dir=str(output_dir),
                num_workers=max(1, min(num_workers, len(inputs))), chunk_bytes=chunk_bytes, reorder_files=False,
                verbose=False, start_method="fork" if fork else None,
            )
    finally:
        multiprocessing.set_start_method(previous, force=True)


def convert(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    max_side: int = DEFAULT_MAX_SIDE,
    quality: int = DEFAULT_QUALITY,
    num_workers: int | None = None,
    chunk_bytes: str = "64MB",
    procedural: dict[str, int] | None = None,
    verbose: bool = True,
) -> StreamingMetadata:
    """Write ``source`` (an ImageNet-layout root, or ``"procedural"``) as streaming data in ``output``.

    Args:
        output: new folder to write; an existing one is refused, never overwritten.
        max_side, quality: longer side (px) and JPEG quality (1-95) of the re-encoded images.
        num_workers: parallel encoder processes (default: all cores).
        chunk_bytes: litdata's chunk size.
        verbose: one progress bar per split.
        procedural: ``num_classes``, ``train_size``, ``val_size``, ``resolution``, ``seed`` of that source.

    Examples:
        >>> meta = convert("procedural", "/tmp/shapes", max_side=64,
        ...                procedural={"train_size": 64, "val_size": 16, "resolution": 64})  # doctest: +SKIP
    """
    out = Path(os.path.expanduser(str(output)))
    if out.exists():
        raise FileExistsError(
            f"output folder {out} already exists; refusing to overwrite it. Choose a new OUT "
            "folder, or delete this one yourself if it is a failed conversion."
        )
    if not 16 <= max_side <= 65500:
        raise ValueError(f"--max-side must be between 16 and 65500 pixels, got {max_side}")
    if not 1 <= quality <= 95:
        raise ValueError(f"--quality must be between 1 and 95, got {quality}")
    workers = num_workers or os.cpu_count() or 1

    if str(source) == PROCEDURAL_SOURCE:
        opts = {"num_classes": 10, "train_size": 10000, "val_size": 2000, "resolution": 64, "seed": 0,
                **(procedural or {})}
        ProceduralShapes(opts["num_classes"], 1, opts["resolution"])  # validate the options here
        classes = list(SHAPES)[: opts["num_classes"]]
        inputs = {s: [(s, i) for i in range(opts[f"{s}_size"])] for s in SPLITS}
        counts = {s: [sum(1 for i in range(opts[f"{s}_size"]) if i % opts["num_classes"] == c)
                      for c in range(opts["num_classes"])] for s in SPLITS}
        fns = {s: partial(_encode_procedural, num_classes=opts["num_classes"], size=opts[f"{s}_size"],
                          resolution=opts["resolution"], seed=opts["seed"], max_side=max_side, quality=quality)
               for s in SPLITS}
        source_text, extra = PROCEDURAL_SOURCE, {"procedural": opts}
    else:
        root = Path(os.path.expanduser(str(source)))
        classes, samples = image_tree_samples(root)
        # A tree lists its files class by class, and litdata reads a chunk at a time: written in
        # that order, a chunk holds two or three classes of ImageNet and so does every batch. The
        # stored index (what seeds augmentation) stays the file's place in the tree.
        inputs = {**samples, "train": random.Random(0).sample(samples["train"], len(samples["train"]))}
        counts = {s: [sum(1 for r in samples[s] if r[1] == c) for c in range(len(classes))] for s in SPLITS}
        fn = partial(_encode_file, max_side=max_side, quality=quality)
        fns = {s: fn for s in SPLITS}
        source_text, extra = str(root.resolve()), {}

    out.mkdir(parents=True)
    try:
        for split in SPLITS:
            _optimize(fns[split], inputs[split], out / split, workers, chunk_bytes, verbose, f"convert {split}")
        extra = {**extra, SIZES_KEY: {"val": stored_image_sizes(out / "val")}}
    except BaseException:
        # the folder is this call's own: a half-written one would only mislead the next run
        shutil.rmtree(out, ignore_errors=True)
        raise
    meta = StreamingMetadata(classes, counts, max_side, quality, source_text, extra=extra)
    (out / METADATA_FILE).write_text(json.dumps(asdict(meta), indent=1))
    return meta


def stored_image_sizes(split_dir: str | os.PathLike[str], **dataset_kwargs: Any) -> list[list[int]]:
    """``[height, width]`` of every image of a written split, in litdata's sample order, from the JPEG headers.

    The same on every rank; ``dataset_kwargs`` go to litdata's ``StreamingDataset``.
    """
    from litdata import StreamingDataset

    dataset = StreamingDataset(str(split_dir), **dataset_kwargs)
    return [list(jpeg_size(dataset[i]["image"])) for i in range(stored_sample_count(dataset))]


