"""Rectangular validation (fast.ai): ordering, batch shapes, rank split, no centre crop, DDP, old folders;
and the square validation batches, which share the plan and the loader."""
import json
import logging
import math
import shutil
import statistics
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from litdata import StreamingDataset
from PIL import Image
from torch import nn
from torchvision.transforms.v2 import functional as F

from lightning_fastscale.data import StreamingDataModule, jpeg_decode, rect_val, transforms
from lightning_fastscale.data.convert import convert
from lightning_fastscale.data.stored_format import stored_sample_count
from lightning_fastscale.data.streaming import ValidationBatches

from .data_streaming_utils import write_tree
from .distributed import ReleaseProcessGroup


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """Varied aspect ratios, 9 validation samples (odd), written by two converter processes."""
    tmp = tmp_path_factory.mktemp("rect")
    write_tree(tmp / "tree", train_per_class=2, val_per_class=3)
    out = tmp / "stream"
    convert(tmp / "tree", out, max_side=64, quality=95, num_workers=2)
    return out


def _dm(root, **kw):
    kw.setdefault("num_workers", 0)
    return StreamingDataModule(str(root), **{"resolution": 32, "batch_size": 4, "rect_val": True, **kw})


# -- the pure core ---------------------------------------------------------------------------
def _random_sizes(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(rng.integers(30, 500)), int(rng.integers(30, 500))] for _ in range(n)]


def test_order_is_by_width_over_height():
    sizes = _random_sizes(50, 0)
    order = rect_val.aspect_order(sizes)
    ratios = [sizes[i][1] / sizes[i][0] for i in order]
    assert sorted(order) == list(range(50)) and ratios == sorted(ratios)
    assert rect_val.aspect_order([[10, 10], [20, 20], [10, 30]]) == [0, 1, 2]  # ties keep position order


@pytest.mark.parametrize("n, batch_size, world_size", [
    (1, 4, 1), (10, 4, 1), (10, 4, 2), (9, 2, 2), (50, 8, 3), (50, 8, 4), (7, 16, 4), (97, 10, 8), (64, 8, 4),
])
def test_every_sample_once_and_equal_batch_counts_per_rank(n, batch_size, world_size):
    sizes = _random_sizes(n, n)
    plan = rect_val.plan_batches(sizes, batch_size, 32, world_size)
    lengths = [len(b.indices) for b in plan]
    assert len(plan) % world_size == 0 and max(lengths) - min(lengths) <= 1
    assert max(lengths) <= batch_size and min(lengths) >= 1
    assert len(plan) == world_size * math.ceil(n / (batch_size * world_size))  # no more batches than needed
    order = rect_val.aspect_order(sizes)
    assert [i for b in plan for i in b.indices] == order  # consecutive runs of the sorted list
    per_rank = [rect_val.rank_batches(plan, r, world_size) for r in range(world_size)]
    assert len({len(p) for p in per_rank}) == 1
    seen = [i for p in per_rank for b in p for i in b.indices]
    assert sorted(seen) == list(range(n))


def test_batch_size_one_on_two_ranks_and_too_few_samples():
    plan = rect_val.plan_batches(_random_sizes(5, 1), 1, 32, 2)
    assert len(plan) == 4 and sorted(len(b.indices) for b in plan) == [1, 1, 1, 2]
    with pytest.raises(ValueError, match="3 samples cannot fill one batch on each of 4 ranks"):
        rect_val.split_batches(range(3), 8, 4)


@pytest.mark.parametrize("resolution", [32, 160, 224])
def test_batch_shape_short_side_is_resolution_long_side_follows_median(resolution):
    rng = np.random.default_rng(resolution)
    for _ in range(200):
        sizes = [[int(rng.integers(50, 400)), int(rng.integers(50, 400))] for _ in range(int(rng.integers(1, 9)))]
        h, w = rect_val.batch_shape(sizes, resolution)
        median = statistics.median(sw / sh for sh, sw in sizes)
        short, long = min(h, w), max(h, w)
        assert short == resolution and (long % 8 == 0 or long == resolution)
        assert h == w or (w > h) == (median > 1)  # landscape batches get landscape shapes
        assert abs(long - max(resolution, resolution * max(median, 1 / median))) <= 4
    # clamped to the longest stored side (and never below the short side)
    assert rect_val.batch_shape([[100, 500]], 224, max_long_side=512) == (224, 512)
    assert rect_val.batch_shape([[100, 500]], 224, max_long_side=300) == (224, 296)
    assert rect_val.batch_shape([[100, 101]], 30) == (30, 32)


