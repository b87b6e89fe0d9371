"""Training and validation transforms in uint8: crop (Szegedy et al. 2015), resize, flip, batch assembly.

Design and measurements: ``docs/input_pipeline.md`` ("The uint8 transforms", "`train_batch` in detail").
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cv2
import numpy as np
import simplejpeg as _simplejpeg  # the training batch's decoder (less overhead per call than TorchCodec)
import torch
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size

from .jpeg_decode import SampleDecodeError, decode_rgb, decoder_messages, decoder_warnings, strict_decode

# torchvision's antialiased bilinear resize kernel, in its variant that writes into a given tensor
_upsample_bilinear_aa_out = torch.ops.aten._upsample_bilinear2d_aa.out

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

DEFAULT_SCALE = (0.08, 1.0)
DEFAULT_RATIO = (3.0 / 4.0, 4.0 / 3.0)


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator that depends only on ``(seed, epoch, index)``.

    Examples:
        >>> g1, g2 = sample_generator(0, 1, 7), sample_generator(0, 1, 7)
        >>> bool(torch.rand(1, generator=g1) == torch.rand(1, generator=g2))
        True
    """
    # Distinct odd multipliers keep (seed, epoch, index) triples from colliding in 63 bits.
    mixed = (seed * 0x9E3779B97F4A7C15 + epoch * 0xC2B2AE3D27D4EB4F + index * 0x165667B19E3779F9) % (2**63)
    return torch.Generator().manual_seed(mixed)


