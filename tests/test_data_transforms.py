"""The batch kernel `transforms.train_batch` against the per-image `train_transform`.

Same crop boxes and flips (same generator consumption), pixels within a stated tolerance,
threads and ``out=`` changing nothing, and strictness: a damaged sample in the middle of a
batch raises `SampleDecodeError` with its position. Where simplejpeg is installed it decodes
(TorchCodec otherwise): both decoders give the same batch and the same strictness; its
DCT-domain scaling (``dct_scaling=True``) keeps the draws and changes the pixels of the crops
it applies to within the tolerance stated in its test.
"""
from __future__ import annotations

import io
import pickle
import threading

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from lightning_fastscale.data import jpeg_decode, transforms
from lightning_fastscale.data.jpeg_decode import SampleDecodeError, decoder_messages, strict_decode
from lightning_fastscale.data.stored_format import CorruptDataError

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
    return [transforms.sample_generator(7, epoch, i) for i in range(count)]


def _reference(jpegs: list[torch.Tensor], gens: list[torch.Generator], resolution: int = RESOLUTION) -> torch.Tensor:
    return torch.stack([transforms.train_transform(j, resolution, g) for j, g in zip(jpegs, gens)])


@pytest.mark.parametrize("epoch", range(6))
def test_train_batch_draws_what_train_transform_draws_and_gives_the_same_pixels(jpegs, epoch):
    """Tolerance: a crop reduced on either axis goes through the same torchvision resize, so it is
    bitwise equal; a crop enlarged on both axes goes through OpenCV's bilinear resize, which
    rounds its fixed-point weights differently from torchvision's: at most 1 apart."""
    gens_ref, gens = _generators(len(jpegs), epoch), _generators(len(jpegs), epoch)
    expected = _reference(jpegs, gens_ref)
    batch = transforms.train_batch(jpegs, gens, RESOLUTION)
    assert batch.shape == (len(jpegs), 3, RESOLUTION, RESOLUTION) and batch.dtype == torch.uint8
    # the same random numbers were drawn: the generators end in the same state
    for g_ref, g in zip(gens_ref, gens):
        assert torch.equal(g_ref.get_state(), g.get_state())
    enlarged = 0
    for i, (jpeg, g) in enumerate(zip(jpegs, _generators(len(jpegs), epoch))):
        height, width = jpeg_decode.jpeg_size(jpeg)
        (_, _, h, w), _ = transforms.draw_crop(height, width, g)
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
    gens = [transforms.sample_generator(seed, 3, i) for i, seed in enumerate(range(100, 228))]
    gens_ref = [transforms.sample_generator(seed, 3, i) for i, seed in enumerate(range(100, 228))]
    got = transforms.train_batch(batch, gens, RESOLUTION, threads=2)
    expected = _reference(batch, gens_ref)
    diff = (got.int() - expected.int()).abs().amax(dim=(1, 2, 3))
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, gens_ref))
    assert diff.max() <= 1 and (diff == 0).sum() >= 32, diff.tolist()


@pytest.mark.parametrize("size", [32, 64, 160])
def test_val_transform_is_torchvision_resize_and_centre_crop(jpegs, size):
    """Images the resize enlarges (all at 160) go through OpenCV's bilinear resize: at most 1 apart;
    the others through torchvision's antialiased resize: bitwise equal."""
    for jpeg in jpegs:
        image = jpeg_decode.decode_rgb(jpeg)
        expected = F.center_crop(F.resize(image, [round(size / 0.875)], antialias=True), [size, size])
        got = transforms.val_transform(jpeg, size)
        assert got.shape == expected.shape == (3, size, size)
        enlarged = min(image.shape[1:]) <= round(size / 0.875)
        assert (got.int() - expected.int()).abs().max() <= (1 if enlarged else 0)


