"""Where converted streaming data lives (a folder, or a URL read through litdata's cache) and the checks against it.

Layout: ``docs/input_pipeline.md`` ("The converted format").
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from .convert import stored_image_sizes
from .stored_format import METADATA_FILE, SIZES_KEY, StreamingMetadata, read_metadata

log = logging.getLogger(__name__)

REMOTE_PREFIXES = ("s3://", "gs://", "r2://", "azure://", "hf://", "local:")


def is_remote(root: str) -> bool:
    """Whether ``root`` is an object-storage URL (or litdata's ``local:`` cache-through prefix)."""
    return root.startswith(REMOTE_PREFIXES)


def read_source_metadata(root: str, cache_dir: str | None = None) -> StreamingMetadata:
    """``dataset.json`` of a local folder, or of a remote one downloaded into ``cache_dir``."""
    if not is_remote(root):
        return read_metadata(root)
    from litdata.streaming.downloader import get_downloader

    local = Path(cache_dir or tempfile.mkdtemp(prefix="fastscale-meta-")) / METADATA_FILE
    local.parent.mkdir(parents=True, exist_ok=True)
    get_downloader(root, str(local.parent), []).download_file(f"{root.rstrip('/')}/{METADATA_FILE}", str(local))
    return StreamingMetadata(**json.loads(local.read_text()))


class StreamingSource:
    """A converted streaming folder: its metadata, split locations and the checks against them.

    ``cache_dir`` and ``max_cache_size`` set litdata's local cache of a remote ``root``.

    Examples:
        >>> source = StreamingSource("/data/imagenet-512")  # doctest: +SKIP
        >>> source.check_resolution("data.resolution", 224)  # doctest: +SKIP
        >>> input_dir, litdata_kwargs = source.split("train")  # doctest: +SKIP
    """

    def __init__(self, root: str, cache_dir: str | None = None, max_cache_size: str = "50GB") -> None:
        self.root = str(root) if is_remote(str(root)) else os.path.expanduser(str(root))
        self.cache_dir, self.max_cache_size = cache_dir, max_cache_size
        self.metadata = read_source_metadata(self.root, cache_dir)
        self._val_sizes: list[list[int]] | None = None

    @property
    def remote(self) -> bool:
        """Whether the data is read through litdata's local cache."""
        return is_remote(self.root)

    def split(self, name: str) -> tuple[str, dict[str, Any]]:
        """``(input_dir, litdata keyword arguments)`` of split ``name`` ("train" or "val")."""
        if not self.remote:
            return str(Path(self.root) / name), {}
        return f"{self.root.rstrip('/')}/{name}", {"cache_dir": self.cache_dir, "max_cache_size": self.max_cache_size}

    def check_resolution(self, name: str, resolution: int) -> None:
        """Refuse a ``resolution`` (the setting called ``name``) above the stored ``max_side``."""
        max_side = self.metadata.max_side
        if resolution > max_side:
            raise ValueError(
                f"{name}={resolution} is larger than the longest side stored in {self.root} "
                f"(max_side={max_side}): images would be upsampled. Lower `{name}` or "
                f"convert again with `fastscale-data convert ... --max-side {resolution}` or more"
            )

    def check_rect_val(self) -> None:
        """Refuse rectangular validation without validation samples or with stale recorded sizes."""
        sizes = self.metadata.extra.get(SIZES_KEY, {}).get("val")
        count = self.metadata.split_size("val")
        if count == 0:
            raise ValueError(f"rect_val=True but {self.root} has no validation samples")
        if sizes is not None and len(sizes) != count:
            raise ValueError(
                f"rect_val=True: {self.root}/{METADATA_FILE} records {len(sizes)} validation "
                f"image sizes for {count} samples; the folder was changed after conversion. "
                "Convert again, or set rect_val=False"
            )

    def val_image_sizes(self) -> list[list[int]]:
        """``[height, width]`` of each validation sample in litdata order (read from the JPEG headers if not recorded)."""
        if self._val_sizes is None:
            sizes = self.metadata.extra.get(SIZES_KEY, {}).get("val")
            if sizes is None:
                log.warning(
                    "rect_val: %s/%s records no image sizes (converted by an older version); "
                    "reading them from the JPEG headers of the validation split once. Convert again "
                    "to have them recorded", self.root, METADATA_FILE,
                )
                input_dir, extra = self.split("val")
                sizes = stored_image_sizes(input_dir, **extra)
            self._val_sizes = [list(map(int, hw)) for hw in sizes]
        return self._val_sizes

    def probe_key(self) -> str:
        """What identifies this data for the loader-parallelism cache (`worker_autotune`)."""
        m = self.metadata
        return f"{self.root}|{m.split_size('train')}|{m.max_side}|{m.quality}"