def random_resized_crop_box(
    height: int,
    width: int,
    generator: torch.Generator,
    scale: tuple[float, float] = DEFAULT_SCALE,
    ratio: tuple[float, float] = DEFAULT_RATIO,
) -> tuple[int, int, int, int]:
    """``(top, left, crop_height, crop_width)`` of a random resized crop (Szegedy et al. 2015, as torchvision's)."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        draws = torch.rand(4, generator=generator, dtype=torch.float64).tolist()
        target_area = area * (scale[0] + (scale[1] - scale[0]) * draws[0])
        aspect = math.exp(log_lo + (log_hi - log_lo) * draws[1])
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(draws[2] * (height - h + 1))
            left = int(draws[3] * (width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def crop_resize_flip(
    image: torch.Tensor, box: tuple[int, int, int, int], size: int, flip: bool
) -> torch.Tensor:
    """Crop ``box`` from a uint8 ``(C, H, W)`` image, resize it to ``size`` (antialiased) and mirror it if ``flip``."""
    top, left, h, w = box
    out = F.resized_crop(image, top, left, h, w, [size, size], antialias=True)
    return out.flip(-1) if flip else out


def draw_crop(
    height: int, width: int, generator: torch.Generator,
    scale: tuple[float, float] = DEFAULT_SCALE, ratio: tuple[float, float] = DEFAULT_RATIO,
) -> tuple[tuple[int, int, int, int], bool]:
    """``(box, flip)`` of one training sample: the random resized crop, then a fair coin."""
    box = random_resized_crop_box(height, width, generator, scale, ratio)
    return box, bool(torch.rand(1, generator=generator).item() < 0.5)


def train_transform(
    data: torch.Tensor, size: int, generator: torch.Generator,
    scale: tuple[float, float] = DEFAULT_SCALE, ratio: tuple[float, float] = DEFAULT_RATIO,
) -> torch.Tensor:
    """Decode, random-resized-crop to ``size`` and flip with probability 1/2; the one-image reference of `train_batch`."""
    image = decode_rgb(data)
    box, flip = draw_crop(image.shape[-2], image.shape[-1], generator, scale, ratio)
    return crop_resize_flip(image, box, size, flip)


def _hwc(image: torch.Tensor) -> Any:
    """The numpy ``(H, W, C)`` view of a pixel-interleaved ``(C, H, W)`` tensor, or None."""
    c, h, w = image.shape
    if image.stride() != (1, w * c, c):
        return None
    return image.permute(1, 2, 0).numpy()


def _pixels(image: torch.Tensor) -> Any:
    """The ``(H, W, C)`` numpy pixels of a ``(C, H, W)`` image: a view where possible, else a copy."""
    pixels = _hwc(image)
    return pixels if pixels is not None else image.permute(1, 2, 0).contiguous().numpy()


def _upscale_linear(src: Any, size: tuple[int, int], dst: Any = None) -> Any:
    """OpenCV's bilinear resize of an enlarged ``(H, W, C)`` uint8 array: torchvision's to within 1 (tested)."""
    return cv2.resize(src, (size[1], size[0]), dst=dst, interpolation=cv2.INTER_LINEAR)


# libjpeg-turbo's DCT-domain reductions that are cheaper than a full decode (benchmarks/README.md)
_DCT_REDUCTIONS = (8, 4, 2)


def _dct_reduction(box: tuple[int, int, int, int], size: int) -> int:
    """The largest of 8, 4, 2 by which the crop ``box`` keeps ``size`` pixels on both axes, else 1."""
    _, _, h, w = box
    return next((d for d in _DCT_REDUCTIONS if h >= d * size and w >= d * size), 1)


def _decode_for_crop(
    data: torch.Tensor, generator: torch.Generator, size: int,
    scale: tuple[float, float], ratio: tuple[float, float], dct_scaling: bool,
) -> tuple[Any, tuple[int, int, int, int] | None, bool]:
    """``(pixels, box, flip)`` of one sample decoded by simplejpeg (at 1/d scale with ``dct_scaling``).

    ``pixels`` is None where simplejpeg refused the data (``box`` None where no crop was drawn yet).
    """
    if _simplejpeg is None:
        return _decode_full(data, generator, scale, ratio)
    raw = data.numpy()
    try:
        if not dct_scaling:
            pixels = _simplejpeg.decode_jpeg(raw, "RGB", strict=True)
            box, flip = draw_crop(pixels.shape[0], pixels.shape[1], generator, scale, ratio)
            return pixels, box, flip
        height, width, _, _ = _simplejpeg.decode_jpeg_header(raw)
    except ValueError:
        return None, None, False
    box, flip = draw_crop(height, width, generator, scale, ratio)
    d = _dct_reduction(box, size)
    h_d, w_d = -(-height // d), -(-width // d)  # libjpeg's scaled size rounds up
    try:
        # simplejpeg decodes at the smallest of libjpeg's M/8 scales whose size reaches these
        # minimums: 1/d (the shape is checked below)
        pixels = _simplejpeg.decode_jpeg(raw, "RGB", min_height=h_d, min_width=w_d, strict=True)
    except ValueError:
        return None, box, flip
    if pixels.shape[:2] != (h_d, w_d):  # another scale than 1/d: TorchCodec decodes at full scale
        return None, box, flip
    if d > 1:
        top, left, h, w = box
        bottom, right = -(-(top + h) // d), -(-(left + w) // d)
        box = (top // d, left // d, bottom - top // d, right - left // d)
    return pixels, box, flip


def _decode_full(
    data: torch.Tensor, generator: torch.Generator, scale: tuple[float, float], ratio: tuple[float, float],
    drawn: tuple[tuple[int, int, int, int], bool] | None = None,
) -> tuple[Any, tuple[int, int, int, int], bool]:
    """`_decode_for_crop` at full scale by TorchCodec: the crop ``drawn`` already, or drawn now."""
    pixels = _pixels(decode_rgb(data))
    box, flip = drawn if drawn is not None else draw_crop(pixels.shape[0], pixels.shape[1], generator, scale, ratio)
    return pixels, box, flip


def _crop_resize_flip_into(
    pixels: Any, box: tuple[int, int, int, int], size: int, flip: bool, slot: torch.Tensor, slot_pixels: Any = None
) -> None:
    """`crop_resize_flip` of ``(H, W, 3)`` numpy ``pixels`` into ``slot`` (through ``slot_pixels``, its numpy view, if any).

    Numpy views throughout: each torch call releases and retakes the GIL the decode threads contend for.
    """
    top, left, h, w = box
    crop = pixels[top : top + h, left : left + w]
    dst = slot_pixels if slot_pixels is not None else np.empty((size, size, 3), np.uint8)
    if h <= size and w <= size:
        _upscale_linear(crop, (size, size), dst)
    else:
        chw = torch.from_numpy(crop).unsqueeze(0).permute(0, 3, 1, 2)
        _upsample_bilinear_aa_out(chw, [size, size], False, None, None, out=torch.from_numpy(dst).unsqueeze(0).permute(0, 3, 1, 2))
    if flip:
        cv2.flip(dst, 1, dst=dst)
    if slot_pixels is None:
        slot.copy_(torch.from_numpy(dst).permute(2, 0, 1))


def val_transform(data: torch.Tensor, size: int, crop_ratio: float = 0.875) -> torch.Tensor:
    """Decode, resize the short side to ``size / crop_ratio`` and centre-crop ``size`` (He et al. 2016); uint8 out."""
    return resize_centre_crop(decode_rgb(data), size, crop_ratio)


def resize_centre_crop(image: torch.Tensor, size: int, crop_ratio: float = 0.875) -> torch.Tensor:
    """The geometry of `val_transform` on a decoded uint8 ``(C, H, W)`` image."""
    short = round(size / crop_ratio)
    h, w = image.shape[-2:]
    new_h, new_w = _compute_resized_output_size((h, w), [short])  # torchvision's own rule
    src = _hwc(image) if new_h >= h and new_w >= w else None
    if src is None:
        image = F.resize(image, [short], antialias=True)
    else:
        image = torch.from_numpy(_upscale_linear(src, (new_h, new_w))).permute(2, 0, 1)
    return F.center_crop(image, [size, size])


_pools: dict[int, ThreadPoolExecutor] = {}  # by thread count; reused across calls
_pools_lock = threading.Lock()


def _forget_pools() -> None:  # a forked child has none of its parent's threads (nor a held lock)
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    """This process's pool of ``threads`` threads, made on first use and kept."""
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="train_batch")
        return _pools[threads]


