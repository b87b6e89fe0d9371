"""ImageFolder datamodule on a small ImageNet-layout tree the test writes itself."""
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

from lightning_fastscale import ImageClassifier
from lightning_fastscale.data import ImageFolderDataModule
from lightning_fastscale.lightning_internals import loader_with_sampler
from tests.distributed import ReleaseProcessGroup


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


def _crops(root: Path, workers: int, sampler, epochs=(0,), trainer: bool = True) -> list[dict[int, torch.Tensor]]:
    """Per epoch (one pass each of one loader, in turn), sample index -> its training image.

    ``sampler`` replaces the loader's as Lightning replaces it under DDP; the datamodule's
    trainer is a stand-in whose epoch the test sets (the trainer's ``current_epoch``), or none.
    """
    dm = ImageFolderDataModule(str(root), resolution=16, batch_size=2, num_workers=workers)
    dm.trainer = SimpleNamespace(current_epoch=0) if trainer else None
    loader = loader_with_sampler(dm.train_dataloader(), sampler)
    out = []
    for epoch in epochs:
        if trainer:
            dm.trainer.current_epoch = epoch
        sampler.set_epoch(epoch)
        order = list(sampler)
        images = torch.cat([x for x, _ in loader])
        out.append(dict(zip(order, images)))
    return out


def test_a_samples_augmentation_depends_on_seed_epoch_and_index_not_on_rank_or_worker(tmp_path):
    """The random resized crop + flip of sample i in epoch e is the same in a loader without
    workers, with 2 (persistent) workers and on either of 2 ranks; it changes with the epoch."""
    _write_tree(tmp_path)  # 12 training images

    def shard(rank: int, ranks: int) -> DistributedSampler:
        return DistributedSampler(range(12), num_replicas=ranks, rank=rank, shuffle=True, seed=0)

    one = _crops(tmp_path, 0, shard(0, 1), epochs=(0, 1))
    workers = _crops(tmp_path, 2, shard(0, 1), epochs=(0, 1))
    for epoch in (0, 1):
        ranks = {**_crops(tmp_path, 0, shard(0, 2), (epoch,))[0], **_crops(tmp_path, 2, shard(1, 2), (epoch,))[0]}
        assert one[epoch].keys() == workers[epoch].keys() == ranks.keys() == set(range(12))
        for i in range(12):
            assert torch.equal(one[epoch][i], workers[epoch][i]), (epoch, i)
            assert torch.equal(one[epoch][i], ranks[i]), (epoch, i)
    assert not any(torch.equal(one[0][i], one[1][i]) for i in range(12))
    # without a trainer (a loader iterated by hand), the loader's passes count the epochs
    alone = _crops(tmp_path, 2, shard(0, 1), epochs=(0, 1), trainer=False)
    assert all(torch.equal(alone[e][i], one[e][i]) for e in (0, 1) for i in range(12))


@pytest.mark.slow  # 2 spawned ranks with a loader worker each: ~15 s on 2 cores
def test_plain_trainer_on_two_ranks_trains_on_an_image_folder(tmp_path):
    """As a user runs it: Lightning's defaults, 2 ranks (ddp_spawn, a persistent loader worker
    each), 24 images in batches of 4: 3 steps per epoch, the epoch-end checkpoint at step 6."""
    _write_tree(tmp_path / "tree", per_class=8)
    dm = ImageFolderDataModule(str(tmp_path / "tree"), resolution=16, batch_size=4, num_workers=1)
    module = ImageClassifier("linear", num_classes=3, model_kwargs={"resolution": 16})
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2, default_root_dir=tmp_path,
                         callbacks=[ReleaseProcessGroup()])
    trainer.fit(module, datamodule=dm)
    assert [p.name for p in (tmp_path / "lightning_logs").rglob("*.ckpt")] == ["epoch=1-step=6.ckpt"]
    after = list(module.parameters())
    assert all(torch.isfinite(p).all() for p in after) and any(not torch.equal(a, b) for a, b in zip(after, before))