def test_resize_to_cover_cuts_only_the_excess_ratio():
    image = torch.arange(3 * 60 * 90, dtype=torch.int64).remainder(251).to(torch.uint8).view(3, 60, 90)
    same_ratio = rect_val.resize_to_cover(image, (40, 60))  # 60x90 -> 40x60: a pure resize
    assert torch.equal(same_ratio, F.resize(image, [40, 60], antialias=True))
    wider = rect_val.resize_to_cover(image, (40, 56))  # 40x60 then 2 columns off each side
    assert wider.shape == (3, 40, 56) and torch.equal(wider, F.resize(image, [40, 60], antialias=True)[..., 2:58])
    taller = rect_val.resize_to_cover(image, (48, 60))  # scale 0.8 -> 48x72, 6 columns off each side
    assert torch.equal(taller, F.resize(image, [48, 72], antialias=True)[..., 6:66])
    assert torch.equal(rect_val.resize_to_cover(image, (60, 90)), image)  # already that shape: untouched


# -- conversion records the sizes --------------------------------------------------------------
def test_convert_records_val_sizes_in_litdata_order(stream):
    sizes = json.loads((stream / "dataset.json").read_text())["extra"]["sizes"]["val"]
    samples = StreamingDataset(str(stream / "val"))
    assert len(sizes) == len(samples) == 9
    for i, (h, w) in enumerate(sizes):
        image = jpeg_decode.decode_rgb(torch.frombuffer(bytearray(samples[i]["image"]), dtype=torch.uint8))
        assert tuple(image.shape[1:]) == (h, w)
    assert len({w / h for h, w in sizes}) >= 3  # the test data has varied ratios


# -- the datamodule ----------------------------------------------------------------------------
def test_rect_batches_are_uint8_rectangles_normalised_on_device(stream):
    dm = _dm(stream)
    batches = list(dm.val_dataloader())
    assert sum(len(y) for _, y in batches) == 9
    shapes = [tuple(x.shape[2:]) for x, _ in batches]
    assert all(min(s) == 32 and max(s) % 8 == 0 for s in shapes) and len(set(shapes)) >= 2
    x, y = batches[-1]
    assert x.dtype == torch.uint8
    out, _ = dm.on_after_batch_transfer((x, y), 0)
    mean = torch.tensor(transforms.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(transforms.IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (x.float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)
    # two loader workers hand out the same batches in the same order
    again = list(_dm(stream, num_workers=2).val_dataloader())
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))


def _striped_tree(root: Path) -> Path:
    """Landscape 48x64 images: red 8-pixel columns at both edges, green in between."""
    for split in ("train", "val"):
        for cls in ("a", "b"):
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(2):
                pixels = np.zeros((48, 64, 3), dtype=np.uint8)
                pixels[:, :, 1] = 200
                pixels[:, :8] = pixels[:, -8:] = (230, 0, 0)
                Image.fromarray(pixels).save(d / f"{i}.JPEG", quality=95)
    return root


def _is_red(columns):
    r, g = columns[0].float().mean(), columns[1].float().mean()
    return bool(r > 150 and g < 80)


def test_rect_val_keeps_the_border_that_the_centre_crop_cuts(tmp_path):
    out = tmp_path / "stream"
    convert(_striped_tree(tmp_path / "tree"), out, max_side=64, quality=95, num_workers=1)
    square, _ = next(iter(_dm(out, rect_val=False).val_dataloader()))
    rect, _ = next(iter(_dm(out).val_dataloader()))
    assert square.shape[2:] == (32, 32) and rect.shape[2:] == (32, 40)  # 32 x 32 * 4/3 rounded to 8
    for images, kept in ((rect, True), (square, False)):
        for image in images:
            assert _is_red(image[:, :, :2]) is kept and _is_red(image[:, :, -2:]) is kept
            assert not _is_red(image[:, :, 16:24])  # the middle is green either way


def _without_sizes(stream, old):
    """A copy of ``stream`` whose dataset.json is as older conversions wrote it."""
    shutil.copytree(stream, old)
    meta = json.loads((old / "dataset.json").read_text())
    del meta["extra"]["sizes"]
    (old / "dataset.json").write_text(json.dumps(meta))
    return old