def map_in_threads(fn: Callable[[int], Any], count: int, threads: int) -> list[BaseException | None]:
    """``fn(i)`` for ``i < count`` in this process's pool of ``threads`` threads; each call's exception or None."""

    def guarded(i: int) -> BaseException | None:
        try:
            fn(i)
        except Exception as err:  # reported by position, below
            return err
        return None

    if threads <= 1 or count <= 1:
        return [guarded(i) for i in range(count)]
    # about four runs of consecutive samples per thread: few tasks, yet images of unequal
    # sizes (decode cost grows with pixels) still even out across the threads
    step = max(1, count // (4 * threads))
    runs = _thread_pool(threads).map(lambda a: [guarded(i) for i in range(a, min(a + step, count))],
                                     range(0, count, step))
    return [err for run in runs for err in run]


def train_batch(
    jpegs: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator],
    resolution: int,
    scale: tuple[float, float] = DEFAULT_SCALE,
    ratio: tuple[float, float] = DEFAULT_RATIO,
    threads: int = 1,
    out: torch.Tensor | None = None,
    dct_scaling: bool = False,
) -> torch.Tensor:
    """Decode, random-resized-crop and flip a whole batch: uint8 ``(N, 3, resolution, resolution)``.

    Sample ``i`` gets the crop and flip `train_transform` draws from ``generators[i]``; a
    damaged sample raises `SampleDecodeError`. Details: ``docs/input_pipeline.md``.

    Examples:
        >>> import io; from PIL import Image
        >>> buf = io.BytesIO(); Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, "JPEG")
        >>> jpeg = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        >>> batch = train_batch([jpeg, jpeg], [sample_generator(0, 0, i) for i in range(2)], 32)
        >>> batch.shape, batch.dtype
        (torch.Size([2, 3, 32, 32]), torch.uint8)
    """
    n = len(jpegs)
    if len(generators) != n:
        raise ValueError(f"train_batch got {n} JPEGs but {len(generators)} generators: give one generator per sample")
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    shape = (n, 3, resolution, resolution)
    if out is None:  # pixel-interleaved, as OpenCV writes and the decoder returns
        out = torch.empty(shape, dtype=torch.uint8, memory_format=torch.channels_last)
    elif tuple(out.shape) != shape or out.dtype != torch.uint8:
        raise ValueError(f"out must be a uint8 tensor of shape {shape}, got {out.dtype} {tuple(out.shape)}")

    # simplejpeg's refusals: position, and the crop where it was drawn from the header
    refused: list[tuple[int, tuple[tuple[int, int, int, int], bool] | None]] = []

    # the slots' (H, W, C) numpy views, where the batch is pixel-interleaved (channels-last)
    slots = out.permute(0, 2, 3, 1).numpy() if n and _hwc(out[0]) is not None else None

    def place(i: int, pixels: Any, box: tuple[int, int, int, int], flip: bool) -> None:
        _crop_resize_flip_into(pixels, box, resolution, flip, out[i], None if slots is None else slots[i])

    def one(i: int) -> None:
        pixels, box, flip = _decode_for_crop(jpegs[i], generators[i], resolution, scale, ratio, dct_scaling)
        if pixels is None:
            refused.append((i, None if box is None else (box, flip)))
        else:
            place(i, pixels, box, flip)

    # TorchCodec writes libjpeg's warnings to file descriptor 2 only: where it decodes the whole
    # batch (no simplejpeg), under one capture; else only simplejpeg's refusals, afterwards, in
    # this thread (other threads' strict decodes wait for them, not for the batch)
    with decoder_messages() if _simplejpeg is None else contextlib.nullcontext([""]) as messages:
        errors = map_in_threads(one, n, threads)
    if refused:
        with decoder_messages() as messages:
            for i, drawn in sorted(refused, key=lambda r: r[0]):
                try:
                    place(i, *_decode_full(jpegs[i], generators[i], scale, ratio, drawn))
                except Exception as err:  # reported by position, below
                    errors[i] = err
    warnings = decoder_warnings(messages[0])
    if any(err is not None for err in errors) or warnings:
        _raise_first_bad(jpegs, errors)
        sys.stderr.write("".join(line + "\n" for line in warnings))  # another thread's, not ours
    return out


def _raise_first_bad(jpegs: Sequence[torch.Tensor], errors: list[BaseException | None]) -> None:
    """Decode the samples again one at a time, strictly; raise for the first that fails here or failed in the batch."""
    for i, jpeg in enumerate(jpegs):
        try:
            strict_decode(decode_rgb, jpeg)
        except Exception as err:
            raise SampleDecodeError(i, f"{type(err).__name__}: {err}") from err
        if errors[i] is not None:  # decoded cleanly alone, failed in the batch: report that
            raise SampleDecodeError(i, f"{type(errors[i]).__name__}: {errors[i]}") from errors[i]


def normalize_on_device(
    images: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    channels_last: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 ``(N, C, H, W)`` on any device -> normalised float ``(x / 255 - mean) / std``, in place on the copy."""
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize_on_device expects a uint8 batch, got {images.dtype}")
    m = torch.tensor(mean, dtype=dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=dtype, device=images.device).view(1, -1, 1, 1)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    out = images.to(dtype=dtype, memory_format=memory_format)
    return out.sub_(m * 255.0).mul_(1.0 / (255.0 * s))


