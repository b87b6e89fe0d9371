"""JPEG decoding: TorchCodec (nvJPEG on CUDA) and simplejpeg, strict decoding, sizes from the header.

libjpeg reports recoverable damage only on file descriptor 2, which `decoder_messages` captures
(``docs/input_pipeline.md``, "`train_batch` in detail").
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import simplejpeg
import torch

from .stored_format import CorruptDataError

try:
    from torchcodec.decoders import decode_jpeg as _torchcodec_decode_jpeg

    def _decode_jpeg_rgb(data: torch.Tensor | list[torch.Tensor], device: torch.device | str = "cpu") -> Any:
        return _torchcodec_decode_jpeg(data, mode="RGB", device=device)

except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as _torchvision_decode_jpeg

    def _decode_jpeg_rgb(data: torch.Tensor | list[torch.Tensor], device: torch.device | str = "cpu") -> Any:
        return _torchvision_decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


_DECODER_WARNING = "Corrupt JPEG data"

class SampleDecodeError(CorruptDataError):
    """A sample of a batch that cannot be decoded cleanly, by its ``position`` (the caller names chunk and sample)."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(f"sample at position {position} of the batch: {message}")
        self.position, self.message = position, message

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across loader worker processes
        return type(self), (self.position, self.message)

@dataclass
class _Capture:
    """This process's capture of file descriptor 2: one reused file, a lock serialising threads' blocks."""

    pid: int
    file: Any
    lock: threading.RLock
    depth: int = 0  # blocks open in the thread holding the lock

_capture: _Capture | None = None

@contextlib.contextmanager
def decoder_messages() -> Iterator[list[str]]:
    """Collect what native code writes to file descriptor 2 meanwhile, in a one-element list after the block.

    Lines not libjpeg's go back to stderr; blocks of different threads run one at a time, and nest.
    """
    global _capture
    if _capture is None or _capture.pid != os.getpid():  # a forked worker gets its own (the parent's lock may be held by a thread it lacks)
        _capture = _Capture(os.getpid(), tempfile.TemporaryFile(), threading.RLock())
    collected: list[str] = []
    state = _capture
    with state.lock:
        sys.stderr.flush()
        outermost = state.depth == 0
        if outermost:
            saved = os.dup(2)
            os.dup2(state.file.fileno(), 2)
        start = os.fstat(state.file.fileno()).st_size
        state.depth += 1
        try:
            yield collected
        finally:
            state.depth -= 1
            sys.stderr.flush()
            if outermost:
                os.dup2(saved, 2)
                os.close(saved)
            fd = state.file.fileno()
            # pread leaves the offset the writers share at the end (an inner block reads while
            # other threads may still write)
            text = os.pread(fd, os.fstat(fd).st_size - start, start).decode(errors="replace")
            if outermost:
                os.ftruncate(fd, 0)
                os.lseek(fd, 0, os.SEEK_SET)
            collected.append(text)
            other = "".join(line for line in text.splitlines(keepends=True) if _DECODER_WARNING not in line)
            if outermost and other:
                sys.stderr.write(other)

def decoder_warnings(text: str) -> list[str]:
    """libjpeg's "Corrupt JPEG data" lines in text collected by `decoder_messages`."""
    return [line.strip() for line in text.splitlines() if _DECODER_WARNING in line]

def strict_decode(decode: Callable[[torch.Tensor], torch.Tensor], data: torch.Tensor) -> torch.Tensor:
    """``decode(data)``, raising ``ValueError`` where libjpeg only warns of corrupt data."""
    with decoder_messages() as messages:
        image = decode(data)
    warnings = decoder_warnings(messages[0])
    if warnings:
        raise ValueError(warnings[0])
    return image


def decode_rgb(data: torch.Tensor) -> torch.Tensor:
    """Decode JPEG bytes (a 1-D uint8 tensor) to a ``(3, H, W)`` uint8 RGB tensor."""
    return _decode_jpeg_rgb(data)

def decode_rgb_strict(data: torch.Tensor) -> torch.Tensor:
    """`decode_rgb`, raising ``ValueError`` where libjpeg only warns: simplejpeg, else TorchCodec under `strict_decode`."""
    try:
        return torch.from_numpy(simplejpeg.decode_jpeg(data.numpy(), "RGB", strict=True)).permute(2, 0, 1)
    except ValueError:
        return strict_decode(decode_rgb, data)


def jpeg_size(data: bytes | torch.Tensor) -> tuple[int, int]:
    """``(height, width)`` read from a JPEG's SOF header, without decoding the pixels."""
    buf = bytes(data.numpy()) if isinstance(data, torch.Tensor) else data
    i = 2
    while i + 9 < len(buf):
        if buf[i] != 0xFF:
            raise ValueError("not a JPEG stream (bad marker)")
        marker = buf[i + 1]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return int.from_bytes(buf[i + 5 : i + 7], "big"), int.from_bytes(buf[i + 7 : i + 9], "big")
        i += 2 + int.from_bytes(buf[i + 2 : i + 4], "big")
    raise ValueError("not a JPEG stream (no frame header)")

def decode_jpeg_batch_on_device(datas: Sequence[torch.Tensor], device: torch.device | str = "cuda") -> list[torch.Tensor]:
    """Decode JPEG byte tensors to ``(3, H, W)`` uint8 tensors on a CUDA device in one batched nvJPEG call."""
    if not torch.cuda.is_available():
        raise RuntimeError("nvJPEG decode needs a CUDA device; use decode_rgb on the CPU")
    return _decode_jpeg_rgb(list(datas), device=device)
