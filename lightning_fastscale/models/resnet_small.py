"""A small ResNet for low-resolution images (He et al. 2016, CIFAR variant) that trains in minutes on a CPU."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .registry import register_model


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def zero_init_last(self) -> None:
        """Zero the last BN's gamma so the block starts as the identity (Goyal et al. 2017)."""
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class ResNetSmall(nn.Module):
    """CIFAR-style ResNet: stem, ``len(widths)`` stages of ``blocks_per_stage`` basic blocks."""

    def __init__(
        self,
        num_classes: int = 10,
        widths: Sequence[int] = (16, 32, 64),
        blocks_per_stage: int | Sequence[int] = 1,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
            raise ValueError(f"widths={list(widths)} must be channel counts >= 1, one per stage, e.g. [16, 32, 64]")
        if isinstance(blocks_per_stage, int):
            blocks_per_stage = [blocks_per_stage] * len(widths)
        if len(blocks_per_stage) != len(widths) or min(blocks_per_stage) < 1:
            raise ValueError(
                f"blocks_per_stage={list(blocks_per_stage)} must give >= 1 block for each "
                f"of the {len(widths)} stages in widths"
            )
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages, channels = [], widths[0]
        for i, (width, count) in enumerate(zip(widths, blocks_per_stage)):
            blocks = []
            for j in range(count):
                blocks.append(BasicBlock(channels, width, 2 if (i > 0 and j == 0) else 1))
                channels = width
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


@register_model("resnet_small")
def resnet_small(num_classes: int = 10, **kwargs) -> ResNetSmall:
    """The default model of the built-in job: widths (16, 32, 64), one block per stage."""
    return ResNetSmall(num_classes=num_classes, **kwargs)


@register_model("resnet20")
def resnet20(num_classes: int = 10, **kwargs) -> ResNetSmall:
    """He et al. 2016's CIFAR ResNet-20: widths (16, 32, 64), three blocks per stage."""
    kwargs.setdefault("widths", (16, 32, 64))
    kwargs.setdefault("blocks_per_stage", 3)
    return ResNetSmall(num_classes=num_classes, **kwargs)


@register_model("linear")
def linear_probe(num_classes: int = 10, resolution: int = 32, in_channels: int = 3) -> nn.Module:
    """A linear classifier on raw pixels: the baseline that shows the built-in task is hard."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * resolution**2, num_classes))
