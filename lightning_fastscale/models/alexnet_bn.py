"""AlexNet-BN: AlexNet with BN after every conv (You et al. 2017) and after pool5 (Jia et al. 2018).

More in ``docs/methods/alexnet_bn.md``.
"""
from __future__ import annotations

import torch
from torch import nn

from .registry import register_model

MIN_RESOLUTION = 31
"""Smallest input side for which pool1 and pool2 still have a 3x3 window to pool."""


def _conv_bn_relu(
    in_channels: int, out_channels: int, kernel: int, stride: int, padding: int
) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, kernel, stride, padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    ]


class AlexNetBN(nn.Module):
    """AlexNet with BN after each conv and after pool5 (You et al. 2017; Jia et al. 2018); ``dropout`` before fc6, fc7."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5, in_channels: int = 3) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1)")
        self.features = nn.Sequential(
            *_conv_bn_relu(in_channels, 96, 11, 4, 2),
            nn.MaxPool2d(3, 2),
            *_conv_bn_relu(96, 256, 5, 1, 2),
            nn.MaxPool2d(3, 2),
            *_conv_bn_relu(256, 384, 3, 1, 1),
            *_conv_bn_relu(384, 384, 3, 1, 1),
            *_conv_bn_relu(384, 256, 3, 1, 1),
        )
        self.pool5 = nn.AdaptiveMaxPool2d(6)
        self.bn_pool5 = nn.BatchNorm2d(256)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) < MIN_RESOLUTION:
            raise ValueError(
                f"AlexNetBN needs images of at least {MIN_RESOLUTION} px, got {tuple(x.shape[-2:])}; "
                "raise the input resolution (the datamodule's resolution, or the smallest size of a "
                "ProgressiveResizing schedule)"
            )
        return self.classifier(self.bn_pool5(self.pool5(self.features(x))))


@register_model("alexnet_bn")
def alexnet_bn(num_classes: int = 1000, **kwargs) -> AlexNetBN:
    """AlexNet-BN of Jia et al. 2018 (``model=alexnet_bn``); kwargs go to `AlexNetBN`."""
    return AlexNetBN(num_classes=num_classes, **kwargs)
