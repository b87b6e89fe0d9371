"""Datamodules of the built-in procedural dataset and of the ImageNet directory layout.

Both implement `protocol`, so a batch-size ramp and progressive resizing work on them.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from .procedural import ProceduralShapes
from .protocol import check_positive
from .stored_format import image_tree_classes
from .transforms import IMAGENET_MEAN, IMAGENET_STD, crop_resize_flip, draw_crop, sample_generator
from .worker_start import check_start_method, worker_context


class _ResizableDataModule(pl.LightningDataModule):
    """Shared loader settings and the batch-size/resolution protocol."""

    def __init__(
        self,
        batch_size: int,
        resolution: int,
        val_resolution: int | None,
        num_workers: int,
        pin_memory: bool | None,
        persistent_workers: bool,
        prefetch_factor: int | None,
        val_batch_size: int | None,
        multiprocessing_context: str | None,
    ) -> None:
        super().__init__()
        self.train_batch_size = check_positive("batch_size", batch_size)
        self.val_batch_size = check_positive("val_batch_size", val_batch_size or batch_size)
        self.train_resolution = check_positive("resolution", resolution)
        self.val_resolution = check_positive("val_resolution", val_resolution or resolution)
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.num_workers = num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.prefetch_factor = prefetch_factor if num_workers > 0 else None
        self.multiprocessing_context = check_start_method(multiprocessing_context)

    def set_train_batch_size(self, per_device_batch_size: int) -> None:
        """Use ``per_device_batch_size`` from the next ``train_dataloader()`` on."""
        self.train_batch_size = check_positive("per-device batch size", per_device_batch_size)

    def set_train_resolution(self, resolution: int) -> None:
        """Produce ``resolution``-pixel training images from the next ``train_dataloader()`` on."""
        self.train_resolution = check_positive("train resolution", resolution)

    def set_val_resolution(self, resolution: int) -> None:
        """Produce ``resolution``-pixel validation images from the next ``val_dataloader()`` on."""
        self.val_resolution = check_positive("validation resolution", resolution)

    def _loader(self, dataset: Dataset, batch_size: int, shuffle: bool, loader: type = DataLoader, **extra: Any) -> DataLoader:
        return loader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor,
            multiprocessing_context=worker_context(self.multiprocessing_context, dataset, self.num_workers),
            **extra,
        )

    _STATE = ("train_batch_size", "train_resolution", "val_resolution")

    def state_dict(self) -> dict[str, Any]:
        """Batch size and resolutions in force, so a resumed run continues with them."""
        return {key: getattr(self, key) for key in self._STATE}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` saved."""
        for key in self._STATE:
            setattr(self, key, state_dict[key])


