"""Zero-initialise the last BN gamma of every residual branch (Goyal et al. 2017, section 5.1; Jia et al. 2018).

Method card: ``docs/methods/zero_init_residual_bn.md``.
"""
from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchvision.models import resnet as tv_resnet
from typing_extensions import override


def _torchvision_last_bn(block: nn.Module) -> nn.Module | None:
    if isinstance(block, tv_resnet.Bottleneck):
        return block.bn3
    if isinstance(block, tv_resnet.BasicBlock):
        return block.bn2
    return None


def zero_init_residual_bn(model: nn.Module) -> list[str]:
    """Zero the gamma of the last BN in each residual branch of ``model`` (Goyal et al. 2017).

    Returns the names of the blocks done.

    Supported blocks: torchvision's, and any with a ``zero_init_last()`` method (timm's convention).
    """
    done: list[str] = []
    for name, block in model.named_modules():
        zero_init_last = getattr(block, "zero_init_last", None)
        if callable(zero_init_last):
            zero_init_last()
            done.append(name)
            continue
        last_bn = _torchvision_last_bn(block)
        if last_bn is not None and getattr(last_bn, "weight", None) is not None:
            nn.init.zeros_(last_bn.weight)
            done.append(name)
    if not done:
        raise ValueError(
            f"ZeroInitResidualBN: {type(model).__name__} has no residual block it knows "
            "(torchvision BasicBlock/Bottleneck, or a block with a zero_init_last() method as in "
            "timm); give your residual blocks a zero_init_last() method that zeroes the last "
            "BN's weight, or remove the callback"
        )
    return done


class ZeroInitResidualBN(pl.Callback):
    """Apply `zero_init_residual_bn` to the LightningModule once, before training starts.

    Runs in ``setup("fit")``, before a checkpoint's weights are restored; a module is zeroed once only.

    Examples:
        >>> from torchvision.models import resnet18
        >>> model = resnet18(num_classes=10)
        >>> len(zero_init_residual_bn(model)), float(model.layer1[0].bn2.weight.detach().abs().sum())
        (8, 0.0)
    """

    # Kept on the module (not in the callback) so it travels with it, e.g. into spawned workers.
    _DONE_FLAG = "_fastscale_zero_init_residual_bn_done"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or getattr(pl_module, self._DONE_FLAG, False):
            return
        blocks = zero_init_residual_bn(pl_module)
        setattr(pl_module, self._DONE_FLAG, True)
        rank_zero_info(f"ZeroInitResidualBN: zeroed the last BN gamma of {len(blocks)} residual blocks")
