"""Atomic checkpoint writes on the destination's own filesystem.

More in ``docs/faults.md`` ("Atomic checkpoint writes").
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fsspec
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # a folder that cannot be opened or synced (some network filesystems): best effort
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_atomically(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` such that ``path`` is either the old file or the whole new one (temporary file, fsync, rename).

    Examples:
        >>> import tempfile, torch
        >>> folder = tempfile.mkdtemp()
        >>> save_atomically({"w": torch.ones(2)}, f"{folder}/last.ckpt")
        >>> torch.load(f"{folder}/last.ckpt")["w"]
        tensor([1., 1.])
    """
    path = Path(path)
    # serialized in memory first (as Lightning does): a write error is then a plain OSError,
    # not torch's zip writer failing on its own end-of-file record
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PARTIAL_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp_name, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp_name)
        if isinstance(err, OSError) and err.errno is not None:
            kept = " (the existing file is kept)" if path.exists() else ""
            raise OSError(err.errno, f"{err.strerror}: cannot write checkpoint {path}{kept}") from err
        raise
    _fsync_folder(path.parent)


def files_in(folders: Iterable[str | os.PathLike], pattern: str) -> list[Path]:
    """The files matching ``pattern`` in those of ``folders`` that exist (not recursive), by name in each folder."""
    return [p for folder in map(Path, folders) if folder.is_dir() for p in sorted(folder.glob(pattern)) if p.is_file()]


def partial_files(folders: Iterable[str | os.PathLike]) -> list[Path]:
    """Temporary files of `save_atomically` left in ``folders`` by a killed writer."""
    return files_in(folders, f".*{PARTIAL_SUFFIX}")


def remove_partial_files(folders: Iterable[str | os.PathLike]) -> list[Path]:
    """Delete (with a warning each) and return the `partial_files` of run folders this process owns (`run_folder_lock`)."""
    removed = []
    for path in partial_files(folders):
        try:  # ranks of one run may clear the same folder at once
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        log.warning("removing %s (%d bytes): a checkpoint write cut short by a killed process", path, size)
        removed.append(path)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic local writes (`save_atomically`); ``fastscale-train`` installs it.

    Examples:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(plugins=[AtomicCheckpointIO()], accelerator="cpu", logger=False)
        >>> type(trainer.strategy.checkpoint_io).__name__
        'AtomicCheckpointIO'
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or fsspec.utils.get_protocol(str(path)) != "file":
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        save_atomically(checkpoint, path)