def test_train_batch_threads_and_out_change_nothing(jpegs):
    one = transforms.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION)
    out = torch.full((len(jpegs), 3, RESOLUTION, RESOLUTION), 7, dtype=torch.uint8)
    out = out.contiguous(memory_format=torch.channels_last)
    two = transforms.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION, threads=2, out=out)
    assert two is out and torch.equal(two, one)
    contiguous = torch.zeros(len(jpegs), 3, RESOLUTION, RESOLUTION, dtype=torch.uint8)  # not pixel-interleaved
    assert torch.equal(transforms.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION, out=contiguous), one)
    assert torch.equal(transforms.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION, threads=3), one)
    assert transforms._thread_pool(2) is transforms._thread_pool(2)  # one pool per thread count, kept


def _flipped_byte(jpeg: torch.Tensor) -> torch.Tensor:
    """The first entropy-coded byte inverted: libjpeg decodes it with only a warning."""
    data = bytearray(jpeg.numpy().tobytes())
    sos = data.index(b"\xff\xda")
    data[sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")] ^= 0xFF
    return torch.frombuffer(data, dtype=torch.uint8)


@pytest.fixture(params=["simplejpeg", "torchcodec"])
def decoder(request, monkeypatch) -> str:
    """Each test using it runs with simplejpeg decoding and with TorchCodec decoding (the decoder
    of the samples simplejpeg refuses, and of the benchmark's TorchCodec rows)."""
    if request.param == "torchcodec":
        monkeypatch.setattr(transforms, "_simplejpeg", None)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_a_damaged_sample_raises_with_its_position(jpegs, threads, damage, capfd, decoder):
    bad = 4  # a 150 x 200 image inside the first thread's block, not at its start
    batch = list(jpegs)
    batch[bad] = jpegs[bad][: len(jpegs[bad]) // 2] if damage == "truncated" else _flipped_byte(jpegs[bad])
    if damage == "flipped byte":  # libjpeg only warns (not every flipped byte makes it warn)
        assert jpeg_decode.decode_rgb(batch[bad]).shape == (3, 150, 200)
        with pytest.raises(ValueError, match="Corrupt JPEG data"):
            strict_decode(jpeg_decode.decode_rgb, batch[bad])
        capfd.readouterr()
    with pytest.raises(SampleDecodeError) as info:
        transforms.train_batch(batch, _generators(len(batch)), RESOLUTION, threads=threads, dct_scaling=threads == 2)
    assert info.value.position == bad and isinstance(info.value, CorruptDataError)
    assert f"position {bad}" in str(info.value)
    if damage == "flipped byte":
        assert "Corrupt JPEG data" in str(info.value)
        assert "Corrupt JPEG data" not in capfd.readouterr().err  # turned into the error, not printed
    again = pickle.loads(pickle.dumps(info.value))  # crosses loader worker processes intact
    assert (type(again), again.position, str(again)) == (SampleDecodeError, bad, str(info.value))


def test_train_batch_refuses_mismatched_arguments(jpegs):
    with pytest.raises(ValueError, match="one generator per sample"):
        transforms.train_batch(jpegs[:2], _generators(3), RESOLUTION)
    with pytest.raises(ValueError, match="out must be a uint8 tensor of shape"):
        transforms.train_batch(jpegs[:2], _generators(2), RESOLUTION, out=torch.empty(2, 3, 8, 8, dtype=torch.uint8))


def test_strict_decodes_nest_and_a_batch_inside_a_capture_does_not_wait_for_itself(jpegs):
    bad = _flipped_byte(jpegs[4])
    with decoder_messages() as outer:
        with pytest.raises(ValueError, match="Corrupt JPEG data"):
            strict_decode(jpeg_decode.decode_rgb, bad)  # a block nested in the same thread
        with pytest.raises(SampleDecodeError):
            transforms.train_batch([jpegs[0], bad], _generators(2), RESOLUTION, threads=2)
    assert "Corrupt JPEG data" in outer[0]  # the outer block saw what the inner ones did
    assert transforms.train_batch(jpegs[:2], _generators(2), RESOLUTION).shape[0] == 2  # capture restored


def test_a_simplejpeg_batch_does_not_wait_for_another_threads_capture(jpegs):
    """simplejpeg refuses what libjpeg only warns of, so a batch it decodes whole takes no capture
    of file descriptor 2, and batches of other threads (the background loader decodes the next
    batch while this one decodes) run while a strict decode holds it."""
    expected = transforms.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION)
    got = []
    with decoder_messages():  # held by this thread while another decodes a batch
        worker = threading.Thread(target=lambda: got.append(
            transforms.train_batch(jpegs, _generators(len(jpegs)), RESOLUTION, threads=2)), daemon=True)
        worker.start()
        worker.join(20)
        assert not worker.is_alive(), "the batch waited for this thread's capture"
    assert torch.equal(got[0], expected)


def _encoded(image: Image.Image, **save: object) -> torch.Tensor:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90, **save)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def test_simplejpeg_and_torchcodec_give_the_same_batch(jpegs, monkeypatch):
    """The same libjpeg-turbo decode (accurate integer IDCT, fancy upsampling): bitwise the same
    batch, 4:2:0 photos as stored by the converter and other layouts alike; a CMYK JPEG (which
    the converter never writes) goes through each decoder's own CMYK-to-RGB conversion, which
    round differently: at most 1 apart."""
    rgb = Image.fromarray(jpeg_decode.decode_rgb(jpegs[5]).permute(1, 2, 0).numpy())
    others = [_encoded(rgb.convert("L")), _encoded(rgb, subsampling=0), _encoded(rgb, progressive=True),
              _encoded(rgb, subsampling=1)]
    cmyk = _encoded(rgb.convert("CMYK"))
    batch = [*jpegs, *others, cmyk]
    with_simplejpeg = transforms.train_batch(batch, _generators(len(batch)), RESOLUTION)
    monkeypatch.setattr(transforms, "_simplejpeg", None)
    with_torchcodec = transforms.train_batch(batch, _generators(len(batch)), RESOLUTION)
    assert torch.equal(with_simplejpeg[:-1], with_torchcodec[:-1])
    assert (with_simplejpeg[-1].int() - with_torchcodec[-1].int()).abs().max() <= 1


