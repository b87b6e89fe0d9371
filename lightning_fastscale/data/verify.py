"""Check converted streaming data: every chunk's structure, every sample's JPEG.

A converted split is litdata's ``index.json`` plus chunk files, each laid out as
``uint32 num_items | uint32 offsets[num_items + 1] | item bytes``; the index records each
chunk's byte size and item count. Three kinds of damage are found here, each named by chunk
file and sample index:

* a chunk whose size differs from the index (truncated copy, full disk): litdata itself would
  wait for the rest of the file and then time out as for a hung download;
* a chunk header whose count or offsets disagree with the index or with the file
  (overwritten bytes): litdata would fail with a bare ``struct.error`` or read garbage;
* a stored JPEG that does not decode cleanly (flipped bits): libjpeg recovers from most such
  damage with only a "Corrupt JPEG data" line on stderr, so [`strict_decode`][lightning_fastscale.data.verify.strict_decode] turns that
  line into an error. Damage that leaves a valid entropy code (a flipped bit the format cannot
  detect) is not detectable without checksums.

[`check_split_files`][lightning_fastscale.data.verify.check_split_files] is the structural check alone, cheap enough (the first bytes of each
chunk) to run before every training run; [`verify`][lightning_fastscale.data.verify.verify] adds the decode of every sample
(``fastscale-data verify OUT``).
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "index.json"
_DECODER_WARNING = "Corrupt JPEG data"


class CorruptDataError(RuntimeError):
    """Damaged streaming data; the message names the chunk file and, where known, the sample."""


class SampleDecodeError(CorruptDataError):
    """A sample of a batch that cannot be decoded cleanly, by its ``position`` in the batch.

    Raised by ``transforms.train_batch``, which knows only the bytes; the caller knows which
    chunk and sample sit at ``position`` and names them.
    """

    def __init__(self, position: int, message: str) -> None:
        super().__init__(f"sample at position {position} of the batch: {message}")
        self.position, self.message = position, message

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across loader worker processes
        return type(self), (self.position, self.message)


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
    """What is wrong with one chunk file against its ``index.json`` entry, or None.

    Reads only the header: the item count and the offsets (each within the file, in order,
    the first right after the header, the last at the end of the file).
    """
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
    problems = []
    for entry in read_index(split):
        path = split / entry["filename"]
        message = check_chunk(path, entry)
        if message is not None:
            problems.append(Problem(str(path), None, message))
    return problems


@dataclass
class _Capture:
    """This process's capture of file descriptor 2: one reused file; the lock serialises the
    blocks of different threads (the descriptor is one per process) and lets a thread nest them."""

    pid: int
    file: Any
    lock: threading.RLock
    depth: int = 0  # blocks open in the thread holding the lock


_capture: _Capture | None = None


def _capture_state() -> _Capture:
    global _capture
    if _capture is None or _capture.pid != os.getpid():  # a forked worker gets its own
        _capture = _Capture(os.getpid(), tempfile.TemporaryFile(), threading.RLock())
    return _capture


def _forget_capture() -> None:  # the parent's lock may have been held by a thread the child lacks
    global _capture
    _capture = None


os.register_at_fork(after_in_child=_forget_capture)


@contextlib.contextmanager
def decoder_messages() -> Iterator[list[str]]:
    """Collect what native code writes to this process's stderr (file descriptor 2) meanwhile.

    libjpeg reports recoverable damage only there. The collected text is yielded as a
    one-element list after the block; lines that are not libjpeg's are written back to stderr
    when the outermost block ends. Costs a few system calls per block (one reused capture file
    per process). The descriptor is one per process, so blocks in different threads run one at
    a time, and a block captures what every thread writes meanwhile (which is how a batch
    decoded in a thread pool is checked); a block nested in another of the same thread collects
    its own part, which the outer block collects too.
    """
    collected: list[str] = []
    state = _capture_state()
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
    """libjpeg's "Corrupt JPEG data" lines in text collected by [`decoder_messages`][lightning_fastscale.data.verify.decoder_messages]."""
    return [line.strip() for line in text.splitlines() if _DECODER_WARNING in line]


def strict_decode(decode: Callable[[torch.Tensor], torch.Tensor], data: torch.Tensor) -> torch.Tensor:
    """``decode(data)``, raising ``ValueError`` where libjpeg only warns of corrupt data."""
    with decoder_messages() as messages:
        image = decode(data)
    warnings = decoder_warnings(messages[0])
    if warnings:
        raise ValueError(warnings[0])
    return image


def verify_split(split_dir: str | os.PathLike[str], decode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[int, list[Problem]]:
    """``(samples checked, problems)`` of one split: every chunk's structure, then every
    sample of the sound chunks read through litdata and decoded strictly."""
    from litdata import StreamingDataset

    from .transforms import decode_rgb

    decode = decode or decode_rgb
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
                    strict_decode(decode, torch.frombuffer(bytearray(item["image"]), dtype=torch.uint8))
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
    from .convert import SPLITS

    checked, problems = 0, []
    for split in SPLITS:
        n, found = verify_split(Path(root) / split)
        checked += n
        problems += found
    return checked, problems
