"""The built-in dataset: procedurally rendered shapes, generated on demand at any resolution.

More in ``docs/getting_started.md`` ("The built-in dataset").
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


def _box(u: torch.Tensor, v: torch.Tensor, cx: float, cy: float, hx: float, hy: float) -> torch.Tensor:
    return torch.maximum((u - cx).abs() - hx, (v - cy).abs() - hy)


def _disk(u: torch.Tensor, v: torch.Tensor, cx: float, cy: float, r: float) -> torch.Tensor:
    return torch.hypot(u - cx, v - cy) - r


def _polygon(u: torch.Tensor, v: torch.Tensor, sides: int, radius: float) -> torch.Tensor:
    angles = [2 * math.pi * k / sides + math.pi / 2 for k in range(sides)]
    apothem = radius * math.cos(math.pi / sides)
    halves = [u * math.cos(a + math.pi / sides) + v * math.sin(a + math.pi / sides) - apothem for a in angles]
    return torch.stack(halves).amax(0)


def _chevron(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    c, s = math.cos(math.pi / 4), math.sin(math.pi / 4)
    arm1 = _box(u * c + v * s, -u * s + v * c, 0.2, 0.0, 0.6, 0.17)
    arm2 = _box(u * c - v * s, u * s + v * c, 0.2, 0.0, 0.6, 0.17)
    return torch.minimum(arm1, arm2)


# Signed distance (negative inside) of each class's shape in canonical coordinates, where the
# shape fits the unit disk. Shapes were chosen to stay distinct under rotation and scale.
SHAPES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "disk": lambda u, v: _disk(u, v, 0, 0, 0.9),
    "ring": lambda u, v: (torch.hypot(u, v) - 0.75).abs() - 0.17,
    "square": lambda u, v: _box(u, v, 0, 0, 0.7, 0.7),
    "frame": lambda u, v: (torch.maximum(u.abs(), v.abs()) - 0.6).abs() - 0.13,
    "triangle": lambda u, v: _polygon(u, v, 3, 0.95),
    "plus": lambda u, v: torch.minimum(_box(u, v, 0, 0, 0.9, 0.25), _box(u, v, 0, 0, 0.25, 0.9)),
    "bars": lambda u, v: torch.minimum(_box(u, v, 0, 0.5, 0.9, 0.17), _box(u, v, 0, -0.5, 0.9, 0.17)),
    "star": lambda u, v: torch.hypot(u, v) - (0.6 + 0.32 * torch.cos(5 * torch.atan2(v, u))),
    "crescent": lambda u, v: torch.maximum(_disk(u, v, 0, 0, 0.9), -_disk(u, v, 0.45, 0, 0.7)),
    "three_dots": lambda u, v: torch.stack(
        [_disk(u, v, 0.6 * math.cos(a), 0.6 * math.sin(a), 0.3) for a in (math.pi / 2, 7 * math.pi / 6, 11 * math.pi / 6)]
    ).amin(0),
    "hexagon": lambda u, v: _polygon(u, v, 6, 0.9),
    "half_disk": lambda u, v: torch.maximum(_disk(u, v, 0, 0.3, 0.9), 0.3 - v),
    "corner": lambda u, v: torch.minimum(_box(u, v, -0.55, 0, 0.25, 0.85), _box(u, v, 0, -0.6, 0.8, 0.25)),
    "two_squares": lambda u, v: torch.minimum(_box(u, v, -0.4, -0.4, 0.33, 0.33), _box(u, v, 0.4, 0.4, 0.33, 0.33)),
    "target": lambda u, v: torch.minimum((torch.hypot(u, v) - 0.78).abs() - 0.12, _disk(u, v, 0, 0, 0.3)),
    "chevron": _chevron,
}
MAX_CLASSES = len(SHAPES)
_SHAPE_FNS = list(SHAPES.values())

# Normalisation that maps the rendered [0, 1] pixels to roughly zero mean, unit variance.
MEAN, STD = 0.5, 0.25


def _segment_distance(x: torch.Tensor, y: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Distance from each pixel to segments ``seg[b] = (x0, y0, x1, y1)``; x, y are (R, R)."""
    x0, y0, x1, y1 = (seg[:, i, None, None] for i in range(4))
    dx, dy = x1 - x0, y1 - y0
    t = (((x - x0) * dx + (y - y0) * dy) / (dx * dx + dy * dy + 1e-9)).clamp(0, 1)
    return torch.hypot(x - x0 - t * dx, y - y0 - t * dy)


