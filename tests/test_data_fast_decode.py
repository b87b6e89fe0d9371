"""The batch kernel `fast_decode.train_batch` against the per-image `train_transform`.

Same crop boxes and flips (same generator consumption), pixels within a stated tolerance,
threads and ``out=`` changing nothing, and strictness: a damaged sample in the middle of a
batch raises `SampleDecodeError` with its position.
"""
from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from lightning_fastscale.data import fast_decode
from lightning_fastscale.data.verify import CorruptDataError, SampleDecodeError, decoder_messages, strict_decode

RESOLUTION = 64


def _photo_jpeg(rng: np.random.Generator, height: int, width: int) -> torch.Tensor:
    """A textured JPEG (texture at two scales + noise), 4:2:0, quality 90, as 1-D uint8 bytes."""
    img = np.zeros((height, width, 3), np.float32)
    for octave in (4, 16):
        base = rng.normal(0, 40, (max(2, height // octave), max(2, width // octave), 3)) + 128
        small = Image.fromarray(base.clip(0, 255).astype(np.uint8))
        img += np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), np.float32) - 128
    img += rng.uniform(60, 190, 3) + rng.normal(0, 12, img.shape)
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


@pytest.fixture(scope="module")
def jpegs() -> list[torch.Tensor]:
    """Sizes around RESOLUTION: crops that are downscaled, upscaled, and one of each per axis."""
    rng = np.random.default_rng(0)
    sizes = [(48, 40), (60, 80), (75, 100), (120, 90), (150, 200), (200, 266), (33, 300), (240, 180)]
    return [_photo_jpeg(rng, h, w) for h, w in sizes * 2]


def _generators(count: int, epoch: int = 0) -> list[torch.Generator]:
    return [fast_decode.sample_generator(7, epoch, i) for i in range(count)]


def _reference(jpegs: list[torch.Tensor], gens: list[torch.Generator], resolution: int = RESOLUTION) -> torch.Tensor:
    return torch.stack([fast_decode.train_transform(j, resolution, g) for j, g in zip(jpegs, gens)])


@pytest.mark.parametrize("epoch", range(6))
def test_train_batch_draws_what_train_transform_draws_and_gives_the_same_pixels(jpegs, epoch):
    """Tolerance: a crop reduced on either axis goes through the same torchvision resize, so it is
    bitwise equal; a crop enlarged on both axes goes through OpenCV's bilinear resize, which
    rounds its fixed-point weights differently from torchvision's: at most 1 apart."""
    gens_ref, gens = _generators(len(jpegs), epoch), _generators(len(jpegs), epoch)
    expected = _reference(jpegs, gens_ref)
    batch = fast_decode.train_batch(jpegs, gens, RESOLUTION)
    assert batch.shape == (len(jpegs), 3, RESOLUTION, RESOLUTION) and batch.dtype == torch.uint8
    # the same random numbers were drawn: the generators end in the same state
    for g_ref, g in zip(gens_ref, gens):
        assert torch.equal(g_ref.get_state(), g.get_state())
    enlarged = 0
    for i, (jpeg, g) in enumerate(zip(jpegs, _generators(len(jpegs), epoch))):
        height, width = fast_decode.jpeg_size(jpeg)
        (_, _, h, w), _ = fast_decode.draw_crop(height, width, g)
        diff = (batch[i].int() - expected[i].int()).abs().max().item()
        if h <= RESOLUTION and w <= RESOLUTION:
            enlarged += 1
            assert diff <= 1, (i, diff)
        else:
            assert diff == 0, (i, diff)
    assert 0 < enlarged < len(jpegs)  # both kinds of crop were checked


def test_train_batch_same_boxes_over_many_seeds(jpegs):
    """128 generators over two images whose crops are mostly enlarged (75 x 100) or reduced
    (150 x 200): the same draws, and the pixels within the tolerance above."""
    batch = [jpegs[2], jpegs[4]] * 64
    gens = [fast_decode.sample_generator(seed, 3, i) for i, seed in enumerate(range(100, 228))]
    gens_ref = [fast_decode.sample_generator(seed, 3, i) for i, seed in enumerate(range(100, 228))]
    got = fast_decode.train_batch(batch, gens, RESOLUTION, threads=2)
    expected = _reference(batch, gens_ref)
    diff = (got.int() - expected.int()).abs().amax(dim=(1, 2, 3))
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, gens_ref))
    assert diff.max() <= 1 and (diff == 0).sum() >= 32, diff.tolist()


def test_train_batch_without_opencv_is_train_transform_bitwise(jpegs, monkeypatch):
    monkeypatch.setattr(fast_decode, "_cv2", None)
    expected = _reference(jpegs, _generators(len(jpegs)))
    assert torch.equal(fast_decode.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION), expected)


