"""A datamodule with injected bottlenecks for the doctor's tests and scenarios benchmark.

Random in-memory images (fast data), optionally made slow: ``sample_delay_s`` sleeps in the
dataset for every sample (a slow loader, which more workers can hide), ``slow_rank`` sleeps
``rank_delay_s`` once per training batch on that rank only (a straggler). Hydra builds it from
``data._target_=tests.doctor_helpers.InjectedDataModule``.
"""
from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class _Images(Dataset):
    def __init__(self, size: int, resolution: int, num_classes: int, delay_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 3, resolution, resolution, generator=g)
        self.y = torch.randint(0, num_classes, (size,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class InjectedDataModule(pl.LightningDataModule):
    """Random images with an optional slow loader or one slow rank (see the module docstring)."""

    def __init__(self, num_classes: int = 10, resolution: int = 32, batch_size: int = 16, train_size: int = 512,
                 num_workers: int = 0, sample_delay_s: float = 0.0, slow_rank: int | None = None,
                 rank_delay_s: float = 0.0) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.train_resolution = resolution
        self.train_batch_size = batch_size
        self.num_workers = num_workers
        self.persistent_workers = False
        self.prefetch_factor = None
        self.slow_rank, self.rank_delay_s = slow_rank, rank_delay_s
        self.train_set = _Images(train_size, resolution, num_classes, sample_delay_s)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.train_batch_size, shuffle=True, drop_last=True,
                          num_workers=self.num_workers, persistent_workers=self.persistent_workers,
                          prefetch_factor=self.prefetch_factor)

    def val_dataloader(self) -> DataLoader:
        # the doctor runs no validation (limit_val_batches=0); defined so the module's validation_step has a loader
        return DataLoader(self.train_set, batch_size=self.train_batch_size)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        trainer = self.trainer
        if trainer is not None and trainer.training and trainer.global_rank == self.slow_rank:
            time.sleep(self.rank_delay_s)
        return batch