class ProceduralShapes(Dataset):
    """Shape-classification images rendered on demand; sample ``i`` depends only on its seed.

    Args:
        num_classes: how many shape classes (2 to ``MAX_CLASSES``).
        size: number of samples in this split.
        resolution: image side in pixels (>= 8); `set_resolution` changes it between epochs.
        seed: dataset seed; splits are disjoint streams of the same seed.
        split: ``"train"``, ``"val"`` or ``"test"``.
        noise: standard deviation of the per-pixel Gaussian noise on the [0, 1] image.
        clutter: number of distractor strokes and blobs per image.
        normalize: return ``(x - 0.5) / 0.25`` instead of [0, 1] pixels.
    """

    def __init__(
        self,
        num_classes: int = 10,
        size: int = 10000,
        resolution: int = 32,
        seed: int = 0,
        split: str = "train",
        noise: float = 0.06,
        clutter: int = 3,
        normalize: bool = True,
    ) -> None:
        if not 2 <= num_classes <= MAX_CLASSES:
            raise ValueError(f"num_classes={num_classes} must be between 2 and {MAX_CLASSES}")
        if size < 1:
            raise ValueError(f"dataset size must be positive, got {size}")
        if split not in _SPLIT_IDS:
            raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
        if noise < 0 or clutter < 0:
            raise ValueError(f"noise={noise} and clutter={clutter} must be >= 0")
        self.num_classes, self.size, self.seed, self.split = num_classes, size, seed, split
        self.noise, self.clutter, self.normalize = noise, clutter, normalize
        self.set_resolution(resolution)

    def set_resolution(self, resolution: int) -> None:
        """Render future samples at ``resolution`` x ``resolution`` pixels."""
        if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 8:
            raise ValueError(f"resolution must be an integer >= 8 pixels, got {resolution!r}")
        self.resolution = resolution

    def __len__(self) -> int:
        return self.size

    def label(self, index: int) -> int:
        """The class of sample ``index``: balanced, independent of the rendering."""
        return index % self.num_classes

    def _params(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], index])
        pose = [rng.uniform(0, 2 * math.pi), rng.uniform(0.5, 0.8), *rng.uniform(-0.3, 0.3, 2)]
        fg, bg = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
        while np.abs(fg - bg).sum() < 0.6:  # keep the shape visible against its background
            fg = rng.uniform(0, 1, 3)
        gradient = rng.uniform(-0.25, 0.25, 2)
        strokes = rng.uniform(-1, 1, (self.clutter, 4))
        stroke_colors = rng.uniform(0, 1, (self.clutter, 3))
        blob = rng.uniform(-1, 1, (self.clutter, 2))
        noise_seed = rng.integers(2**62)
        return np.concatenate(
            [pose, fg, bg, gradient, strokes.ravel(), stroke_colors.ravel(), blob.ravel(), [noise_seed]]
        )

    def render(self, indices: Sequence[int]) -> torch.Tensor:
        """Render ``indices`` as a float tensor (B, 3, R, R)."""
        r, k = self.resolution, self.clutter
        p = torch.as_tensor(np.stack([self._params(i) for i in indices]), dtype=torch.float64)
        b = len(indices)
        theta, scale, cx, cy = (p[:, i].float() for i in range(4))
        fg, bg, grad = p[:, 4:7].float(), p[:, 7:10].float(), p[:, 10:12].float()
        o = 12
        strokes = p[:, o : o + 4 * k].float().view(b, k, 4)
        stroke_colors = p[:, o + 4 * k : o + 7 * k].float().view(b, k, 3)
        blobs = p[:, o + 7 * k : o + 9 * k].float().view(b, k, 2)
        noise_seeds = p[:, -1].long()

        coords = (torch.arange(r, dtype=torch.float32) + 0.5) / r * 2 - 1
        y, x = torch.meshgrid(coords, coords, indexing="ij")
        pixel = 2.0 / r  # width of one pixel in image coordinates, for anti-aliasing

        img = bg[:, :, None, None] + (grad[:, 0, None, None] * x + grad[:, 1, None, None] * y)[:, None]
        img = img.expand(b, 3, r, r).clone()

        def paint(dist: torch.Tensor, color: torch.Tensor) -> None:
            alpha = torch.sigmoid(-dist / (0.5 * pixel))[:, None]
            img.mul_(1 - alpha).add_(alpha * color[:, :, None, None])

        for j in range(k - 1):  # strokes and blobs behind the shape
            paint(_segment_distance(x, y, strokes[:, j]) - 0.03, stroke_colors[:, j])
            paint(torch.hypot(x - blobs[:, j, 0, None, None], y - blobs[:, j, 1, None, None]) - 0.08, stroke_colors[:, j].flip(1))

        # Canonical coordinates: undo translation, rotation and scale of each sample's shape.
        dx, dy = x - cx[:, None, None], y - cy[:, None, None]
        cos, sin = torch.cos(theta)[:, None, None], torch.sin(theta)[:, None, None]
        s = scale[:, None, None]
        u, v = (cos * dx + sin * dy) / s, (-sin * dx + cos * dy) / s
        labels = torch.tensor([self.label(i) for i in indices])
        shape_dist = torch.empty(b, r, r)
        for c in labels.unique().tolist():
            sel = labels == c
            shape_dist[sel] = _SHAPE_FNS[c](u[sel], v[sel]) * s[sel]
        paint(shape_dist, fg)
        if k:  # one stroke in front, partly occluding the shape
            paint(_segment_distance(x, y, strokes[:, k - 1]) - 0.02, stroke_colors[:, k - 1])

        if self.noise:
            noise = torch.stack(
                [torch.randn(3, r, r, generator=torch.Generator().manual_seed(int(sd))) for sd in noise_seeds]
            )
            img.add_(noise, alpha=self.noise)
        img.clamp_(0, 1)
        return (img - MEAN) / STD if self.normalize else img

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        images = self.render(indices)
        return [(images[j], self.label(i)) for j, i in enumerate(indices)]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a dataset of {self.size}")
        return self.__getitems__([index])[0]
