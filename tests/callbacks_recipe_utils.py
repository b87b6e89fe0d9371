"""Small deterministic Lightning fixtures shared by the recipe-callback tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastscale.param_groups import param_groups_without_decay


def tensor_loader(
    n: int = 32, batch_size: int = 8, resolution: int = 8, classes: int = 4, seed: int = 0
) -> DataLoader:
    """A fixed, unshuffled loader of random images and labels (same data in every epoch)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, resolution, resolution, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def make_trainer(
    tmp_path: Path, callbacks: list[pl.Callback], max_epochs: int = 1, **kwargs: Any
) -> pl.Trainer:
    """A single-process CPU Trainer with Lightning's defaults, writing only under ``tmp_path``."""
    return pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        callbacks=callbacks,
        deterministic=True,
        **kwargs,
    )


class TinyClassifier(pl.LightningModule):
    """conv(bias) - BN - ReLU - pool - linear, trained with ``self.criterion`` and SGD.

    ``configure_optimizers`` builds SGD over ``self.parameters()`` (the ordinary pattern), or over
    ``param_groups_without_decay(self)`` with ``no_decay_on_bias_norm``, plus an optional per-step LambdaLR. Training and validation steps record what they computed so
    tests can recompute the losses by hand; validation deliberately uses ``self.criterion`` too.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        weight_decay: float = 0.1,
        with_scheduler: bool = False,
        classes: int = 4,
        no_decay_on_bias_norm: bool = False,
    ) -> None:
        super().__init__()
        self.model = model or nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(6, classes),
        )
        self.criterion = nn.CrossEntropyLoss()
        self.weight_decay = weight_decay
        self.with_scheduler = with_scheduler
        self.no_decay_on_bias_norm = no_decay_on_bias_norm
        self.train_records: list[tuple[int, torch.Tensor, torch.Tensor, float, float]] = []
        self.val_records: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        self.train_records.append(
            (self.current_epoch, logits.detach().clone(), y, loss.item(), self.criterion.label_smoothing)
        )
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_records.append((logits.detach().clone(), y, self.criterion(logits, y).item()))

    def configure_optimizers(self) -> Any:
        params = param_groups_without_decay(self) if self.no_decay_on_bias_norm else self.parameters()
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=self.weight_decay)
        if not self.with_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