def test_folder_without_recorded_sizes_reads_them_from_jpeg_headers(stream, tmp_path, caplog):
    old = _without_sizes(stream, tmp_path / "old")
    dm = _dm(old)
    with caplog.at_level(logging.WARNING, logger="lightning_fastscale.data.streaming"):
        batches = dm.rect_val_batches()
    assert "records no image sizes" in caplog.text and "Convert again" in caplog.text
    assert dm.val_image_sizes() == meta_sizes(stream)
    assert batches == _dm(stream).rect_val_batches()


def meta_sizes(root):
    return json.loads((Path(root) / "dataset.json").read_text())["extra"]["sizes"]["val"]


def test_bad_rect_val_settings_are_named(stream, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="rect_val='yes' must be True or False"):
        _dm(stream, rect_val="yes")
    changed = tmp_path / "changed"
    shutil.copytree(stream, changed)
    meta = json.loads((changed / "dataset.json").read_text())
    meta["extra"]["sizes"]["val"] = meta["extra"]["sizes"]["val"][:5]
    (changed / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="rect_val=True: .* records 5 validation image sizes for 9"):
        _dm(changed)
    dm = _dm(stream)
    monkeypatch.setattr(dm, "_rank_and_world_size", lambda: (0, 16))
    with pytest.raises(ValueError, match="rect_val=True needs at least one validation sample per rank.*9 for 16"):
        dm.val_dataloader()


# -- two DDP ranks under a real Trainer ---------------------------------------------------------
class _IndexLabelledBatches(ValidationBatches):
    """Real rectangular images, but each sample's litdata index as its label."""

    def decode(self, item, shape):
        image, _ = super().decode(item, shape)
        return image, self._position[int(item["index"])]

    def __init__(self, input_dir, batches, source, **kw):
        super().__init__(input_dir, batches, source, **kw)
        count = stored_sample_count(self.samples)  # len() would be this rank's shard only
        self._position = {int(self.samples[i]["index"]): i for i in range(count)}


class _IndexDataModule(StreamingDataModule):
    val_batches_class = _IndexLabelledBatches


class _ValRecorder(pl.LightningModule):
    """Logs a per-step synced loss (as the package's module does) and records what it saw."""

    def __init__(self, out_dir):
        super().__init__()
        self.head = nn.Linear(3, 9)
        self.out_dir = out_dir
        self.seen, self.shapes = [], []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        assert x.dtype == torch.float32
        self.seen += y.tolist()
        self.shapes.append(list(x.shape[2:]))
        self.log("val/loss", nn.functional.cross_entropy(self.head(x.mean((2, 3))), y), sync_dist=True)

    def on_validation_end(self):
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(
            json.dumps({"seen": self.seen, "shapes": self.shapes})
        )


# The rectangular plan under DDP is slow (the pure plan tests above cover its split); the square
# case, which every streaming validation runs, stays in make test.
@pytest.mark.parametrize("rect", [pytest.param(True, marks=pytest.mark.slow), False], ids=["rect_val", "square"])
def test_two_rank_ddp_validation_sees_every_sample_once(stream, tmp_path, rect):
    # A folder without recorded sizes: each rank reads them from the whole split, not its shard.
    old = _without_sizes(stream, tmp_path / "old")
    dm = _IndexDataModule(str(old), resolution=32, batch_size=2, num_workers=0, rect_val=rect)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn",
        default_root_dir=tmp_path, callbacks=[ReleaseProcessGroup()],
    )
    trainer.validate(_ValRecorder(str(tmp_path)), datamodule=dm)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # 9 samples, batches of at most 2 on 2 ranks: 6 batches of 2, 2, 2, 1, 1, 1; 3 per rank
    assert [len(r["shapes"]) for r in ranks] == [3, 3]
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(9))
    assert len(ranks[0]["seen"]) + len(ranks[1]["seen"]) == 9
    if rect:
        plan = rect_val.plan_batches(meta_sizes(stream), 2, 32, 2, 64)
        for r in range(2):
            mine = rect_val.rank_batches(plan, r, 2)
            assert ranks[r]["seen"] == [i for b in mine for i in b.indices]
            assert ranks[r]["shapes"] == [list(b.shape) for b in mine]
    else:  # square: each rank a contiguous range of the split
        assert ranks[0]["seen"] == [0, 1, 2, 3, 4, 5] and ranks[1]["seen"] == [6, 7, 8]
        assert all(shape == [32, 32] for r in ranks for shape in r["shapes"])
