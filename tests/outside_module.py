"""A user's own LightningModule and DataModule, written without this package (for the doctor's tests)."""
from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SleepyImages(Dataset):
    """Random 3x8x8 images; ``delay`` seconds of sleep per sample (an input-bound loader with 0 workers)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.delay:
            time.sleep(self.delay)
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 8, 8, generator=g), i % 4


class OutsideData(pl.LightningDataModule):
    def __init__(self, delay: float = 0.0, size: int = 512, batch_size: int = 8) -> None:
        super().__init__()
        self.delay, self.size, self.batch_size, self.num_workers = delay, size, batch_size, 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SleepyImages(self.size, self.delay), batch_size=self.batch_size,
                          num_workers=self.num_workers, shuffle=True)


class OutsideModule(pl.LightningModule):
    def __init__(self, width: int = 16, depth: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(192, width)]
        for _ in range(depth - 1):
            layers += [nn.ReLU(), nn.Linear(width, width)]
        self.net = nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