def test_a_warning_simplejpeg_refuses_is_judged_as_torchcodec_judges_it(jpegs, capfd):
    """An unknown JFIF revision is harmless: libjpeg warns and decodes. simplejpeg refuses the
    image (it stops on any warning); TorchCodec decodes it again, and since the warning is not
    "Corrupt JPEG data" the batch is the reference one and the warning reaches stderr."""
    data = bytearray(jpegs[3].numpy().tobytes())
    data[data.index(b"JFIF\x00") + 5] = 2  # major version 2
    odd = torch.frombuffer(data, dtype=torch.uint8)
    with pytest.raises(ValueError, match="JFIF revision"):
        simplejpeg.decode_jpeg(odd.numpy(), "RGB")
    batch = [jpegs[0], odd, jpegs[4]]
    got = transforms.train_batch(batch, _generators(3), RESOLUTION, threads=2)
    expected = _reference(batch, _generators(3))
    assert (got.int() - expected.int()).abs().max() <= 1
    assert "unknown JFIF revision" in capfd.readouterr().err


@pytest.fixture(scope="module")
def large_jpegs() -> list[torch.Tensor]:
    """Images of several times RESOLUTION, so that many crops allow a 1/2 or 1/4 scale decode:
    three textured (noise down to the pixel scale) and three smooth (sinusoids of ~150 px period)."""
    rng = np.random.default_rng(1)
    textured = [_photo_jpeg(rng, h, w) for h, w in [(300, 400), (420, 560), (600, 450)]]
    yy, xx = np.mgrid[0:600, 0:560].astype(np.float32)
    waves = np.stack([128 + 90 * np.sin(xx / 23 + c) * np.cos(yy / 31 - c) for c in range(3)], -1)
    smooth = [_encoded(Image.fromarray(waves[:h, :w].astype(np.uint8))) for h, w in [(300, 400), (420, 560), (600, 450)]]
    return textured + smooth


