"""ImageFolder datamodule on a small ImageNet-layout tree the test writes itself."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lightning_fastscale.data import ImageFolderDataModule


def _write_tree(root: Path, classes=("n01", "n02", "n03"), per_class=4) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (40 + i, 50, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(d / f"{c}_{i}.JPEG")


def test_loads_imagenet_layout(tmp_path):
    _write_tree(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), resolution=32, batch_size=4, num_workers=0)
    assert dm.num_classes == 3
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and y.max() < 3
    xv, yv = next(iter(dm.val_dataloader()))
    assert xv.shape == (4, 3, 32, 32)
    assert sorted(set(int(t) for t in yv)) == [0]  # val is not shuffled: first class first
    dm.set_train_resolution(24)
    dm.set_train_batch_size(2)
    assert next(iter(dm.train_dataloader()))[0].shape == (2, 3, 24, 24)


def test_missing_directory_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere" / "train")):
        ImageFolderDataModule(str(tmp_path / "nowhere"))


def test_empty_class_folder_names_path(tmp_path):
    _write_tree(tmp_path)
    (tmp_path / "train" / "n04").mkdir()
    with pytest.raises(FileNotFoundError, match="n04"):
        ImageFolderDataModule(str(tmp_path))


def test_unreadable_image_names_path(tmp_path):
    _write_tree(tmp_path, per_class=1)
    bad = tmp_path / "val" / "n01" / "broken.JPEG"
    bad.write_bytes(b"not a jpeg at all")
    dm = ImageFolderDataModule(str(tmp_path), resolution=16, batch_size=8, num_workers=0)
    with pytest.raises(RuntimeError, match="broken.JPEG"):
        next(iter(dm.val_dataloader()))