class ProceduralDataModule(_ResizableDataModule):
    """The built-in default: `ProceduralShapes` train and val splits, no files needed.

    ``seed``, ``noise``, ``clutter``: as in `ProceduralShapes`; ``val_*`` default to the training values;
    ``multiprocessing_context``: how loader workers start, as in `StreamingDataModule`.
    """

    def __init__(
        self,
        num_classes: int = 10,
        train_size: int = 10000,
        val_size: int = 2000,
        resolution: int = 32,
        val_resolution: int | None = None,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        seed: int = 0,
        noise: float = 0.06,
        clutter: int = 3,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        prefetch_factor: int | None = 2,
        multiprocessing_context: str | None = "forkserver",
    ) -> None:
        super().__init__(
            batch_size, resolution, val_resolution, num_workers, pin_memory,
            persistent_workers, prefetch_factor, val_batch_size, multiprocessing_context,
        )
        # Build once so bad settings fail here, before any training step.
        self.train_set = ProceduralShapes(num_classes, train_size, resolution, seed, "train", noise, clutter)
        self.val_set = ProceduralShapes(num_classes, val_size, self.val_resolution, seed, "val", noise, clutter)
        self.num_classes = num_classes

    def train_dataloader(self) -> DataLoader:
        self.train_set.set_resolution(self.train_resolution)
        return self._loader(self.train_set, self.train_batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        self.val_set.set_resolution(self.val_resolution)
        return self._loader(self.val_set, self.val_batch_size, shuffle=False)


class ImageFolderDataModule(_ResizableDataModule):
    """ImageNet directory layout: ``root/train/<class>/*.JPEG`` and ``root/val/<class>/*``.

    Random resized crop and flip for training (Szegedy et al. 2015, torchvision's scale and
    ratio), drawn from `sample_generator` of ``(seed, epoch, index)``: a sample's crop does not
    depend on the rank or loader worker that reads it (``seed``: the augmentation's; the
    shuffle is the sampler's). Validation resizes to ``val_resolution /
    crop_ratio`` and centre-crops (0.875: resize 256, crop 224). Errors name the missing or
    unreadable path. ``multiprocessing_context``: how loader workers start, as in `StreamingDataModule`.

    Examples:
        >>> dm = ImageFolderDataModule("/datasets/imagenet", batch_size=256, seed=0)  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
    """

    def __init__(
        self,
        root: str,
        resolution: int = 224,
        val_resolution: int | None = None,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        crop_ratio: float = 0.875,
        num_workers: int = 4,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        prefetch_factor: int | None = 2,
        seed: int = 0,
        multiprocessing_context: str | None = "forkserver",
    ) -> None:
        super().__init__(
            batch_size, resolution, val_resolution, num_workers, pin_memory,
            persistent_workers, prefetch_factor, val_batch_size, multiprocessing_context,
        )
        if not 0 < crop_ratio <= 1:
            raise ValueError(f"crop_ratio={crop_ratio} must be in (0, 1]")
        self.root = Path(os.path.expanduser(str(root)))
        self.crop_ratio, self.seed = crop_ratio, seed
        self.train_dir, self.val_dir = self.root / "train", self.root / "val"
        self.classes = image_tree_classes(self.root)
        self.num_classes = len(self.classes)

    def train_dataloader(self) -> DataLoader:
        # The trainer's epoch, read at each epoch's first batch (StreamingDataModule's loader reads it there too)
        trainer = getattr(self, "trainer", None)
        dataset = _TrainImageFolder(self.train_dir, self._class_to_idx(), self.train_resolution, self.seed)
        return self._loader(dataset, self.train_batch_size, True, _EpochLoader,
                            epoch=None if trainer is None else lambda: trainer.current_epoch)

    def val_dataloader(self) -> DataLoader:
        transform = v2.Compose([v2.ToImage(), v2.Resize(round(self.val_resolution / self.crop_ratio), antialias=True),
                                v2.CenterCrop(self.val_resolution), _NORMALIZE])
        folder = _CheckedImageFolder(self.val_dir, transform, self._class_to_idx())
        return self._loader(folder, self.val_batch_size, False)

    def _class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


_NORMALIZE = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


class _CheckedImageFolder(ImageFolder):
    """``ImageFolder`` with a fixed class index and errors that name the unreadable file."""

    def __init__(self, root: Path, transform: v2.Transform, class_to_idx: dict[str, int]) -> None:
        self._fixed_class_to_idx = class_to_idx
        super().__init__(str(root), transform=transform)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        present = {p.name for p in Path(directory).iterdir() if p.is_dir()}
        mapping = {c: i for c, i in self._fixed_class_to_idx.items() if c in present}
        return sorted(mapping, key=mapping.get), mapping

    def __getitem__(self, index: int):
        path, _ = self.samples[index]
        try:
            return super().__getitem__(index)
        except Exception as err:  # PIL raises several types for broken files
            raise RuntimeError(f"cannot read image {path}: {err}") from err


class _TrainImageFolder(_CheckedImageFolder):
    """The training split: sample ``index``'s crop and flip in epoch ``epoch`` from ``sample_generator(seed, epoch, index)``."""

    def __init__(self, root: Path, class_to_idx: dict[str, int], resolution: int, seed: int) -> None:
        super().__init__(root, v2.PILToTensor(), class_to_idx)  # uint8
        self.resolution, self.seed = resolution, seed
        # set in this process by _EpochLoader; persistent workers read it through shared memory
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        box, flip = draw_crop(image.shape[-2], image.shape[-1], sample_generator(self.seed, int(self.epoch), index))
        return _NORMALIZE(crop_resize_flip(image, box, self.resolution, flip)), label


class _EpochLoader(DataLoader):
    """Tells its `_TrainImageFolder` the epoch as each iteration starts: ``epoch()``, or (no
    trainer) the number of iterations before this one.

    At the first batch, not when the iterator is made: Lightning makes a resumed run's iterator
    before it settles the epoch (and sets the sampler's), so workers start and the sampler
    draws its order then too.
    """

    def __init__(self, *args: Any, epoch: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch, self._iterations = epoch, 0

    def __iter__(self) -> Iterator[Any]:
        self.dataset.epoch.fill_(self._iterations if self.epoch is None else self.epoch())
        self._iterations += 1
        yield from super().__iter__()