def test_dct_scaling_keeps_the_draws_and_changes_only_the_reduced_crops_within_tolerance(large_jpegs, jpegs):
    """Crops decoded at full scale are those of ``dct_scaling=False`` (bitwise, or within
    OpenCV's 1 for enlarged crops). A crop decoded at 1/d scale differs from the reference in two
    ways: its box is rounded outwards to the 1/d grid (up to d - 1 source pixels per edge), and
    it is low-passed by libjpeg's reduced IDCT before the antialiased resize. Tolerances, in
    grey levels: its mean level within 0.5 of the reference's (the same region); against the
    full decode resized from the rounded box (the filter alone), smooth images within 4 (mean
    1), textured ones (noise at the pixel scale, the worst case for a change of low-pass filter)
    within 32 (mean 4). Measured: at most 3 (0.5) and 22 (3.1)."""
    batch = (large_jpegs + jpegs[:4]) * 8
    smooth = {3, 4, 5}  # positions of large_jpegs' smooth images, modulo 10
    gens, gens_ref = _generators(len(batch), 5), _generators(len(batch), 5)
    got = transforms.train_batch(batch, gens, RESOLUTION, dct_scaling=True, threads=2)
    expected = _reference(batch, gens_ref)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens, gens_ref))
    seen = set()
    for i, (jpeg, g) in enumerate(zip(batch, _generators(len(batch), 5))):
        pixels, (t, lf, hh, ww), flip = transforms._decode_for_crop(
            jpeg, g, RESOLUTION, transforms.DEFAULT_SCALE, transforms.DEFAULT_RATIO, True)
        full = jpeg_decode.decode_rgb(jpeg)
        d = full.shape[1] // pixels.shape[0]
        seen.add(d)
        if d == 1:
            assert (got[i].int() - expected[i].int()).abs().max() <= 1, i
            continue
        assert abs(got[i].float().mean() - expected[i].float().mean()) <= 0.5, i
        height, width = full.shape[1:]
        rounded = (t * d, lf * d, min(hh * d, height - t * d), min(ww * d, width - lf * d))
        diff = (got[i].float() - transforms.crop_resize_flip(full, rounded, RESOLUTION, flip).float()).abs()
        bound, mean_bound = (4, 1) if i % 10 in smooth else (32, 4)
        assert diff.max() <= bound and diff.mean() <= mean_bound, (i, d, diff.max(), diff.mean())
    assert {1, 2, 4} <= seen  # full, 1/2 and 1/4 scale decodes were all checked


@pytest.mark.parametrize("d", [2, 4, 8])
def test_a_reduced_decode_crops_the_drawn_box_rounded_outwards(d):
    """The box in the 1/d image covers the drawn box scaled by 1/d, and exceeds it by less than
    one reduced pixel per edge; the image is libjpeg's ceil(H / d) x ceil(W / d)."""
    jpeg = _photo_jpeg(np.random.default_rng(2), 1033, 1290)
    for k in range(40):
        g, g_ref = transforms.sample_generator(1, 0, k), transforms.sample_generator(1, 0, k)
        box, flip = transforms.draw_crop(1033, 1290, g_ref)
        size = min(box[2], box[3]) // d
        if transforms._dct_reduction(box, size) != d:
            continue
        pixels, scaled, got_flip = transforms._decode_for_crop(
            jpeg, g, size, transforms.DEFAULT_SCALE, transforms.DEFAULT_RATIO, True)
        assert pixels.shape == (-(-1033 // d), -(-1290 // d), 3) and got_flip == flip
        (top, left, h, w), (t, lf, hh, ww) = box, scaled
        assert t * d <= top < (t + 1) * d and lf * d <= left < (lf + 1) * d
        assert (t + hh - 1) * d < top + h <= (t + hh) * d and (lf + ww - 1) * d < left + w <= (lf + ww) * d
        return
    pytest.fail(f"no crop among 40 draws allowed a 1/{d} decode")


def test_dct_scaling_without_simplejpeg_changes_nothing(large_jpegs, monkeypatch):
    monkeypatch.setattr(transforms, "_simplejpeg", None)
    expected = _reference(large_jpegs, _generators(len(large_jpegs)))
    assert torch.equal(transforms.train_batch(large_jpegs, _generators(len(large_jpegs)), RESOLUTION,
                                               dct_scaling=True), expected)
