"""Epoch-end and mid-epoch resume of map-style data read by loader workers: a worker-fed loader
draws its first indices when its iterator is made, which Lightning does on a resume before it
sets the sampler's epoch (plain ``pl.Trainer``, CPU, gloo)."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_fastscale.data import ProceduralDataModule
from tests.test_faults_resume_elastic import GLOBAL_BATCH, SIZE, IndexedData, Recorder, fit, read

RES = 8


class WorkerData(IndexedData):
    """`IndexedData` read by ``workers`` loader processes."""

    def __init__(self, batch_size: int, workers: int = 1, persistent: bool = False) -> None:
        super().__init__(batch_size)
        self.workers, self.persistent = workers, persistent

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.train_batch_size, shuffle=True, drop_last=True,
                          num_workers=self.workers, persistent_workers=self.persistent)


class ShapesRecorder(Recorder):
    """`Recorder` on the built-in data: each sample as a hash of its pixels (a sample's image depends only on its index)."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * RES * RES, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self._ids += [hashlib.sha1(image.numpy().tobytes()).hexdigest()[:16] for image in x]
        return F.cross_entropy(self.net(x), y)


def shapes(batch_size: int, **loader) -> ProceduralDataModule:
    return ProceduralDataModule(num_classes=4, train_size=SIZE, val_size=8, resolution=RES, batch_size=batch_size, **loader)


CASES = {
    "indexed-1rank-worker": (1, functools.partial(WorkerData, workers=1), Recorder),
    "indexed-2ranks-persistent-worker": (2, functools.partial(WorkerData, workers=1, persistent=True), Recorder),
    "shapes-1rank-default": (1, shapes, ShapesRecorder),
    "shapes-2ranks-worker": (2, functools.partial(shapes, num_workers=1), ShapesRecorder),
}


@pytest.mark.parametrize("case", [pytest.param(name, marks=[pytest.mark.slow] if CASES[name][0] > 1 else [])
                                  for name in CASES])  # 2 ranks: about 40 s, 5 Trainers on 2 processes
def test_resumed_at_an_epoch_end_then_mid_epoch_trains_the_uninterrupted_epoch(tmp_path: Path, case: str):
    """Uninterrupted 2 epochs with Lightning's epoch-end checkpoint; resumed from the end of epoch 0
    and stopped after step 6 (in epoch 1); resumed from there: epoch 1 step by step as uninterrupted.
    Stopped after epoch 0's last batch (before its end) and resumed: epoch 1 as uninterrupted too."""
    devices, data, module = CASES[case]
    batch = GLOBAL_BATCH // devices
    fit(tmp_path / "full", devices, batch, every_epoch=True, data=data, module=module)
    epoch_end = next((tmp_path / "full" / "epochs").glob("epoch=0-*.ckpt"))
    fit(tmp_path / "b", devices, batch, ckpt_path=str(epoch_end), stop=7, data=data, module=module)
    fit(tmp_path / "c", devices, batch, ckpt_path=str(tmp_path / "b" / "stopped.ckpt"), data=data, module=module)
    full = read(tmp_path / "full", devices)[0]
    resumed = read(tmp_path / "b", devices)[0] + read(tmp_path / "c", devices)[0]
    epoch0 = [s["ids"] for s in full if s["epoch"] == 0]
    epoch1 = [s["ids"] for s in full if s["epoch"] == 1]
    assert [s["step"] for s in resumed] == [s["step"] for s in full if s["epoch"] == 1]
    assert [s["ids"] for s in resumed[:2]] != epoch0[:2], "the resumed epoch replayed epoch 0's order"
    assert [s["ids"] for s in resumed] == epoch1
    assert [s["lr"] for s in resumed] == [s["lr"] for s in full if s["epoch"] == 1]
    fit(tmp_path / "d", devices, batch, stop=5, data=data, module=module)  # 5 steps per epoch
    fit(tmp_path / "e", devices, batch, ckpt_path=str(tmp_path / "d" / "stopped.ckpt"), data=data, module=module)
    assert [s["ids"] for s in read(tmp_path / "e", devices)[0]] == epoch1
