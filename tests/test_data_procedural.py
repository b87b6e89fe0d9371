"""The built-in procedural dataset: deterministic, resolution-free, sharded without overlap."""
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_fastscale.data import MAX_CLASSES, ProceduralDataModule, ProceduralShapes


def test_sample_is_a_function_of_seed_and_index():
    a = ProceduralShapes(num_classes=10, size=100, seed=3)
    b = ProceduralShapes(num_classes=10, size=100, seed=3)
    x1, y1 = a[17]
    # rendering alone or inside a batch gives the identical sample
    batch = b.__getitems__([5, 17, 42])
    assert torch.equal(x1, batch[1][0]) and y1 == batch[1][1]
    assert not torch.equal(a[17][0], a[18][0])
    assert not torch.equal(a[17][0], ProceduralShapes(num_classes=10, size=100, seed=4)[17][0])


def test_splits_are_disjoint_streams():
    train = ProceduralShapes(size=10, split="train")
    val = ProceduralShapes(size=10, split="val")
    assert all(not torch.equal(train[i][0], val[i][0]) for i in range(10))


def test_any_resolution_and_classes_balanced():
    ds = ProceduralShapes(num_classes=MAX_CLASSES, size=64, resolution=48)
    x, _ = ds[0]
    assert x.shape == (3, 48, 48)
    ds.set_resolution(96)
    assert ds[0][0].shape == (3, 96, 96)
    labels = [ds.label(i) for i in range(64)]
    assert sorted(set(labels)) == list(range(MAX_CLASSES))
    assert all(labels.count(c) == 4 for c in range(MAX_CLASSES))


def test_same_shape_at_two_resolutions():
    """Samples at 32 and 64 px are the same picture: downsampling 64 gives about the 32 one."""
    ds = ProceduralShapes(size=8, noise=0.0, normalize=False)
    ds.set_resolution(64)
    big = ds.render(range(8))
    ds.set_resolution(32)
    small = ds.render(range(8))
    down = torch.nn.functional.avg_pool2d(big, 2)
    assert (down - small).abs().mean() < 0.03


def test_shards_do_not_overlap_and_cover_the_set():
    ds = ProceduralShapes(size=103)
    shards = [list(DistributedSampler(ds, num_replicas=4, rank=r, shuffle=True, seed=0)) for r in range(4)]
    seen = [i for s in shards for i in s]
    # DistributedSampler pads to a multiple of the world size by repeating a few indices
    assert set(seen) == set(range(103)) and len(seen) == 104
    assert len(set(shards[0]) & set(shards[1])) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"num_classes": MAX_CLASSES + 1}, "num_classes"),
        ({"resolution": 4}, "resolution"),
        ({"split": "holdout"}, "split"),
    ],
)
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProceduralShapes(**kwargs)


def test_datamodule_protocol_changes_loaders():
    dm = ProceduralDataModule(train_size=64, val_size=32, batch_size=16, resolution=32)
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 3, 32, 32)
    dm.set_train_batch_size(8)
    dm.set_train_resolution(40)
    dm.set_val_resolution(48)
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 40, 40)
    assert next(iter(dm.val_dataloader()))[0].shape[-1] == 48
    with pytest.raises(ValueError, match="batch size"):
        dm.set_train_batch_size(0)
    restored = ProceduralDataModule(train_size=64, val_size=32)
    restored.load_state_dict(dm.state_dict())
    assert (restored.train_batch_size, restored.train_resolution, restored.val_resolution) == (8, 40, 48)