@pytest.mark.parametrize("size", [32, 64, 160])
def test_val_transform_is_torchvision_resize_and_centre_crop(jpegs, size):
    """Images the resize enlarges (all at 160) go through OpenCV's bilinear resize: at most 1 apart;
    the others through torchvision's antialiased resize: bitwise equal."""
    for jpeg in jpegs:
        image = fast_decode.decode_rgb(jpeg)
        expected = F.center_crop(F.resize(image, [round(size / 0.875)], antialias=True), [size, size])
        got = fast_decode.val_transform(jpeg, size)
        assert got.shape == expected.shape == (3, size, size)
        enlarged = min(image.shape[1:]) <= round(size / 0.875)
        assert (got.int() - expected.int()).abs().max() <= (1 if enlarged else 0)


def test_train_batch_threads_and_out_change_nothing(jpegs):
    one = fast_decode.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION)
    out = torch.full((len(jpegs), 3, RESOLUTION, RESOLUTION), 7, dtype=torch.uint8)
    out = out.contiguous(memory_format=torch.channels_last)
    two = fast_decode.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION, threads=2, out=out)
    assert two is out and torch.equal(two, one)
    contiguous = torch.zeros(len(jpegs), 3, RESOLUTION, RESOLUTION, dtype=torch.uint8)  # not pixel-interleaved
    assert torch.equal(fast_decode.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION, out=contiguous), one)
    assert torch.equal(fast_decode.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION, threads=3), one)
    assert fast_decode._thread_pool(2) is fast_decode._thread_pool(2)  # one pool per thread count, kept


def _flipped_byte(jpeg: torch.Tensor) -> torch.Tensor:
    """The first entropy-coded byte inverted: libjpeg decodes it with only a warning."""
    data = bytearray(jpeg.numpy().tobytes())
    sos = data.index(b"\xff\xda")
    data[sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")] ^= 0xFF
    return torch.frombuffer(data, dtype=torch.uint8)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_a_damaged_sample_raises_with_its_position(jpegs, threads, damage, capfd):
    bad = 4  # a 150 x 200 image inside the first thread's block, not at its start
    batch = list(jpegs)
    batch[bad] = jpegs[bad][: len(jpegs[bad]) // 2] if damage == "truncated" else _flipped_byte(jpegs[bad])
    if damage == "flipped byte":  # libjpeg only warns (not every flipped byte makes it warn)
        assert fast_decode.decode_rgb(batch[bad]).shape == (3, 150, 200)
        with pytest.raises(ValueError, match="Corrupt JPEG data"):
            strict_decode(fast_decode.decode_rgb, batch[bad])
        capfd.readouterr()
    with pytest.raises(SampleDecodeError) as info:
        fast_decode.train_batch(batch, _generators(len(batch)), RESOLUTION, threads=threads)
    assert info.value.position == bad and isinstance(info.value, CorruptDataError)
    assert f"position {bad}" in str(info.value)
    if damage == "flipped byte":
        assert "Corrupt JPEG data" in str(info.value)
        assert "Corrupt JPEG data" not in capfd.readouterr().err  # turned into the error, not printed
    again = pickle.loads(pickle.dumps(info.value))  # crosses loader worker processes intact
    assert (type(again), again.position, str(again)) == (SampleDecodeError, bad, str(info.value))


def test_train_batch_refuses_mismatched_arguments(jpegs):
    with pytest.raises(ValueError, match="one generator per sample"):
        fast_decode.train_batch(jpegs[:2], _generators(3), RESOLUTION)
    with pytest.raises(ValueError, match="out must be a uint8 tensor of shape"):
        fast_decode.train_batch(jpegs[:2], _generators(2), RESOLUTION, out=torch.empty(2, 3, 8, 8, dtype=torch.uint8))


def test_strict_decodes_nest_and_a_batch_inside_a_capture_does_not_wait_for_itself(jpegs):
    bad = _flipped_byte(jpegs[4])
    with decoder_messages() as outer:
        with pytest.raises(ValueError, match="Corrupt JPEG data"):
            strict_decode(fast_decode.decode_rgb, bad)  # a block nested in the same thread
        with pytest.raises(SampleDecodeError):
            fast_decode.train_batch([jpegs[0], bad], _generators(2), RESOLUTION, threads=2)
    assert "Corrupt JPEG data" in outer[0]  # the outer block saw what the inner ones did
    assert fast_decode.train_batch(jpegs[:2], _generators(2), RESOLUTION).shape[0] == 2  # capture restored
