"""Fast JPEG decode and uint8 augmentation: the CPU half of the input pipeline.

The records that trained ImageNet in minutes all fixed the input pipeline first (Jia et al.
2018 pipelined decoding with compute; Ying et al. 2018 list input-pipeline work as one of
their three system changes; Mikami et al. 2018 used NVIDIA DALI). Here the workers do only
what must happen per image on the CPU:

* decode with TorchCodec's ``decode_jpeg`` (libjpeg-turbo), not PIL; TorchCodec's image
  decoders supersede torchvision's, deprecated since torchvision 0.29, which remain the
  fallback where TorchCodec (>= 0.16, torch >= 2.11) is not installed;
* random-resized-crop and horizontal flip on the **uint8** tensor (the resize reads and
  writes a quarter of the bytes a float pipeline would);
* leave the batch un-normalised: `normalize_on_device` converts to float, normalises
  and optionally switches to ``channels_last`` on the training device, after the 4x smaller
  uint8 batch has crossed the host-to-device link.

Augmentation randomness comes from a generator seeded by ``(seed, epoch, sample index)``
(`sample_generator`), not from worker RNG state, so a sample gets the same crop in a
resumed run as in an uninterrupted one, whatever the worker count.

The crop sampling follows ``RandomResizedCrop`` of Szegedy et al. 2015 (Inception), as
torchvision implements it: scale (0.08, 1), aspect ratio (3/4, 4/3) log-uniform, ten tries,
then a centre crop at the clamped ratio. On CUDA, `decode_jpeg_batch_on_device` decodes
a whole batch with nvJPEG instead. Measured figures are in ``benchmarks/README.md``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torchvision.transforms.v2 import functional as F

try:
    from torchcodec.decoders import decode_jpeg as _torchcodec_decode_jpeg

    def _decode_jpeg_rgb(data: torch.Tensor | list[torch.Tensor], device: torch.device | str = "cpu") -> Any:
        return _torchcodec_decode_jpeg(data, mode="RGB", device=device)

except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as _torchvision_decode_jpeg

    def _decode_jpeg_rgb(data: torch.Tensor | list[torch.Tensor], device: torch.device | str = "cpu") -> Any:
        return _torchvision_decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

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
    """``(top, left, crop_height, crop_width)`` of an Inception-style random resized crop.

    An area fraction in ``scale`` and a log-uniform aspect ratio in ``ratio`` are drawn up to
    ten times until the box fits; otherwise the whole image is cropped to the nearest allowed
    ratio (Szegedy et al. 2015; the same rule as torchvision's ``RandomResizedCrop``).
    """
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


def decode_rgb(data: torch.Tensor) -> torch.Tensor:
    """Decode JPEG bytes (a 1-D uint8 tensor) to a ``(3, H, W)`` uint8 RGB tensor."""
    return _decode_jpeg_rgb(data)


def jpeg_size(data: bytes | torch.Tensor) -> tuple[int, int]:
    """``(height, width)`` read from a JPEG's SOF header, without decoding the pixels."""
    buf = bytes(data.numpy()) if isinstance(data, torch.Tensor) else data
    i = 2
    while i + 9 < len(buf):
        if buf[i] != 0xFF:
            raise ValueError("not a JPEG stream (bad marker)")
        marker = buf[i + 1]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return int.from_bytes(buf[i + 5 : i + 7], "big"), int.from_bytes(buf[i + 7 : i + 9], "big")
        i += 2 + int.from_bytes(buf[i + 2 : i + 4], "big")
    raise ValueError("not a JPEG stream (no frame header)")


def crop_resize_flip(
    image: torch.Tensor, box: tuple[int, int, int, int], size: int, flip: bool
) -> torch.Tensor:
    """Crop ``box`` from a uint8 ``(C, H, W)`` image, resize it to ``size`` x ``size``
    (bilinear, antialiased, still uint8) and mirror it if ``flip``."""
    top, left, h, w = box
    out = F.resized_crop(image, top, left, h, w, [size, size], antialias=True)
    return out.flip(-1) if flip else out


def train_transform(
    data: torch.Tensor, size: int, generator: torch.Generator,
    scale: tuple[float, float] = DEFAULT_SCALE, ratio: tuple[float, float] = DEFAULT_RATIO,
) -> torch.Tensor:
    """Decode, random-resized-crop to ``size`` and flip with probability 1/2; uint8 out."""
    image = decode_rgb(data)
    box = random_resized_crop_box(image.shape[-2], image.shape[-1], generator, scale, ratio)
    flip = bool(torch.rand(1, generator=generator).item() < 0.5)
    return crop_resize_flip(image, box, size, flip)


def val_transform(data: torch.Tensor, size: int, crop_ratio: float = 0.875) -> torch.Tensor:
    """Decode, resize the short side to ``size / crop_ratio`` and centre-crop ``size``; uint8 out.

    The same geometry as the ImageNet evaluation of Krizhevsky et al. 2012 / He et al. 2016
    (resize 256, crop 224), as [`ImageFolderDataModule`][lightning_fastscale.data.ImageFolderDataModule] does it.
    """
    image = decode_rgb(data)
    image = F.resize(image, [round(size / crop_ratio)], antialias=True)
    return F.center_crop(image, [size, size])


def normalize_on_device(
    images: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    channels_last: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 ``(N, C, H, W)`` on any device -> normalised float ``(x / 255 - mean) / std``.

    Computed in place on the converted copy, ``(x - 255 mean) * (1 / (255 std))``, on whatever
    device ``images`` lives on (no further temporaries: on the CPU the allocation of each new
    batch-sized tensor costs as much as the arithmetic); ``channels_last`` returns NHWC memory
    layout, which convolutions on tensor cores prefer.
    """
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize_on_device expects a uint8 batch, got {images.dtype}")
    m = torch.tensor(mean, dtype=dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=dtype, device=images.device).view(1, -1, 1, 1)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    out = images.to(dtype=dtype, memory_format=memory_format)
    return out.sub_(m * 255.0).mul_(1.0 / (255.0 * s))


def decode_jpeg_batch_on_device(
    datas: Sequence[torch.Tensor], device: torch.device | str = "cuda"
) -> list[torch.Tensor]:
    """Decode a list of JPEG byte tensors on a CUDA device in one batched nvJPEG call.

    Returns ``(3, H, W)`` uint8 tensors on ``device``. Raises ``RuntimeError`` without CUDA.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("nvJPEG decode needs a CUDA device; use decode_rgb on the CPU")
    return _decode_jpeg_rgb(list(datas), device=device)
