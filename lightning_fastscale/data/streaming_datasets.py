"""The litdata datasets and loader behind `StreamingDataModule`, and how their errors are named.

* `DecodedStreamingDataset`: the shuffled training split, sharded across ranks by litdata;
* `ValidationBatches`: one rank's planned validation batches (`validation_plan`), yielded whole;
* `EpochAwareStreamingDataLoader`: litdata's loader, each iteration in the training epoch it serves.

A sample that cannot be read or decoded raises a
[`CorruptDataError`][lightning_fastscale.data.stored_format.CorruptDataError] naming its chunk file, its litdata
index and its source file, with the command that lists every damaged sample.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from inspect import signature
from pathlib import Path
from typing import Any

import torch
from litdata import StreamingDataLoader, StreamingDataset
from torch.utils.data import IterableDataset, default_collate, get_worker_info
from typing_extensions import override

from . import jpeg_decode, rect_val, transforms
from .jpeg_decode import SampleDecodeError
from .protocol import whole_global_batches
from .stored_format import CorruptDataError, chunk_of, read_index

# One stored sample per litdata read: by default litdata deserialises a window of neighbouring
# samples per read (sized for small leaves; a JPEG is stored as a plain "bytes" leaf), which a
# shuffled or planned order mostly throws away: at source size about 10x the cost of reading the
# one sample (benchmarks/README.md)
_ONE_SAMPLE_PER_READ = {"batch_decode": 0}
# A full permutation within each chunk: litdata versions with ``item_shuffle_window`` permute
# blocks of 256 neighbouring samples by default, and a tree converted class by class then gives
# batches of one class
_FULL_SHUFFLE = {"item_shuffle_window": 0} if "item_shuffle_window" in signature(StreamingDataset).parameters else {}

_VERIFY_HINT = "Run `fastscale-data verify ROOT` (the data folder) to list every damaged chunk and sample"


def _split_dir(dataset: StreamingDataset) -> Path:
    """The local folder of a litdata split (its cache folder for a remote one)."""
    return Path(dataset.input_dir.path or dataset.input_dir.url or "")


def _where(split_dir: Path, index: Any) -> str:
    """``"<chunk file>: sample <i>"`` of a litdata index (an int or litdata's ``ChunkedIndex``)."""
    sample = int(getattr(index, "index", index))
    try:
        _, entry = chunk_of(read_index(split_dir), sample)
    except (OSError, ValueError, IndexError):
        return f"{split_dir}: sample {sample}"
    return f"{split_dir / entry['filename']}: sample {sample}"


def _read_stored(read: Callable[[Any], Any], index: Any) -> Any:
    """``read(index)`` (litdata's item read); a failure is a ``CorruptDataError``."""
    try:
        return read(index)
    except StopIteration:
        raise
    except Exception as err:  # litdata raises struct.error, ValueError, ... on damaged chunks
        raise CorruptDataError(f"cannot read the stored sample ({type(err).__name__}: {err})") from err


def _named(dataset: StreamingDataset, index: Any, read_and_decode: Callable[[], Any]) -> Any:
    """``read_and_decode()``, a ``CorruptDataError`` prefixed with the chunk file and sample index."""
    try:
        return read_and_decode()
    except CorruptDataError as err:
        raise CorruptDataError(f"{_where(_split_dir(dataset), index)}: {err}. {_VERIFY_HINT}") from err.__cause__


@dataclass(slots=True)
class StoredSample:
    """A training sample as read from its chunk, not decoded yet (cheap to hand to the collate)."""

    jpeg: bytes
    index: int  # the stored image's index (what seeds its augmentation)
    label: int
    name: str  # its source file, for error messages
    sample: int  # its litdata index (names its chunk file in error messages; set by the dataset)
    epoch: int  # the epoch litdata read it in (seeds its augmentation)


class DecodedStreamingDataset(StreamingDataset):
    """The training split as a shuffled litdata ``StreamingDataset`` of `StoredSample` records, decoded and
    augmented a batch at a time by `batch_decoder` (``docs/input_pipeline.md``, "The streaming datasets and loader")."""

    def __init__(
        self,
        input_dir: str,
        resolution: int,
        seed: int = 0,
        scale: tuple[float, float] = transforms.DEFAULT_SCALE,
        ratio: tuple[float, float] = transforms.DEFAULT_RATIO,
        dct_scaling: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(input_dir, shuffle=True, seed=seed, drop_last=True,
                         **{**_ONE_SAMPLE_PER_READ, **_FULL_SHUFFLE, **kwargs})
        self.resolution, self.augment_seed, self.scale, self.ratio = resolution, seed, tuple(scale), tuple(ratio)
        self.dct_scaling = dct_scaling
        self.source = input_dir

    def decode(self, item: dict[str, Any]) -> Any:
        """What the loader collates for one stored sample.

        A `StoredSample`, which the collate of `batch_decoder` decodes with its batch; a
        subclass may return something else per sample (a tuple of tensors, say), which is then
        collated as ``default_collate`` does.
        """
        return StoredSample(item["image"], int(item["index"]), int(item["label"]), str(item["name"]),
                            -1, self.current_epoch)

    def batch_decoder(self, threads: int = 1, pin_memory: bool = False) -> TrainBatchDecoder:
        """The loader's collate function: decodes this dataset's batches in ``threads`` threads."""
        return TrainBatchDecoder(
            self.resolution, self.augment_seed, self.scale, self.ratio, threads, pin_memory,
            str(_split_dir(self)), self.source, self.dct_scaling,
        )

    @override
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        read = super().__getitem__
        sample = _named(self, index, lambda: self.decode(_read_stored(read, index)))
        if isinstance(sample, StoredSample):
            sample.sample = int(getattr(index, "index", index))
        return sample


@dataclass(frozen=True)
class TrainBatchDecoder:
    """Collate function of the training loader: a list of `StoredSample` -> ``(uint8 images, labels)``.

    One `transforms.train_batch` call per batch, in ``threads`` threads, into the buffer the batch
    leaves the loader in; other samples go to ``default_collate`` (``docs/input_pipeline.md``).
    """

    resolution: int
    seed: int
    scale: tuple[float, float]
    ratio: tuple[float, float]
    threads: int = 1
    pin_memory: bool = False
    split_dir: str = ""
    source: str = ""
    dct_scaling: bool = False

    def __call__(self, samples: list[Any]) -> Any:
        if not samples or not all(isinstance(s, StoredSample) for s in samples):
            return default_collate(samples)
        jpegs = [torch.frombuffer(bytearray(s.jpeg), dtype=torch.uint8) for s in samples]
        generators = [transforms.sample_generator(self.seed, s.epoch, s.index) for s in samples]
        out = self._buffer((len(samples), 3, self.resolution, self.resolution))
        try:
            images = transforms.train_batch(
                jpegs, generators, self.resolution, self.scale, self.ratio, threads=self.threads, out=out,
                dct_scaling=self.dct_scaling,
            )
        except SampleDecodeError as err:
            s = samples[err.position]
            raise CorruptDataError(
                f"{_where(Path(self.split_dir), s.sample)}: cannot decode stored image {s.index} ({s.name}) "
                f"of {self.source}: {err.message}. {_VERIFY_HINT}"
            ) from err.__cause__
        return images, torch.tensor([s.label for s in samples], dtype=torch.int64)

    def _buffer(self, shape: tuple[int, int, int, int]) -> torch.Tensor | None:
        # Pixel-interleaved (channels-last) memory, as train_batch allocates by default: the
        # decoder's output and OpenCV's resize write it directly (1.1-1.25x the images per core
        # of an NCHW buffer, benchmarks/README.md).
        n, c, h, w = shape
        if get_worker_info() is not None:
            storage = torch.UntypedStorage._new_shared(n * c * h * w)
            return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape, (c * h * w, 1, w * c, c))
        if self.pin_memory and torch.cuda.is_available():
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True, memory_format=torch.channels_last)
        return None


