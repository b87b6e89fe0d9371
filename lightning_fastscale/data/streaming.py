"""``StreamingDataModule``: litdata streaming, fast uint8 decode, normalise on the device.

A drop-in replacement for [`ImageFolderDataModule`][lightning_fastscale.data.ImageFolderDataModule] on data
written by ``fastscale-data convert`` (`convert`): the same class list and label order,
the same training augmentation (random resized crop + flip) and validation geometry (resize,
centre crop), but

* samples come from litdata's ``StreamingDataset`` / ``StreamingDataLoader``: chunked files
  read sequentially, sharded across ranks and nodes (each rank its own shard, no sample twice
  in an epoch), from a local folder or object storage through a size-limited local cache
  (Tencent Cloud 2020 cache the data set locally); the loader's position is part of
  Lightning's checkpoint, so a run stopped mid-epoch resumes with the same next batches;
* validation runs planned batches (`ValidationBatches`): every sample exactly once
  across ranks and the same number of batches on every rank, so a distributed validation
  measures the whole split;
* workers decode with libjpeg-turbo and augment in uint8 (`fast_decode`), and the float
  conversion, normalisation and ``channels_last`` happen in `on_after_batch_transfer`,
  on the device, for any LightningModule;
* on CUDA the next batch is copied ahead on a side stream (`device_prefetch`);
* ``num_workers="auto"`` measures and caches the worker count (`worker_autotune`);
* ``rect_val=True`` validates fast.ai-style on rectangles grouped by aspect ratio instead of
  centre-cropped squares (`rect_val`, `ValidationBatches`).

It implements the batch-size/resolution protocol ([`protocol`][lightning_fastscale.data.protocol]), so ``BatchSizeRamp`` and
``ProgressiveResizing`` work on it. Throughput against ImageFolder is in ``benchmarks/README.md``.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from litdata import StreamingDataLoader, StreamingDataset
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info
from typing_extensions import override

from . import fast_decode, rect_val
from .convert import METADATA_FILE, SIZES_KEY, StreamingMetadata, read_metadata, stored_image_sizes
from .datamodules import _ResizableDataModule
from .device_prefetch import DevicePrefetcher
from .protocol import check_positive
from .verify import CorruptDataError, chunk_of, read_index, strict_decode
from .worker_autotune import WorkerCountCache, candidate_worker_counts, probe_num_workers

log = logging.getLogger(__name__)

_REMOTE_PREFIXES = ("s3://", "gs://", "r2://", "azure://", "hf://", "local:")
_VERIFY_HINT = "Run `fastscale-data verify <data.root>` to list every damaged chunk and sample"


def _quiet_litdata_info() -> None:
    # litdata logs INFO lines (its cache size, its mmap mode) for every dataset it opens: the
    # loaders, their workers and every epoch repeat them a dozen times in a short run. Its
    # warnings and errors still show; a level the user set on the "litdata" logger is kept.
    litdata_log = logging.getLogger("litdata")
    if litdata_log.level == logging.NOTSET:
        litdata_log.setLevel(logging.WARNING)


def _where(dataset: StreamingDataset, index: Any) -> str:
    """``"<chunk file>: sample <i>"`` of a litdata index (an int or litdata's ``ChunkedIndex``)."""
    sample = int(getattr(index, "index", index))
    split_dir = Path(dataset.input_dir.path or dataset.input_dir.url or "")
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
        raise CorruptDataError(f"{_where(dataset, index)}: {err}. {_VERIFY_HINT}") from err.__cause__


def _decode_stored(
    item: dict[str, Any], transform: Callable[[torch.Tensor], torch.Tensor], source: str
) -> tuple[torch.Tensor, int]:
    """``(transform(JPEG bytes), label)`` of a stored sample; a decode error names the sample.

    The decode is strict ([`verify.strict_decode`][lightning_fastscale.data.verify.strict_decode]): stored images were re-encoded by
    ``fastscale-data convert``, so libjpeg's "Corrupt JPEG data" means damaged storage, and
    training on the garbage it recovers would go unnoticed.
    """
    data = torch.frombuffer(bytearray(item["image"]), dtype=torch.uint8)
    try:
        image = strict_decode(transform, data)
    except Exception as err:  # libjpeg-turbo reports corrupt data as RuntimeError
        raise CorruptDataError(
            f"cannot decode stored image {item['index']} ({item['name']}) of {source}: {err}"
        ) from err
    return image, int(item["label"])


class DecodedStreamingDataset(StreamingDataset):
    """The training split as a shuffled litdata ``StreamingDataset`` of ``(uint8 image, label)``.

    Each sample gets a random resized crop + flip drawn from
    `sample_generator` of ``(seed, epoch, index)``,
    so the augmentation of a sample does not depend on which worker read it. The last
    incomplete batch is dropped. A sample that cannot be read or decoded raises a
    [`CorruptDataError`][lightning_fastscale.data.verify.CorruptDataError] naming its chunk file, its
    litdata index and its source file. (Validation reads by index instead:
    `ValidationBatches`.)
    """

    def __init__(
        self,
        input_dir: str,
        resolution: int,
        seed: int = 0,
        scale: tuple[float, float] = fast_decode.DEFAULT_SCALE,
        ratio: tuple[float, float] = fast_decode.DEFAULT_RATIO,
        **kwargs: Any,
    ) -> None:
        super().__init__(input_dir, shuffle=True, seed=seed, drop_last=True, **kwargs)
        self.resolution, self.augment_seed, self.scale, self.ratio = resolution, seed, tuple(scale), tuple(ratio)
        self.source = input_dir

    def decode(self, item: dict[str, Any]) -> tuple[torch.Tensor, int]:
        """Decode and augment one stored sample."""
        g = fast_decode.sample_generator(self.augment_seed, self.current_epoch, int(item["index"]))
        return _decode_stored(
            item, lambda data: fast_decode.train_transform(data, self.resolution, g, self.scale, self.ratio), self.source
        )

    @override
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self.decode(i) for i in super().__getitem__(index)]
        read = super().__getitem__
        return _named(self, index, lambda: self.decode(_read_stored(read, index)))


