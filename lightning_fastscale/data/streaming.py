"""``StreamingDataModule``: litdata streaming, fast uint8 decode, normalise on the device.

A drop-in replacement for [`ImageFolderDataModule`][lightning_fastscale.data.ImageFolderDataModule]
on data written by ``fastscale-data convert``: the same classes, augmentation and validation
geometry, read from litdata chunks (sharded across ranks, resumable mid-epoch), decoded in
uint8 a batch at a time, normalised on the device. It implements the batch-size/resolution
[`protocol`][lightning_fastscale.data.protocol]. What each stage does: ``docs/input_pipeline.md``
("What `StreamingDataModule` does").
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from litdata import StreamingDataLoader, StreamingDataset
from torch.utils.data import DataLoader
from typing_extensions import override

from . import transforms, validation_plan
from .background_loader import BackgroundStreamingDataLoader
from .datamodules import _ResizableDataModule
from .device_prefetch import DevicePrefetcher
from .protocol import check_positive
from .rect_val import RectBatch
from .streaming_datasets import DecodedStreamingDataset, EpochAwareStreamingDataLoader, ValidationBatches
from .streaming_source import StreamingSource
from .worker_autotune import WorkerCountCache, cores_per_rank, resolve_num_workers, threads_per_worker
from .worker_start import worker_context

__all__ = [
    "BackgroundStreamingDataLoader", "DecodedStreamingDataset", "EpochAwareStreamingDataLoader",
    "StreamingDataModule", "ValidationBatches",
]


class StreamingDataModule(_ResizableDataModule):
    """Converted ImageNet-style data streamed with litdata; uint8 in workers, float on device.

    Args:
        root: folder (or ``s3://`` / ``gs://`` ... URL) written by ``fastscale-data convert``.
        resolution / val_resolution: training crop and validation size (val defaults to train);
            neither may exceed the stored ``max_side``.
        batch_size / val_batch_size: per-device batch sizes.
        crop_ratio: validation resize ratio (0.875: resize 256, crop 224).
        num_workers: loader processes per rank (0: decode in the training process), or ``"auto"``
            to measure the smallest count within 95% of the best on this machine, each count with
            the decode threads that fill the rank's cores (cached, see `worker_autotune`).
        pin_memory: pinned host batches (default: when CUDA is available).
        prefetch_factor: batches each worker prepares ahead (with ``num_workers=0``: batches
            the training process reads and decodes ahead, up to that many decoding at once,
            default 2).
        seed: shuffling and augmentation seed (independent of the model seed).
        channels_last: NHWC batches on the device (default: on CUDA only).
        device_prefetch: copy the next batch to the GPU while the step runs (CUDA only).
        cache_dir: local cache for a remote ``root`` (litdata default location if None).
        max_cache_size: size limit of that cache, e.g. ``"50GB"``.
        max_workers: cores per rank that ``auto`` settings may use, workers x decode threads
            (default: cores / ranks on this machine).
        num_workers_cache: JSON file of ``auto`` picks (default: user cache dir).
        rect_val: validate on rectangles grouped by aspect ratio (fast.ai, Howard et al. 2018), every
            sample once across ranks; needs a model that accepts any input size (`rect_val`).
        decode_threads: threads decoding each training batch (and each validation batch's samples) in
            its loader process; ``"auto"``: the probe's, else those filling the rank's cores.
        dct_scaling: decode a training image at 1/2, 1/4 or 1/8 scale where its crop allows
            (`transforms.train_batch`); off by default, the recipes were validated without it.
        multiprocessing_context: how loader workers start (`worker_start`): from a fork server by
            default, so the training script needs an ``if __name__ == "__main__":`` guard; ``None``:
            Python's default (``fork`` on Linux before 3.14, which can deadlock beside gloo's threads).

    Each setting in full: ``docs/input_pipeline.md``. ``dataset_class`` / ``val_batches_class``: the training
    dataset and validation batch types; a subclass's ``decode`` may return something else per stored sample.

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
        decode_threads: int | str = "auto",
        dct_scaling: bool = False,
        multiprocessing_context: str | None = "forkserver",
    ) -> None:
        # litdata logs INFO lines (its cache size, its mmap mode) for every dataset it opens: the
        # loaders, their workers and every epoch repeat them a dozen times in a short run. Its
        # warnings and errors still show; a level the user set on the "litdata" logger is kept.
        if logging.getLogger("litdata").level == logging.NOTSET:
            logging.getLogger("litdata").setLevel(logging.WARNING)
        auto = num_workers == "auto"
        if not auto and (isinstance(num_workers, bool) or not isinstance(num_workers, int)):
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0 or 'auto'")
        # Workers are not persistent: litdata sets the epoch (its shuffle, and the augmentation
        # seed of every sample) on the dataset when an epoch's iteration starts, in this
        # process, and workers see it only through the copy they start with; persistent
        # workers would repeat the first epoch's order and crops. A restart costs an epoch
        # about one batch's decode latency (benchmarks/streaming_loader.py: ~0.1 s with two
        # workers against minutes for an ImageNet epoch per rank, ~0.1%), and a batch-size
        # or resolution change builds a new loader anyway.
        super().__init__(
            batch_size, resolution, val_resolution, 0 if auto else num_workers, pin_memory,
            False, prefetch_factor, val_batch_size, multiprocessing_context,
        )
        if not 0 < crop_ratio <= 1:
            raise ValueError(f"crop_ratio={crop_ratio} must be in (0, 1]")
        if not isinstance(rect_val, bool):
            raise ValueError(f"rect_val={rect_val!r} must be True or False")
        if not isinstance(dct_scaling, bool):
            raise ValueError(f"dct_scaling={dct_scaling!r} must be True or False")
        if decode_threads != "auto" and (
            isinstance(decode_threads, bool) or not isinstance(decode_threads, int) or decode_threads < 1
        ):
            raise ValueError(f"decode_threads={decode_threads!r} must be an integer >= 1 or 'auto'")
        self.prefetch_factor = prefetch_factor
        self.source = StreamingSource(root, cache_dir, max_cache_size)
        self.root, self.metadata = self.source.root, self.source.metadata
        self.crop_ratio, self.seed, self.rect_val, self.dct_scaling = crop_ratio, seed, rect_val, dct_scaling
        self.channels_last, self.device_prefetch = channels_last, device_prefetch
        self.cache_dir, self.max_cache_size = cache_dir, max_cache_size
        self.auto_num_workers, self.max_workers = auto, max_workers
        self.num_workers_cache = num_workers_cache
        self.decode_threads: int | None = None if decode_threads == "auto" else decode_threads  # None: auto
        self.num_workers_probe: dict[str, Any] | None = None
        self.classes = list(self.metadata.classes)
        self.num_classes = len(self.classes)
        self.source.check_resolution("resolution", self.train_resolution)
        self.source.check_resolution("val_resolution", self.val_resolution)
        if rect_val:
            self.source.check_rect_val()

    # -- the protocol -------------------------------------------------------------------
    @override
    def set_train_resolution(self, resolution: int) -> None:
        check_positive("train resolution", resolution)
        self.source.check_resolution("train resolution", resolution)
        super().set_train_resolution(resolution)

    @override
    def set_val_resolution(self, resolution: int) -> None:
        check_positive("validation resolution", resolution)
        self.source.check_resolution("validation resolution", resolution)
        super().set_val_resolution(resolution)

    # -- where the trainer runs ---------------------------------------------------------
    def _device(self) -> torch.device:
        trainer = getattr(self, "trainer", None)
        return trainer.strategy.root_device if trainer is not None else torch.device("cpu")

    def _rank_and_world_size(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.global_rank, trainer.world_size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _local_ranks(self) -> int:
        trainer = getattr(self, "trainer", None)
        return 1 if trainer is None else max(1, trainer.world_size // max(1, trainer.num_nodes))

    # -- training -----------------------------------------------------------------------
    def train_dataset(self) -> DecodedStreamingDataset:
        """A fresh litdata dataset of the training split at the current resolution."""
        input_dir, extra = self.source.split("train")
        return self.dataset_class(
            input_dir, resolution=self.train_resolution, seed=self.seed, dct_scaling=self.dct_scaling, **extra
        )

    def _streaming_loader(
        self, dataset: StreamingDataset, batch_size: int, num_workers: int, threads: int,
        epoch: Callable[[], int] | None = None, accumulation: Callable[[], int] | None = None,
    ) -> StreamingDataLoader:
        collate = dataset.batch_decoder(threads, self.pin_memory) if isinstance(dataset, DecodedStreamingDataset) else None
        if num_workers == 0:  # read and decoded on background threads of this process, a queue ahead
            return BackgroundStreamingDataLoader(
                dataset, batch_size=batch_size, pin_memory=self.pin_memory, collate_fn=collate,
                batches_ahead=2 if self.prefetch_factor is None else self.prefetch_factor, epoch=epoch,
                accumulation=accumulation,
            )
        return EpochAwareStreamingDataLoader(
            dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor, collate_fn=collate, epoch=epoch, accumulation=accumulation,
            multiprocessing_context=worker_context(self.multiprocessing_context, dataset, num_workers),
        )

    def resolved_decode_threads(self) -> int:
        """Decode threads per loader process: as set, or (``auto``) those filling this rank's cores
        with ``num_workers`` processes, the threads the ``num_workers="auto"`` probe gave each count."""
        if self.decode_threads is not None:
            return self.decode_threads
        return threads_per_worker(cores_per_rank(self._local_ranks(), self.max_workers), self.num_workers)

    def _wrap(self, loader: StreamingDataLoader | DataLoader) -> Any:
        device = self._device()
        return DevicePrefetcher(loader, device) if self.device_prefetch and device.type == "cuda" else loader

    @override
    def train_dataloader(self) -> Any:
        # The trainer's epoch, read as each epoch's iteration starts, seeds litdata's shuffle and
        # the augmentation: also in a loader rebuilt (batch size, resolution) or resumed. Its
        # accumulation (set by a carried resume or a BatchSizeRamp after this loader is built)
        # cuts each epoch to whole global batches.
        trainer = getattr(self, "trainer", None)
        loader = self._streaming_loader(
            self.train_dataset(), self.train_batch_size, self.num_workers, self.resolved_decode_threads(),
            epoch=None if trainer is None else lambda: trainer.current_epoch,
            accumulation=None if trainer is None else lambda: trainer.accumulate_grad_batches,
        )
        return self._wrap(loader)

    @override
    def setup(self, stage: str) -> None:
        if self.auto_num_workers and self.num_workers_probe is None:
            self.num_workers = self.resolve_num_workers()

    def resolve_num_workers(self) -> int:
        """Measure (or read from the cache) the worker count, and with ``decode_threads="auto"``
        the decode threads, for this machine and setting."""
        pick, _, self.num_workers_probe = resolve_num_workers(
            lambda n, t: self._streaming_loader(self.train_dataset(), self.train_batch_size, n, t),
            WorkerCountCache(self.num_workers_cache), self.source.probe_key(),
            self.train_resolution, self.train_batch_size, self._local_ranks(), self.max_workers,
            self.decode_threads,
        )
        return pick

    # -- validation ---------------------------------------------------------------------
    def val_image_sizes(self) -> list[list[int]]:
        """``[height, width]`` of each validation sample in litdata order (read once if not recorded)."""
        return self.source.val_image_sizes()

    def rect_val_batches(self) -> list[RectBatch]:
        """This rank's rectangular validation batches at the current resolution and batch size."""
        rank, world_size = self._rank_and_world_size()
        return validation_plan.rect_rank_batches(
            self.val_image_sizes(), self.val_batch_size, self.val_resolution, rank, world_size,
            self.metadata.max_side, self.root,
        )

    def square_val_batches(self) -> list[RectBatch]:
        """This rank's square validation batches: a contiguous range of the split (each rank
        reads its own chunks), the same number of batches on every rank."""
        rank, world_size = self._rank_and_world_size()
        return validation_plan.square_rank_batches(
            self.metadata.split_size("val"), self.val_batch_size, self.val_resolution, rank, world_size, self.root,
        )

    @override
    def val_dataloader(self) -> Any:
        # Planned batches rather than litdata's loader: every sample exactly once across ranks.
        input_dir, extra = self.source.split("val")
        threads = self.resolved_decode_threads()  # as the training batches: the rank's cores
        plan, crop_ratio = (self.rect_val_batches(), None) if self.rect_val else (self.square_val_batches(), self.crop_ratio)
        batches = self.val_batches_class(input_dir, plan, self.root, crop_ratio=crop_ratio, threads=threads, **extra)
        loader = DataLoader(
            batches, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            multiprocessing_context=worker_context(self.multiprocessing_context, batches, self.num_workers),
        )
        return self._wrap(loader)

    # -- on the device ------------------------------------------------------------------
    def model_input(self, images: torch.Tensor) -> torch.Tensor:
        """A uint8 image batch normalised to float on its device (``channels_last`` as set);
        a float batch (already normalised) as it is."""
        if images.dtype != torch.uint8:
            return images
        channels_last = images.is_cuda if self.channels_last is None else self.channels_last
        return transforms.normalize_on_device(images, channels_last=channels_last)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning also hands this hook a bare input tensor: the module's
        # ``example_input_array`` on its way to the model summary's forward pass.
        if isinstance(batch, torch.Tensor):
            return self.model_input(batch)
        images, labels = batch
        return self.model_input(images), labels

    # -- checkpoint ---------------------------------------------------------------------
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