class ValidationBatches(IterableDataset):
    """One rank's planned validation batches, each yielded whole as ``(uint8 images, labels)`` of one shape.

    ``crop_ratio=None``: rectangular validation (`rect_val.resize_to_cover`), else resize + centre crop
    (``docs/input_pipeline.md``, "The streaming datasets and loader").
    """

    def __init__(
        self, input_dir: str, batches: list[rect_val.RectBatch], source: str,
        crop_ratio: float | None = None, threads: int = 1, **dataset_kwargs: Any,
    ) -> None:
        super().__init__()
        self.samples = StreamingDataset(input_dir, shuffle=False, **{**_ONE_SAMPLE_PER_READ, **dataset_kwargs})
        self.batches, self.source, self.crop_ratio, self.threads = batches, source, crop_ratio, threads

    def __len__(self) -> int:
        return len(self.batches)

    def decode(self, item: dict[str, Any], shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
        """``(image, label)`` of one stored sample fitted to the batch's ``(height, width)`` (from ``threads``
        threads at once). Decoded strictly: stored images were re-encoded by ``fastscale-data convert``,
        so libjpeg's "Corrupt JPEG data" means damaged storage; the error names the sample."""
        data = torch.frombuffer(bytearray(item["image"]), dtype=torch.uint8)
        try:
            image = jpeg_decode.decode_rgb_strict(data)
            if self.crop_ratio is None:
                image = rect_val.resize_to_cover(image, shape)
            else:
                image = transforms.resize_centre_crop(image, shape[0], self.crop_ratio)
        except Exception as err:  # libjpeg-turbo reports corrupt data as RuntimeError
            raise CorruptDataError(
                f"cannot decode stored image {item['index']} ({item['name']}) of {self.source}: {err}"
            ) from err
        return image, int(item["label"])

    def _decoded_batch(self, batch: rect_val.RectBatch) -> list[tuple[torch.Tensor, int]]:
        """The batch's samples, read one after the other (litdata's reader is not shared across
        threads), decoded in ``threads`` threads; the first damaged one (in batch order) raises."""
        items = [_named(self.samples, i, lambda i=i: _read_stored(self.samples.__getitem__, i)) for i in batch.indices]
        decoded: list[Any] = [None] * len(items)

        def one(k: int) -> None:
            index = batch.indices[k]
            decoded[k] = _named(self.samples, index, lambda: self.decode(items[k], batch.shape))

        error = next((err for err in transforms.map_in_threads(one, len(items), self.threads) if err is not None), None)
        if error is not None:
            raise error
        return decoded

    @override
    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for batch in self.batches[worker::workers]:
            yield default_collate(self._decoded_batch(batch))


class EpochAwareStreamingDataLoader(StreamingDataLoader):
    """litdata's loader, each iteration in the training epoch it serves.

    ``epoch()``: the 0-based training epoch, read as an iteration starts (a saved position is
    replayed only in its own epoch); ``accumulation()``: the gradient accumulation, to which an
    epoch's batches per rank are cut down. Why: ``docs/input_pipeline.md``, "The streaming datasets and loader".
    """

    def __init__(self, *args: Any, epoch: Callable[[], int] | None = None,
                 accumulation: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch, self.accumulation = epoch, accumulation

    @override
    def __len__(self) -> int:
        batches = super().__len__()
        return batches if self.accumulation is None else whole_global_batches(batches, self.accumulation())

    @override
    def __iter__(self) -> Any:
        if self.epoch is not None:
            serving = self.epoch() + 1  # litdata counts epochs from 1
            if self.restore and self.current_epoch != serving:
                self.restore = False
            if not self.restore:
                self.current_epoch = serving - 1  # litdata's fresh iteration adds one
        elif self.restore and self._num_samples_yielded_streaming >= len(self) * self.batch_size:
            self.restore = False
        end = len(self) * self.batch_size  # litdata's count of the epoch's samples taken on this rank
        if end == super().__len__() * self.batch_size:  # nothing cut: litdata ends (and counts) its epoch
            yield from super().__iter__()
            return
        for batch in super().__iter__():
            yield batch
            if self._num_samples_yielded_streaming >= end:
                return  # what litdata has left on this rank is less than a global batch

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # Unmarked, a second resume on the grid of the first would replay the epoch as that grid
        # starts it, not the restriped one (litdata's StreamingDataset.state_dict and __iter__).
        if getattr(self.dataset, "_elastic_drop_first", None) is not None:
            state["dataset"]["resume_mode"] = "elastic"
        return state