class ValidationBatches(IterableDataset):
    """One rank's planned validation batches, yielded whole.

    The plan (`rect_val.split_batches`) gives every rank the same number of batches and
    every sample to exactly one rank, so a distributed validation measures the whole split, as
    one process would (litdata's own loader evens ranks out by dropping the remainder instead,
    and Lightning's ``DistributedSampler`` by repeating samples).

    Each item is a finished ``(uint8 images (N, 3, H, W), labels (N,))`` batch of one shape, so
    the ``DataLoader`` runs with ``batch_size=None``; loader workers split the batches by
    position (worker ``k`` of ``n`` makes batches ``k, k + n, ...``, which the loader hands out
    in order again). Being an ``IterableDataset``, Lightning leaves it alone under DDP (it
    replaces the sampler of map-style loaders only), so the per-rank plan is what each rank
    runs. Samples are read by their litdata index through litdata's chunk reader and decoded
    (``fast_decode.decode_rgb``). With ``crop_ratio=None`` (rectangular validation, `rect_val`)
    each is resized to cover its batch's shape (`rect_val.resize_to_cover`); otherwise
    it gets the square resize + centre crop (`fast_decode.val_transform`).
    """

    def __init__(
        self, input_dir: str, batches: list[rect_val.RectBatch], source: str,
        crop_ratio: float | None = None, **dataset_kwargs: Any,
    ) -> None:
        super().__init__()
        self.samples = StreamingDataset(input_dir, shuffle=False, **dataset_kwargs)
        self.batches, self.source, self.crop_ratio = batches, source, crop_ratio

    def __len__(self) -> int:
        return len(self.batches)

    def decode(self, item: dict[str, Any], shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
        """Decode one stored sample and fit it to the batch's ``(height, width)``."""

        def transform(data: torch.Tensor) -> torch.Tensor:
            if self.crop_ratio is None:
                return rect_val.resize_to_cover(fast_decode.decode_rgb(data), shape)
            return fast_decode.val_transform(data, shape[0], self.crop_ratio)

        return _decode_stored(item, transform, self.source)

    def _read_and_decode(self, index: int, shape: tuple[int, int]) -> tuple[torch.Tensor, int]:
        return _named(self.samples, index, lambda: self.decode(_read_stored(self.samples.__getitem__, index), shape))

    @override
    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for batch in self.batches[worker::workers]:
            yield default_collate([self._read_and_decode(i, batch.shape) for i in batch.indices])


class EpochAwareStreamingDataLoader(StreamingDataLoader):
    """litdata's loader, made to start a fresh epoch after a resumed one is used up.

    After ``load_state_dict`` litdata keeps replaying the saved position until one iteration
    runs into ``StopIteration``. Lightning's fetcher stops asking once it has the epoch's
    ``len(loader)`` batches, so that never happens and the next epoch would replay the
    (empty) rest of the old one: no batches at all. When every batch of the resumed epoch
    has been handed out, the next iteration is a new epoch.
    """

    @override
    def __iter__(self) -> Any:
        if self.restore and self._num_samples_yielded_streaming >= len(self) * self.batch_size:
            self.restore = False
        yield from super().__iter__()


class StreamingDataModule(_ResizableDataModule):
    """Converted ImageNet-style data streamed with litdata; uint8 in workers, float on device.

    Args:
        root: folder (or ``s3://`` / ``gs://`` ... URL) written by ``fastscale-data convert``.
        resolution / val_resolution: training crop and validation size (val defaults to train);
            neither may exceed the stored ``max_side``.
        batch_size / val_batch_size: per-device batch sizes.
        crop_ratio: validation resize ratio (0.875: resize 256, crop 224).
        num_workers: loader processes per rank, or ``"auto"`` to measure the smallest count
            within 95% of the best on this machine (cached, see `worker_autotune`).
        pin_memory: pinned host batches (default: when CUDA is available).
        prefetch_factor: batches each worker prepares ahead.
        seed: shuffling and augmentation seed (independent of the model seed).
        channels_last: NHWC batches on the device (default: on CUDA only).
        device_prefetch: copy the next batch to the GPU while the step runs (CUDA only).
        cache_dir: local cache for a remote ``root`` (litdata default location if None).
        max_cache_size: size limit of that cache, e.g. ``"50GB"``.
        max_workers: upper bound of the ``auto`` probe (default: cores / ranks on this machine).
        num_workers_cache: JSON file of ``auto`` picks (default: user cache dir).
        rect_val: validate on rectangles (fast.ai, Howard et al. 2018): images sorted by aspect
            ratio, each batch one shape with short side ``val_resolution`` and the long side of
            its median ratio, nothing centre-cropped but the excess of each image's own ratio
            (`rect_val`). Every validation sample is seen exactly once across ranks and
            every rank gets the same number of batches (of at most ``val_batch_size``). Needs
            a model that accepts any input size (adaptive pooling, as the package's ResNets).

    ``dataset_class`` is the litdata dataset type of the training split; a subclass may
    override its ``decode`` to return something else per stored sample. ``val_batches_class`` plays that
    part for the validation batches.

    Rectangular validation orders by the image sizes that ``fastscale-data convert`` records in
    ``dataset.json``. A folder converted before they were recorded is still served: the sizes
    are then read once from the stored JPEG headers (one read of the validation split's bytes,
    no decoding, cheaper than one validation pass), with a warning saying that a new
    conversion records them; asking the user to convert a whole data set again for that would
    cost far more.

    Examples:
        >>> dm = StreamingDataModule("/data/imagenet-512", resolution=176, batch_size=256)  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
        >>> rect = StreamingDataModule("/data/imagenet-512", val_resolution=288, rect_val=True)  # doctest: +SKIP
    """

    dataset_class: type[DecodedStreamingDataset] = DecodedStreamingDataset
    val_batches_class: type[ValidationBatches] = ValidationBatches

    def __init__(
        self,
        root: str,
        resolution: int = 224,
        val_resolution: int | None = None,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        crop_ratio: float = 0.875,
        num_workers: int | str = "auto",
        pin_memory: bool | None = None,
        prefetch_factor: int | None = 2,
        seed: int = 0,
        channels_last: bool | None = None,
        device_prefetch: bool = True,
        cache_dir: str | None = None,
        max_cache_size: str = "50GB",
        max_workers: int | None = None,
        num_workers_cache: str | None = None,
        rect_val: bool = False,
    ) -> None:
        _quiet_litdata_info()
        auto = num_workers == "auto"
        if not auto and (isinstance(num_workers, bool) or not isinstance(num_workers, int)):
            raise ValueError(f"data.num_workers must be an integer >= 0 or 'auto', got {num_workers!r}")
        # Workers are not persistent: litdata gives each epoch's workers the epoch's shuffle
        # and augmentation seed when they start.
        super().__init__(
            batch_size, resolution, val_resolution, 0 if auto else num_workers, pin_memory,
            False, prefetch_factor, val_batch_size,
        )
        if not 0 < crop_ratio <= 1:
            raise ValueError(f"data.crop_ratio must be in (0, 1], got {crop_ratio}")
        self.prefetch_factor = prefetch_factor
        self.root = str(root) if _is_remote(str(root)) else os.path.expanduser(str(root))
        self.crop_ratio, self.seed = crop_ratio, seed
        self.channels_last, self.device_prefetch = channels_last, device_prefetch
        self.cache_dir, self.max_cache_size = cache_dir, max_cache_size
        self.auto_num_workers, self.max_workers = auto, max_workers
        self.num_workers_cache = num_workers_cache
        self.num_workers_probe: dict[str, Any] | None = None
        self.metadata = self._read_metadata()
        self.classes = list(self.metadata.classes)
        self.num_classes = len(self.classes)
        self._check_resolution("data.resolution", self.train_resolution)
        self._check_resolution("data.val_resolution", self.val_resolution)
        if not isinstance(rect_val, bool):
            raise ValueError(f"data.rect_val must be true or false, got {rect_val!r}")
        self.rect_val = rect_val
        self._val_sizes: list[list[int]] | None = None
        if rect_val:
            self._check_recorded_val_sizes()

    # -- metadata and checks ------------------------------------------------------------
    def _read_metadata(self) -> StreamingMetadata:
        if not _is_remote(self.root):
            return read_metadata(self.root)
        from litdata.streaming.downloader import get_downloader

        local = Path(self.cache_dir or tempfile.mkdtemp(prefix="fastscale-meta-")) / METADATA_FILE
        local.parent.mkdir(parents=True, exist_ok=True)
        get_downloader(self.root, str(local.parent), []).download_file(f"{self.root.rstrip('/')}/{METADATA_FILE}", str(local))
        return StreamingMetadata(**json.loads(local.read_text()))

    def _check_resolution(self, name: str, resolution: int) -> None:
        if resolution > self.metadata.max_side:
            raise ValueError(
                f"{name}={resolution} is larger than the longest side stored in {self.root} "
                f"(max_side={self.metadata.max_side}): images would be upsampled. Lower {name} or "
                f"convert again with `fastscale-data convert ... --max-side {resolution}` or more"
            )

    @override
    def set_train_resolution(self, resolution: int) -> None:
        check_positive("train resolution", resolution)
        self._check_resolution("train resolution", resolution)
        super().set_train_resolution(resolution)

    @override
    def set_val_resolution(self, resolution: int) -> None:
        check_positive("validation resolution", resolution)
        self._check_resolution("validation resolution", resolution)
        super().set_val_resolution(resolution)

    def _check_recorded_val_sizes(self) -> None:
        sizes = self.metadata.extra.get(SIZES_KEY, {}).get("val")
        count = self.metadata.split_size("val")
        if count == 0:
            raise ValueError(f"data.rect_val=true but {self.root} has no validation samples")
        if sizes is not None and len(sizes) != count:
            raise ValueError(
                f"data.rect_val=true: {self.root}/{METADATA_FILE} records {len(sizes)} validation "
                f"image sizes for {count} samples; the folder was changed after conversion. "
                "Convert again, or set data.rect_val=false"
            )

    def val_image_sizes(self) -> list[list[int]]:
        """``[height, width]`` of each validation sample in litdata order (read once if not recorded)."""
        if self._val_sizes is None:
            sizes = self.metadata.extra.get(SIZES_KEY, {}).get("val")
            if sizes is None:
                log.warning(
                    "data.rect_val: %s/%s records no image sizes (converted by an older version); "
                    "reading them from the JPEG headers of the validation split once. Convert again "
                    "to have them recorded", self.root, METADATA_FILE,
                )
                input_dir, extra = self._split_source("val")
                sizes = stored_image_sizes(input_dir, **extra)
            self._val_sizes = [list(map(int, hw)) for hw in sizes]
        return self._val_sizes

    # -- datasets and loaders -----------------------------------------------------------
    def _split_source(self, split: str) -> tuple[str, dict[str, Any]]:
        input_dir = f"{self.root.rstrip('/')}/{split}" if _is_remote(self.root) else str(Path(self.root) / split)
        extra: dict[str, Any] = {}
        if _is_remote(self.root):
            extra = {"cache_dir": self.cache_dir, "max_cache_size": self.max_cache_size}
        return input_dir, extra

    def train_dataset(self) -> DecodedStreamingDataset:
        """A fresh litdata dataset of the training split at the current resolution."""
        input_dir, extra = self._split_source("train")
        return self.dataset_class(input_dir, resolution=self.train_resolution, seed=self.seed, **extra)

    def _streaming_loader(self, dataset: StreamingDataset, batch_size: int, num_workers: int) -> StreamingDataLoader:
        loader = EpochAwareStreamingDataLoader(
            dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if num_workers > 0 else None,
        )
        return loader

    def _device(self) -> torch.device:
        trainer = getattr(self, "trainer", None)
        return trainer.strategy.root_device if trainer is not None else torch.device("cpu")

    def _wrap(self, loader: StreamingDataLoader) -> Any:
        device = self._device()
        return DevicePrefetcher(loader, device) if self.device_prefetch and device.type == "cuda" else loader

    @override
    def train_dataloader(self) -> Any:
        loader = self._streaming_loader(self.train_dataset(), self.train_batch_size, self.num_workers)
        # A new loader per reload (batch size or resolution changed) must still see the
        # trainer's epoch, which seeds litdata's shuffle and the augmentation.
        trainer = getattr(self, "trainer", None)
        loader.current_epoch = trainer.current_epoch if trainer is not None else 0
        return self._wrap(loader)

    def _rank_and_world_size(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def rect_val_batches(self) -> list[rect_val.RectBatch]:
        """This rank's rectangular validation batches at the current resolution and batch size."""
        rank, world_size = self._rank_and_world_size()
        sizes = self.val_image_sizes()
        if len(sizes) < world_size:
            raise ValueError(
                f"data.rect_val=true needs at least one validation sample per rank: {self.root} has "
                f"{len(sizes)} for {world_size} ranks; set data.rect_val=false"
            )
        plan = rect_val.plan_batches(
            sizes, self.val_batch_size, self.val_resolution, world_size, self.metadata.max_side
        )
        mine = rect_val.rank_batches(plan, rank, world_size)
        log.info(
            "data.rect_val: %d validation batches on rank %d of %d, %d shapes from %s to %s",
            len(mine), rank, world_size, len({b.shape for b in plan}), plan[0].shape, plan[-1].shape,
        )
        return mine

    def square_val_batches(self) -> list[rect_val.RectBatch]:
        """This rank's square validation batches: a contiguous range of the split (each rank
        reads its own chunks), the same number of batches on every rank."""
        rank, world_size = self._rank_and_world_size()
        count = self.metadata.split_size("val")
        if 0 < count < world_size:
            raise ValueError(
                f"{self.root} has {count} validation samples for {world_size} ranks; every rank needs "
                "at least one. Validate on fewer ranks, or set trainer.limit_val_batches=0"
            )
        if count == 0:
            return []
        batches = rect_val.split_batches(range(count), self.val_batch_size, world_size)
        per_rank = len(batches) // world_size
        shape = (self.val_resolution, self.val_resolution)
        return [rect_val.RectBatch(tuple(b), shape) for b in batches[rank * per_rank : (rank + 1) * per_rank]]

    @override
    def val_dataloader(self) -> Any:
        # Planned batches rather than litdata's loader: every sample exactly once across ranks.
        input_dir, extra = self._split_source("val")
        if self.rect_val:
            batches = self.val_batches_class(input_dir, self.rect_val_batches(), self.root, **extra)
        else:
            batches = self.val_batches_class(
                input_dir, self.square_val_batches(), self.root, crop_ratio=self.crop_ratio, **extra
            )
        loader = DataLoader(
            batches, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
        )
        return self._wrap(loader)

    # -- num_workers: auto --------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        if self.auto_num_workers and self.num_workers_probe is None:
            self.num_workers = self.resolve_num_workers()

    def _local_ranks(self) -> int:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1
        return max(1, trainer.world_size // max(1, trainer.num_nodes))

    def resolve_num_workers(self) -> int:
        """Measure (or read from the cache) the worker count for this machine and setting."""
        local_ranks = self._local_ranks()
        max_workers = self.max_workers or max(1, (os.cpu_count() or 1) // local_ranks)
        cache = WorkerCountCache(self.num_workers_cache)
        meta_id = f"{self.root}|{self.metadata.split_size('train')}|{self.metadata.max_side}|{self.metadata.quality}"
        key = cache.key(meta_id, self.train_resolution, self.train_batch_size, local_ranks)
        hit = cache.get(key)
        if hit is not None:
            self.num_workers_probe = {**hit, "cached": True}
            log.info("data.num_workers=auto: %d (cached in %s)", hit["num_workers"], cache.path)
            return int(hit["num_workers"])

        def make_loader(n: int) -> StreamingDataLoader:
            return self._streaming_loader(self.train_dataset(), self.train_batch_size, n)

        pick, curve = probe_num_workers(make_loader, candidate_worker_counts(max_workers), self.train_batch_size)
        cache.put(key, pick, curve)
        self.num_workers_probe = {"num_workers": pick, "images_per_s": curve, "cached": False}
        log.info(
            "data.num_workers=auto: %d (images/s by workers: %s; cached in %s)",
            pick, ", ".join(f"{n}: {r:.0f}" for n, r in curve.items()), cache.path,
        )
        return pick

    # -- on the device ------------------------------------------------------------------
    def model_input(self, images: torch.Tensor) -> torch.Tensor:
        """A uint8 image batch normalised to float on its device (``channels_last`` as set);
        a float batch (already normalised) as it is."""
        if images.dtype != torch.uint8:
            return images
        channels_last = images.is_cuda if self.channels_last is None else self.channels_last
        return fast_decode.normalize_on_device(images, channels_last=channels_last)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning also hands this hook a bare input tensor: the module's
        # ``example_input_array`` on its way to the model summary's forward pass.
        if isinstance(batch, torch.Tensor):
            return self.model_input(batch)
        images, labels = batch
        return self.model_input(images), labels

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "num_workers": self.num_workers}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # A resumed run keeps the worker count its loader state was saved with.
        if "num_workers" in state_dict:
            self.num_workers = state_dict["num_workers"]
            self.num_workers_probe = {"num_workers": self.num_workers, "from_checkpoint": True}


def _is_remote(root: str) -> bool:
    return root.startswith(_REMOTE_PREFIXES)
