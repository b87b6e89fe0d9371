"""Resume on another world size: the same global batch, epoch order, LR and (within the
reduction-order noise) weights as the uninterrupted run; a refusal naming the world sizes that
keep the global batch where it cannot be split (plain ``pl.Trainer``, CPU, gloo). Streaming data:
the rest of the interrupted epoch step by step as the uninterrupted run, through litdata's elastic resume."""
from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_fastscale.callbacks import BatchSizeRamp, BNSpan, WarmupDecayLR
from lightning_fastscale.callbacks.batch_size_ramp import world_sizes_that_split
from lightning_fastscale.data import ImageFolderDataModule, StreamingDataModule
from lightning_fastscale.data.convert import convert
from lightning_fastscale.data.streaming_datasets import DecodedStreamingDataset
from lightning_fastscale.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from lightning_fastscale.faults import ExactResume, WorldSizeChangeError
from lightning_fastscale.faults.exact_resume import GlobalOrderSampler
from tests.distributed import ReleaseProcessGroup

SIZE, GLOBAL_BATCH, EPOCHS = 130, 24, 2  # 5 global batches per epoch; the last 10 samples of each order are the tail
STEPS = SIZE // GLOBAL_BATCH * EPOCHS


class Indexed(Dataset):
    """Fixed random features; each sample carries its index so a run can say what it trained on."""

    def __init__(self, size: int = SIZE, shape: tuple[int, ...] = (8,)) -> None:
        self.x = torch.randn(size, *shape, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i % 4, i


class IndexedData(pl.LightningDataModule):
    """A ``BatchSizeControllable`` datamodule: the resume sets the per-device batch."""

    def __init__(self, batch_size: int, dataset: Dataset | None = None) -> None:
        super().__init__()
        self.train_batch_size, self.dataset = batch_size, dataset or Indexed()

    def set_train_batch_size(self, per_device_batch_size: int) -> None:
        self.train_batch_size = per_device_batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.train_batch_size, shuffle=True, drop_last=True)


class Recorder(pl.LightningModule):
    """Per optimizer step: the sample ids this rank trained on, the samples and the LR."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 4)
        self.folder, self.steps, self._ids = folder, [], []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self._ids += ids.tolist()
        return F.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.steps.append({"step": self.global_step, "epoch": self.current_epoch, "ids": self._ids,
                           "lr": optimizer.param_groups[0]["lr"], "accumulation": self.trainer.accumulate_grad_batches})
        self._ids = []

    def on_train_end(self):
        Path(self.folder, f"rank{self.global_rank}-of{self.trainer.world_size}.json").write_text(json.dumps(
            {"steps": self.steps, "weights": [p.detach().flatten().tolist() for p in self.parameters()]}))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        # sized by the Trainer's step estimate: the steps per epoch must not depend on the world size
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StopAfter(pl.Callback):
    """Checkpoint after optimizer step ``step`` (mid-epoch) and stop, as a preempted job would."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not trainer.fit_loop.epoch_loop._should_accumulate():
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def fit(folder: Path, devices: int, batch_size: int, ckpt_path: str | None = None, stop: int | None = None,
        max_per_device_batch: int | None = None, accumulate: int = 1, ramp: dict[int, int] | None = None,
        every_epoch: bool = False, plugins: list | None = None, extra: list | None = None,
        module: type[Recorder] = Recorder, dataset: Dataset | None = None,
        data: Callable[..., pl.LightningDataModule] | None = None) -> None:
    folder.mkdir(parents=True)
    pl.seed_everything(0)  # the same initial weights in every run
    callbacks = [ExactResume(max_per_device_batch=max_per_device_batch), ReleaseProcessGroup(), *(extra or [])]
    if ramp is not None:
        callbacks.append(BatchSizeRamp(ramp, max_per_device_batch=12))
    if every_epoch:  # Lightning's epoch-end checkpoint, after the ramp has prepared the next epoch
        callbacks.append(ModelCheckpoint(dirpath=folder / "epochs", save_top_k=-1))
    if stop is not None:
        callbacks.append(StopAfter(stop, str(folder / "stopped.ckpt")))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto",
                         max_epochs=EPOCHS, accumulate_grad_batches=accumulate, callbacks=callbacks,
                         default_root_dir=folder, log_every_n_steps=1, plugins=plugins)
    data_module = IndexedData(batch_size, dataset) if data is None else data(batch_size=batch_size)
    trainer.fit(module(str(folder)), data_module, ckpt_path=ckpt_path)


def read(folder: Path, devices: int) -> tuple[list[dict], list[torch.Tensor]]:
    """The run's optimizer steps (sample ids of all ranks together) and rank 0's final weights."""
    ranks = [json.loads((folder / f"rank{r}-of{devices}.json").read_text()) for r in range(devices)]
    steps = [{**step, "ids": sorted(i for rank in ranks for i in rank["steps"][n]["ids"])}
             for n, step in enumerate(ranks[0]["steps"])]
    return steps, [torch.tensor(w) for w in ranks[0]["weights"]]


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_global_order_sampler_splits_one_order_over_any_world_size():
    """Optimizer step i covers order[i*G:(i+1)*G] on every (per-device batch, accumulation,
    world size) with that G; a per-device batch holds the same samples on every layout with
    that per-device batch; the tail (fewer than G samples) is left out on every world size."""
    order = list(GlobalOrderSampler(SIZE, GLOBAL_BATCH, 1, 0, 1, seed=3, epoch=1))
    assert len(order) == 120 and len(set(order)) == 120
    groups = {}
    for world_size, per_device in ((2, 12), (3, 8), (4, 6), (2, 6), (1, 12)):
        accumulation = GLOBAL_BATCH // (per_device * world_size)
        ranks = [list(GlobalOrderSampler(SIZE, per_device, accumulation, r, world_size, seed=3, epoch=1))
                 for r in range(world_size)]
        micro = [sorted(ranks[r][i:i + per_device]) for r in range(world_size) for i in range(0, len(ranks[r]), per_device)]
        groups.setdefault(per_device, sorted(micro))
        assert sorted(micro) == groups[per_device], (world_size, per_device)
        for step in range(5):
            steps = range(step * accumulation * per_device, (step + 1) * accumulation * per_device)
            seen = sorted(ranks[r][i] for r in range(world_size) for i in steps)
            assert seen == sorted(order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]), (world_size, per_device, step)
    assert order != list(GlobalOrderSampler(SIZE, GLOBAL_BATCH, 1, 0, 1, seed=3, epoch=2))  # a new order each epoch


def test_a_global_batch_that_does_not_split_is_refused_naming_the_world_sizes_that_keep_it():
    checkpoint = {"epoch": 0, "callbacks": {"ExactResume": {
        "world_size": 4, "global_order": True, "global_batch": 24, "accumulation": 1}}}
    trainer = SimpleNamespace(world_size=5, ckpt_path="run/last.ckpt", callbacks=[], datamodule=IndexedData(6))
    with pytest.raises(WorldSizeChangeError, match=r"written by 4 processes, this run has 5: its global batch 24 "
                       r"does not split.*Resume with the Trainer's devices x num_nodes = 1 or 2 or 3 or 4 or 6 or 8,"):
        ExactResume().on_load_checkpoint(trainer, None, checkpoint)
    # under a memory ceiling only the splits that use the device well count (34 = 2 x 17 on 16 does not)
    assert world_sizes_that_split([34], None, near=3) == [1, 2, 17, 34]
    assert world_sizes_that_split([34], 16, near=3) == [17, 34]
    checkpoint["callbacks"]["ExactResume"]["global_batch"] = 34
    trainer.world_size = 1
    with pytest.raises(WorldSizeChangeError, match="global batch 34 does not split.*= 17 or 34,"):
        ExactResume(max_per_device_batch=16).on_load_checkpoint(trainer, None, checkpoint)
    # a checkpoint whose position is per rank (not litdata's loader) is refused with the reason
    checkpoint["callbacks"]["ExactResume"]["global_order"] = False
    with pytest.raises(WorldSizeChangeError, match="its data position is per rank.*not litdata's StreamingDataLoader"):
        ExactResume().on_load_checkpoint(trainer, None, checkpoint)
    # litdata's loader on a filesystem where it reads whole chunks: refused with litdata's reason
    checkpoint["callbacks"]["ExactResume"]["elastic_refusal"] = "litdata reads this data in whole chunks"
    with pytest.raises(WorldSizeChangeError, match="litdata reads this data in whole chunks"):
        ExactResume().on_load_checkpoint(trainer, None, checkpoint)


@pytest.mark.slow  # 18 process starts of a Lightning Trainer on 2 cores
def test_stopped_on_4_ranks_resumed_on_2_then_3_matches_the_uninterrupted_run(tmp_path):
    """Global batch 24: 4 ranks x 6 stop after step 3 (epoch 0), 2 ranks x 12 resume and stop
    after step 7 (epoch 1), 3 ranks x 8 finish. Each step trains on the uninterrupted run's
    samples (every sample of an epoch's 120 once) with its LR; the final weights are within 10x
    the distance between uninterrupted runs that differ only in reduction order (2 ranks x 12
    against 4 x 6 and 3 x 8; the linear model has no batch norm)."""
    for devices in (2, 4, 3):
        fit(tmp_path / f"full{devices}", devices, GLOBAL_BATCH // devices)
    fit(tmp_path / "a", 4, 6, stop=3)
    fit(tmp_path / "b", 2, 6, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"), stop=7)  # the resume sets 12
    fit(tmp_path / "c", 3, 24, ckpt_path=str(tmp_path / "b" / "stopped.ckpt"))  # the resume sets 8

    full, full_weights = read(tmp_path / "full2", 2)
    (on4, _), (on2, _), (on3, elastic_weights) = read(tmp_path / "a", 4), read(tmp_path / "b", 2), read(tmp_path / "c", 3)
    elastic = on4 + on2 + on3
    assert [len(on4), len(on2), len(on3)] == [3, 4, 3]
    assert [s["step"] for s in elastic] == list(range(STEPS)) == [s["step"] for s in full]
    assert all(len(s["ids"]) == GLOBAL_BATCH for s in elastic)
    for reference in (full, read(tmp_path / "full4", 4)[0], read(tmp_path / "full3", 3)[0]):
        assert [s["ids"] for s in elastic] == [s["ids"] for s in reference]
        assert [s["lr"] for s in elastic] == [s["lr"] for s in reference]
    for epoch in range(EPOCHS):
        seen = [i for s in elastic if s["epoch"] == epoch for i in s["ids"]]
        assert len(seen) == len(set(seen)) == SIZE // GLOBAL_BATCH * GLOBAL_BATCH
    order_noise = max(distance(full_weights, read(tmp_path / f"full{d}", d)[1]) for d in (4, 3))
    off = distance(elastic_weights, full_weights)
    print(f"reduction-order noise {order_noise:.3g}, elastic run off the uninterrupted by {off:.3g}")
    assert off <= 10 * order_noise


def test_stopped_on_2_ranks_resumed_on_1_with_accumulation_sees_the_rest_of_the_epoch_once(tmp_path):
    """2 ranks x 12 stop after step 2; 1 rank under a ceiling of 12 per device resumes as
    12 x 2 accumulation: each step trains on the uninterrupted run's 24 samples with its LR."""
    fit(tmp_path / "full", 1, 12, accumulate=2)
    fit(tmp_path / "a", 2, 12, stop=2)
    fit(tmp_path / "b", 1, 12, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"), max_per_device_batch=12)
    full, _ = read(tmp_path / "full", 1)
    (on2, _), (on1, _) = read(tmp_path / "a", 2), read(tmp_path / "b", 1)
    assert [len(on2), len(on1)] == [2, STEPS - 2]
    assert [s["ids"] for s in on2 + on1] == [s["ids"] for s in full]
    assert [s["lr"] for s in on2 + on1] == [s["lr"] for s in full]
    assert {s["accumulation"] for s in on1} == {2}
    first_epoch = [i for s in on2 + on1 if s["epoch"] == 0 for i in s["ids"]]
    assert len(first_epoch) == len(set(first_epoch)) == SIZE // GLOBAL_BATCH * GLOBAL_BATCH


def test_a_ramp_stage_that_does_not_split_names_the_world_sizes_where_every_stage_does():
    ramp = BatchSizeRamp({0: 24, 1: 48}, max_per_device_batch=12)
    with pytest.raises(ValueError, match=r"every stage splits: \[1, 2, 3, 4, 6, 8\]"):
        ramp.check_trainer(SimpleNamespace(world_size=5, accumulate_grad_batches=1))
    assert [p.accumulation for p in ramp.check_trainer(SimpleNamespace(world_size=2, accumulate_grad_batches=1))] == [1, 2]


@pytest.mark.slow  # four fastscale-train runs
def test_fastscale_train_sigterm_on_2_ranks_then_resume_auto_on_1(tmp_path):
    """``fastscale-train`` (default callbacks and cosine schedule, built-in data): SIGTERM on 2
    ranks x 16 mid-epoch 1, ``resume=auto`` with ``trainer.devices=1`` under
    ``max_per_device_batch=16`` (16 x 2 accumulation, so batch norm still normalises over 16
    images): the run ends at the uninterrupted step count with its LR schedule, its weights
    within 10x the reduction-order difference (2 ranks against 1 rank x 2 accumulation)."""
    from benchmarks.fault_helpers import finish, finish_all, start
    from tests.test_faults_resume import PROCEDURAL, RUN, STOP_STEP, batch_log, load, preempt

    run = [*RUN, *PROCEDURAL, "data.batch_size=16", "callbacks.exact_resume.max_per_device_batch=16"]
    two = ["trainer.devices=2", "strategy=ddp"]
    full2, full1, elastic = tmp_path / "full2", tmp_path / "full1", tmp_path / "elastic"
    finish_all(start(full2, *two, *batch_log(full2), run=run),
               start(elastic, *two, *batch_log(elastic), *preempt(2), run=run))
    code, out = finish(start(full1, "trainer.accumulate_grad_batches=2", *batch_log(full1), run=run))
    assert code == 0, out[-3000:]
    code, out = finish(start(elastic, "trainer.devices=1", "resume=auto", *batch_log(elastic), run=run))
    assert code == 0, out[-3000:]
    assert "written by 2 processes, this run has 1: global batch 32 kept as 16 per device x 2 accumulation x 1" in out
    a, b, c = load(full2), load(full1), load(elastic)
    assert a["global_step"] == b["global_step"] == c["global_step"] == 16 > STOP_STEP
    assert a["lr_schedulers"] == c["lr_schedulers"] == b["lr_schedulers"]
    # the parameters (the BN running statistics follow the per-device updates, not the steps)
    weights = [[v for k, v in s["state_dict"].items() if "running" not in k and "tracked" not in k] for s in (a, b, c)]
    order_noise, off = distance(weights[0], weights[1]), distance(weights[0], weights[2])
    print(f"reduction-order noise {order_noise:.3g}, elastic run off the uninterrupted by {off:.3g}")
    assert off <= 10 * order_noise


@pytest.mark.slow  # about 20 s: two 2-rank runs
def test_a_batch_size_ramp_resumed_on_another_world_size_keeps_each_stages_global_batch(tmp_path):
    """Ramp 24 -> 48 at epoch 1 (at most 12 per device): 2 ranks stop after step 3; 1 rank
    resumes as 12 x 2, then 12 x 4 in epoch 1: the uninterrupted run's samples and LR per step.
    From the epoch-end checkpoint of epoch 0 too."""
    ramp = {0: GLOBAL_BATCH, 1: 2 * GLOBAL_BATCH}
    fit(tmp_path / "full", 2, 12, ramp=ramp, every_epoch=True)
    fit(tmp_path / "a", 2, 12, stop=3, ramp=ramp)
    fit(tmp_path / "b", 1, 12, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"), ramp=ramp)
    full, _ = read(tmp_path / "full", 2)
    (on2, _), (on1, _) = read(tmp_path / "a", 2), read(tmp_path / "b", 1)
    assert [len(s["ids"]) for s in full] == [24] * 5 + [48] * 2
    assert [s["ids"] for s in on2 + on1] == [s["ids"] for s in full]
    assert [s["lr"] for s in on2 + on1] == [s["lr"] for s in full]
    assert [s["accumulation"] for s in on1] == [2, 2, 4, 4]
    fit(tmp_path / "c", 1, 12, ckpt_path=str(tmp_path / "full" / "epochs" / "epoch=0-step=5.ckpt"), ramp=ramp)
    epoch1, _ = read(tmp_path / "c", 1)
    assert [(s["ids"], s["lr"], s["accumulation"]) for s in epoch1] == [(s["ids"], s["lr"], 4) for s in full[5:]]


RAMP_SIZE = 576  # 6 global batches of 96, then 3 of 192: every sample in every epoch


class BNRecorder(Recorder):
    """`Recorder` on 3 x 6 x 6 images through a convolution with batch norm; the LR is `WarmupDecayLR`'s."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                       torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 4))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit_ramp(folder: Path, devices: int, span: int | None = 8, **kwargs) -> None:
    """Global batch 96 ramped to 192 at epoch 1 (at most 64 per device), warmup then poly decay scaled
    by the global batch, BN over ``span`` images (None: plain BN over each device's batch)."""
    extra = [BatchSizeRamp({0: 96, 1: 192}, max_per_device_batch=64), WarmupDecayLR(warmup_epochs=0.5, reference_batch=96)]
    fit(folder, devices, 96 // devices, extra=extra + ([BNSpan(span)] if span else []), module=BNRecorder,
        dataset=Indexed(RAMP_SIZE, (3, 6, 6)), **kwargs)


@pytest.fixture
def run_folder(tmp_path):
    """``tmp_path``; afterwards, also when the test fails or times out, the ranks it spawned are
    killed and the folder removed."""
    before = {p.pid for p in multiprocessing.active_children()}
    yield tmp_path
    for process in multiprocessing.active_children():
        if process.pid not in before:
            process.kill()
            process.join(10)
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow  # 7 Trainers, 19 processes
@pytest.mark.timeout(240)
def test_a_ramp_from_96_to_192_stopped_on_4_ranks_resumed_on_2_then_3_matches_the_uninterrupted_run(run_folder):
    """Ramp 96 -> 192 at epoch 1, ``BNSpan(8)`` (the smallest per-device batch is 24): 4 ranks x 24
    stop after step 3 (epoch 0); 2 ranks resume as 48, then 48 x 2 accumulation at 192, and stop
    after step 7 (epoch 1); 3 ranks finish as 64. Each step trains on the uninterrupted 4-rank
    run's samples (every sample once per epoch) with its global batch and LR; the final weights
    are within 10x the reduction-order noise (2 ranks against 1 rank x 48 x 2, then 64 x 3), which
    is smaller than the error of a resume that lost the span (plain BN over 64 images)."""
    tmp = run_folder
    for devices in (4, 2, 1):
        fit_ramp(tmp / f"full{devices}", devices)
    fit_ramp(tmp / "a", 4, stop=3)
    fit_ramp(tmp / "b", 2, ckpt_path=str(tmp / "a" / "stopped.ckpt"), stop=7)
    fit_ramp(tmp / "c", 3, ckpt_path=str(tmp / "b" / "stopped.ckpt"))
    fit_ramp(tmp / "wrong", 3, span=None, ckpt_path=str(tmp / "b" / "stopped.ckpt"))

    full, full_weights = read(tmp / "full4", 4)
    (on4, _), (on2, _), (on3, weights) = read(tmp / "a", 4), read(tmp / "b", 2), read(tmp / "c", 3)
    elastic = on4 + on2 + on3
    assert [len(on4), len(on2), len(on3)] == [3, 4, 2]
    assert [s["step"] for s in elastic] == [s["step"] for s in full] == list(range(9))
    assert [len(s["ids"]) for s in elastic] == [len(s["ids"]) for s in full] == [96] * 6 + [192] * 3
    assert [s["accumulation"] for s in elastic] == [1] * 6 + [2, 1, 1]
    assert [s["ids"] for s in elastic] == [s["ids"] for s in full]
    for epoch in range(EPOCHS):
        assert sorted(i for s in elastic if s["epoch"] == epoch for i in s["ids"]) == list(range(RAMP_SIZE))
    lrs = [s["lr"] for s in full]
    assert [s["lr"] for s in elastic] == lrs and len(set(lrs)) == len(lrs)  # warmup, ramp scaling, decay
    full1, full1_weights = read(tmp / "full1", 1)
    assert [s["accumulation"] for s in full1] == [2] * 6 + [3] * 3
    # zero noise (bitwise-equal reductions) would demand a bitwise-equal resumed run
    noise = distance(read(tmp / "full2", 2)[1], full1_weights)
    off, wrong = distance(weights, full_weights), distance(read(tmp / "wrong", 3)[1], full_weights)
    print(f"reduction-order noise {noise:.3g}, elastic run off the uninterrupted by {off:.3g}, "
          f"without the span by {wrong:.3g}")
    assert off <= 10 * noise < wrong


def _topk_worker(rank: int, world_size: int, folder: str, ckpt_path: str | None) -> dict:
    """One ``hier_ring`` (one rank per node) + top-k run on this process group, checkpointing every
    3 steps; with ``ckpt_path`` it reports this rank's residuals as restored, before the first step."""
    import os

    from lightning_fastscale.strategies import HierarchicalAllReduceStrategy

    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    restored = {}

    class Restored(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            # lists: a tensor sent through the result queue can outlive its shared-memory file
            restored.update({k: t.tolist() for k, t in trainer.strategy.hook_state.topk.errors.items()})

    pl.seed_everything(0)
    strategy = HierarchicalAllReduceStrategy(ranks_per_node=1, compression="topk", topk_ratio=0.1)
    callbacks = [ExactResume(), Restored(), ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)]
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=EPOCHS,
                         callbacks=callbacks, default_root_dir=folder, log_every_n_steps=1)
    trainer.fit(Recorder(folder), IndexedData(GLOBAL_BATCH // world_size), ckpt_path=ckpt_path)
    return {"restored": restored, "step": trainer.global_step, "iteration": trainer.strategy.hook_state.iteration}


def _bucket_sums(files: list[dict]) -> dict:
    """Per bucket, the sum over ranks of its residual (chunks joined in order)."""
    sums: dict = {}
    for errors in files:
        for bucket in {key[0] for key in errors}:
            joined = torch.cat([errors[k] for k in sorted(k for k in errors if k[0] == bucket)])
            sums[bucket] = sums[bucket] + joined if bucket in sums else joined
    return sums


@pytest.mark.slow  # three gloo runs: 4, 3 and 3 ranks
def test_hier_ring_topk_resumed_on_another_world_size_keeps_the_residual_sum(tmp_path):
    """``hier_ring`` (one rank per node) + top-k 10 %: 3 ranks resume the checkpoint 4 ranks wrote
    after step 3 (top-k on since step 2): the residuals restored sum, per bucket, to what the 4
    ranks saved, the hook goes on from its iteration, each step trains the 4-rank run's samples
    with its LR. Top-k on 3 nodes is other arithmetic than on 4 (other coordinates kept, the
    residuals re-split), so the final weights cannot match the 4-rank run's within reduction-order
    noise; they are no farther from them than an uninterrupted 3-rank run's."""
    from tests.distributed import run_distributed

    run_distributed(_topk_worker, 4, str(tmp_path / "a"), None, timeout=120)
    run_distributed(_topk_worker, 3, str(tmp_path / "full3"), None, timeout=120)
    ckpt = tmp_path / "a" / "epoch=0-step=3.ckpt"
    saved = [torch.load(f"{ckpt}.topk-residuals-rank{r}", weights_only=True) for r in range(4)]
    resumed = run_distributed(_topk_worker, 3, str(tmp_path / "b"), str(ckpt), timeout=120)
    kept = _bucket_sums([s["errors"] for s in saved])
    assert kept and all(t.abs().sum() > 0 for t in kept.values())  # the residuals were in use
    restored = _bucket_sums([{k: torch.tensor(v) for k, v in r["restored"].items()} for r in resumed])
    assert restored.keys() == kept.keys()
    for bucket in kept:
        torch.testing.assert_close(restored[bucket], kept[bucket], rtol=0, atol=1e-6)
    assert {s["iteration"] for s in saved} == {3}
    assert [r["step"] for r in resumed] == [STEPS] * 3 and len({r["iteration"] for r in resumed}) == 1
    (full, full_weights), (on3, weights) = read(tmp_path / "a", 4), read(tmp_path / "b", 3)
    assert [(s["step"], s["ids"], s["lr"]) for s in on3] == [(s["step"], s["ids"], s["lr"]) for s in full[3:]]
    off, bound = distance(weights, full_weights), distance(read(tmp_path / "full3", 3)[1], full_weights)
    print(f"resumed run off the uninterrupted 4-rank run by {off:.3g}, the uninterrupted 3-rank run by {bound:.3g}")
    assert off <= bound


class InfAtStep1(pl.Callback):
    """An inf in the (all-reduced) gradient at step 1: LARS skips the step, the loss scaler halves."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == 1:
            pl_module.net.weight.grad[0, 0] = float("inf")


class StateAtStart(pl.Callback):
    """Saves the precision plugin's state (loss scaler, skip counts) and the optimizer's as restored."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        torch.save({"plugin": trainer.precision_plugin.state_dict(),
                    "optimizer": trainer.optimizers[0].state_dict()["state"]}, self.path)


@pytest.mark.slow  # a 2-rank and a 1-rank run
def test_lars_and_its_loss_scaler_survive_a_world_size_change(tmp_path):
    """``LARSMixedPrecision("16-mixed")`` on 2 ranks, one step skipped for an inf (scale halved),
    stop after step 3; resumed on 1 rank x 2 accumulation: the loss scaler (scale, growth
    tracker), the skip counts and LARS's momentum buffers are as saved, and the run finishes."""
    from lightning_fastscale.precision import LARSMixedPrecision

    def lars():
        return [LARSMixedPrecision("16-mixed", "cpu", eta=0.01, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))]

    fit(tmp_path / "a", 2, 12, stop=3, plugins=lars(), extra=[InfAtStep1()])
    ckpt = torch.load(tmp_path / "a" / "stopped.ckpt", weights_only=False)
    start = tmp_path / "restored.pt"
    fit(tmp_path / "b", 1, 12, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"), max_per_device_batch=12,
        plugins=lars(), extra=[StateAtStart(str(start))])
    saved, restored = ckpt["LARSMixedPrecision"], torch.load(start, weights_only=False)
    assert saved["skipped_steps"] == 1 and saved["scaler"]["scale"] == 2.0**7
    assert restored["plugin"] == saved
    momentum = ckpt["optimizer_states"][0]["state"]
    assert momentum and restored["optimizer"].keys() == momentum.keys()
    for key, state in momentum.items():
        torch.testing.assert_close(restored["optimizer"][key]["momentum_buffer"], state["momentum_buffer"], rtol=0, atol=0)
    on1, _ = read(tmp_path / "b", 1)
    assert [s["step"] for s in on1] == list(range(3, STEPS)) and {s["accumulation"] for s in on1} == {2}


# -- streaming data: litdata's own elastic resume, the global batch and schedule kept by ExactResume --

STREAM_SIZE = 96  # 6 global batches of 16 per epoch, as 8 x 2 ranks or 8 x 2 accumulation on 1


def id_sample(index: int) -> tuple[torch.Tensor, int, int]:
    """8 features and a label, both functions of the index: a run's samples can be replayed from its ids."""
    return torch.randn(8, generator=torch.Generator().manual_seed(index)), index % 4, index


class IdSamples(DecodedStreamingDataset):
    """Each stored sample as `id_sample` of its index: what a rank trained on, without decoding."""

    def decode(self, item):
        return id_sample(int(item["index"]))


class IdStreaming(StreamingDataModule):
    dataset_class = IdSamples

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch


@pytest.fixture(scope="module")
def id_stream(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ids") / "stream"  # several small chunks, as litdata shards real data
    convert("procedural", root, max_side=16, quality=95, num_workers=1, chunk_bytes="8KB", verbose=False,
            procedural={"num_classes": 4, "train_size": STREAM_SIZE, "val_size": 8, "resolution": 16, "seed": 0})
    return root


def fit_stream(root: Path, folder: Path, devices: int, workers: int, accumulate: int = 1, ckpt_path: str | None = None,
               stop: int | None = None) -> list[dict]:
    """A plain Trainer on the streaming datamodule, 8 per device (at most 8 on a resume); its steps."""
    folder.mkdir(parents=True)
    pl.seed_everything(0)
    callbacks = [ExactResume(max_per_device_batch=8), ReleaseProcessGroup()]
    if stop is not None:
        callbacks.append(StopAfter(stop, str(folder / "stopped.ckpt")))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp_spawn" if devices > 1 else "auto",
                         max_epochs=EPOCHS, accumulate_grad_batches=accumulate, callbacks=callbacks,
                         default_root_dir=folder, log_every_n_steps=1)
    data = IdStreaming(str(root), resolution=16, batch_size=8, num_workers=workers, device_prefetch=False)
    trainer.fit(Recorder(str(folder)), data, ckpt_path=ckpt_path)
    return read(folder, devices)[0]


def epoch_ids(steps: list[dict], epoch: int) -> list[list[int]]:
    return [s["ids"] for s in steps if s["epoch"] == epoch]


def check_carried(elastic: list[dict], interrupted: list[dict], next_epoch: list[dict]) -> None:
    """The interrupted epoch step by step as ``interrupted`` ran it (every sample once), the next
    epoch as ``next_epoch`` (the new world size's litdata order, every sample once), ``interrupted``'s LR."""
    assert [s["step"] for s in elastic] == list(range(12))
    assert epoch_ids(elastic, 0) == epoch_ids(interrupted, 0)
    assert epoch_ids(elastic, 1) == epoch_ids(next_epoch, 1)
    for epoch in range(EPOCHS):
        seen = [i for ids in epoch_ids(elastic, epoch) for i in ids]
        assert len(seen) == len(set(seen)) == STREAM_SIZE
    assert [s["lr"] for s in elastic] == [s["lr"] for s in interrupted]


def replay(steps: list[dict]) -> list[torch.Tensor]:
    """The final weights of one process training on ``steps``' samples (all ranks', one batch per
    step) with their LR: a Trainer run on those samples up to the order its reductions add in."""
    pl.seed_everything(0)  # the initial weights of `fit_stream`
    model = Recorder("")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    for step in steps:
        optimizer.param_groups[0]["lr"] = step["lr"]
        optimizer.zero_grad()
        model.training_step(default_collate([id_sample(i) for i in step["ids"]]), 0).backward()
        optimizer.step()
    return [p.detach().flatten() for p in model.parameters()]


def check_weights(elastic: list[dict], last: tuple[Path, int], uninterrupted: list[tuple[Path, int]]) -> None:
    """The elastic run's final weights (its ``last`` part's folder and world size) off the replay of
    its samples by at most 10x the most an uninterrupted run is off the replay of its own (the
    reduction-order noise; zero demands bitwise equality). Not against an uninterrupted run's
    weights: litdata's order depends on the world size, so no two runs on different world
    sizes, and no resumed run, train the samples of one uninterrupted run step by step."""
    noise = max(distance(weights, replay(steps)) for steps, weights in (read(*run) for run in uninterrupted))
    off = distance(read(*last)[1], replay(elastic))
    print(f"reduction-order noise {noise:.3g}, elastic run off the replay of its samples by {off:.3g}")
    assert off <= 10 * noise


def test_litdata_loaders_are_carried_unless_litdata_reads_whole_chunks(id_stream, monkeypatch):
    """What ExactResume records of a training loader: litdata's loader reading item by item can
    change world size; reading whole chunks (its window shuffle, forced here as on NFS) it cannot."""
    from torch.utils.data import DataLoader as PlainLoader

    from lightning_fastscale.faults.exact_resume import _litdata_elastic_refusal

    data = IdStreaming(str(id_stream), resolution=16, batch_size=8, num_workers=0, device_prefetch=False)
    assert _litdata_elastic_refusal(data.train_dataloader()) == ""
    assert "not litdata's" in _litdata_elastic_refusal(PlainLoader(Indexed(), batch_size=8))
    monkeypatch.setenv("LITDATA_POSIX_FAST", "1")
    assert "litdata reads this data in whole chunks (forced filesystem" in _litdata_elastic_refusal(data.train_dataloader())


@pytest.mark.slow  # 5 Trainers, 2 of them on 2 processes, each rank with a loader worker
def test_streaming_stopped_on_2_ranks_resumed_on_1_with_accumulation_then_stopped_again(id_stream, tmp_path):
    """litdata keeps the epoch's stream as 2 ranks read it; 1 rank resumes as 8 x 2 accumulation
    (step 2), is stopped again (step 4) and resumed on 1 rank: the second resume continues the
    restriped stream (with loader workers litdata leaves it unmarked; our loader marks it)."""
    full2 = fit_stream(id_stream, tmp_path / "full2", 2, 1)
    full1 = fit_stream(id_stream, tmp_path / "full1", 1, 1, accumulate=2)
    fit_stream(id_stream, tmp_path / "a", 2, 1, stop=2)
    fit_stream(id_stream, tmp_path / "b", 1, 1, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"), stop=4)
    # resumed as configured (accumulation 1): the layout b was carried to is carried again, not the configured one
    fit_stream(id_stream, tmp_path / "c", 1, 1, ckpt_path=str(tmp_path / "b" / "stopped.ckpt"))
    parts = [read(tmp_path / name, devices)[0] for name, devices in (("a", 2), ("b", 1), ("c", 1))]
    assert [len(p) for p in parts] == [2, 2, 8]
    assert {s["accumulation"] for s in parts[1] + parts[2]} == {2}
    check_carried(parts[0] + parts[1] + parts[2], full2, full1)
    check_weights(parts[0] + parts[1] + parts[2], (tmp_path / "c", 1), [(tmp_path / "full2", 2), (tmp_path / "full1", 1)])


@pytest.mark.slow  # 4 Trainers, 2 of them on 2 processes
def test_streaming_stopped_on_1_rank_with_accumulation_resumed_on_2(id_stream, tmp_path):
    """1 rank x 8 x 2 accumulation stopped after step 3, resumed on 2 ranks x 8 (background
    loader, ``num_workers=0``): the rest of epoch 0 as the 1-rank run, epoch 1 as a 2-rank run."""
    full1 = fit_stream(id_stream, tmp_path / "full1", 1, 0, accumulate=2)
    full2 = fit_stream(id_stream, tmp_path / "full2", 2, 0)
    on1 = fit_stream(id_stream, tmp_path / "a", 1, 0, accumulate=2, stop=3)
    on2 = fit_stream(id_stream, tmp_path / "b", 2, 0, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"))
    assert [len(on1), len(on2)] == [3, 9]
    assert {s["accumulation"] for s in on2} == {1}
    check_carried(on1 + on2, full1, full2)
    check_weights(on1 + on2, (tmp_path / "b", 2), [(tmp_path / "full1", 1), (tmp_path / "full2", 2)])


@pytest.fixture(scope="module")
def stream_104(tmp_path_factory) -> Path:
    """104 samples: 104 % (2 x 8) = 8 but 104 % 8 = 0, so a rank's 13 batches of 8 are not whole steps of 2."""
    root = tmp_path_factory.mktemp("ids104") / "stream"
    convert("procedural", root, max_side=16, quality=95, num_workers=1, chunk_bytes="8KB", verbose=False,
            procedural={"num_classes": 4, "train_size": 104, "val_size": 8, "resolution": 16, "seed": 0})
    return root


def whole_global_batches_each_epoch(steps: list[dict]) -> None:
    """6 optimizer steps of 16 distinct samples per epoch: 96 of the 104, each once."""
    for epoch in range(EPOCHS):
        ids = epoch_ids(steps, epoch)
        seen = [i for step in ids for i in step]
        assert [len(step) for step in ids] == [16] * 6, epoch
        assert len(seen) == len(set(seen)) == 96


def test_streaming_epoch_with_accumulation_ends_on_a_whole_global_batch(stream_104, tmp_path):
    """1 rank x 8 x 2 accumulation on 104 samples: litdata gives the rank 13 batches; the epoch is
    cut to 12, so Lightning does not step on a last group of one batch (8 samples)."""
    whole_global_batches_each_epoch(fit_stream(stream_104, tmp_path / "on1", 1, 0, accumulate=2))


@pytest.mark.slow  # 4 Trainers, 2 of them on 2 processes
def test_streaming_epochs_have_the_same_steps_on_every_world_size_that_keeps_the_global_batch(stream_104, tmp_path):
    """104 samples, global batch 16: 2 ranks x 8 and 1 rank x 8 x 2 both train 96 samples in 6
    steps per epoch; 2 ranks stopped after step 3 and resumed on 1 train the uninterrupted 2-rank
    run's rest of epoch 0 and then the 1-rank run's epoch 1, 12 steps in all."""
    full2 = fit_stream(stream_104, tmp_path / "full2", 2, 0)
    full1 = fit_stream(stream_104, tmp_path / "full1", 1, 0, accumulate=2)
    for steps in (full2, full1):
        whole_global_batches_each_epoch(steps)
    on2 = fit_stream(stream_104, tmp_path / "a", 2, 0, stop=3)
    on1 = fit_stream(stream_104, tmp_path / "b", 1, 0, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"))
    assert [len(on2), len(on1)] == [3, 9] and {s["accumulation"] for s in on1} == {2}
    check_carried(on2 + on1, full2, full1)


@pytest.mark.slow  # three fastscale-train runs, two of them on 2 ranks
def test_fastscale_train_streaming_sigterm_on_2_ranks_then_resume_auto_on_1(tmp_path):
    """``fastscale-train data=streaming`` (default callbacks, cosine schedule): SIGTERM on 2 ranks
    x 16 mid-epoch 1, ``resume=auto`` on 1 rank as 16 x 2 accumulation: exit 0 at the
    uninterrupted step count with its LR schedule."""
    from benchmarks.fault_helpers import finish, finish_all, start
    from tests.test_faults_resume import RUN, load, preempt

    root = tmp_path / "stream"
    convert("procedural", root, max_side=16, quality=95, num_workers=1, verbose=False,
            procedural={"num_classes": 10, "train_size": 128, "val_size": 32, "resolution": 16, "seed": 0})
    final = ["+callbacks.final._target_=benchmarks.fault_helpers.FinalCheckpoint"]
    run = [*RUN, "data=streaming", f"data.root={root}", "data.num_workers=0", "data.batch_size=16",
           "callbacks.exact_resume.max_per_device_batch=16"]
    two = ["trainer.devices=2", "strategy=ddp"]
    full, elastic = tmp_path / "full", tmp_path / "elastic"
    out = finish_all(start(full, *two, *final, f"+callbacks.final.path={full / 'final.ckpt'}", run=run),
                     start(elastic, *two, *preempt(2, step=5), run=run))[1]
    assert "stopped after step 6 (epoch 1)" in out  # 4 steps per epoch
    code, out = finish(start(elastic, "trainer.devices=1", "resume=auto", *final,
                             f"+callbacks.final.path={elastic / 'final.ckpt'}", run=run))
    assert code == 0, out[-3000:]
    assert "written by 2 processes, this run has 1: global batch 32 kept as 16 per device x 2 accumulation x 1" in out
    a, b = load(full), load(elastic)
    assert a["global_step"] == b["global_step"] == 8
    assert a["lr_schedulers"] == b["lr_schedulers"]


# -- the image folder: the global order of the built-in data, each sample's crop from (seed, epoch, index) --

IMAGE_RES = 8


def write_id_tree(root: Path) -> Path:
    """SIZE training JPEGs whose mean colour spells their id (3 channels x 8 levels 32 apart,
    pixel noise of +-12 around it, so each crop's pixels differ), 4 classes; 1 val image per class."""
    rng = np.random.default_rng(0)
    for split, count in (("train", SIZE), ("val", 4)):
        for i in range(count):
            folder = root / split / f"n{i % 4:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = np.array([i // 64, i // 8 % 8, i % 8]) * 32 + 16
            pixels = np.clip(colour + rng.integers(-12, 13, (20, 24, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:03d}.JPEG", quality=95)
    return root


class ImageRecorder(Recorder):
    """`Recorder` on images: each sample as ``"<id read from its colour>:<hash of its crop's pixels>"``."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * IMAGE_RES * IMAGE_RES, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        levels = (((x * std + mean) * 255).mean((2, 3)) - 16).div(32).round().long()
        ids = (levels * torch.tensor([64, 8, 1])).sum(1)
        self._ids += [f"{int(i):03d}:{hashlib.sha1(image.numpy().tobytes()).hexdigest()[:16]}" for i, image in zip(ids, x)]
        return F.cross_entropy(self.net(x), y)


@pytest.mark.slow  # 4 Trainers, two on 2 processes, with image decoding
def test_image_folder_stopped_on_2_ranks_resumed_on_1_with_accumulation_sees_the_rest_of_the_epoch_once(tmp_path):
    """``ImageFolderDataModule``: 2 ranks x 12 (a loader worker each) stop after step 2; 1 rank
    resumes as 12 x 2 accumulation: each step trains on the uninterrupted 1-rank run's samples
    (no workers), each with the same random crop and flip, every sample of an epoch once, its LR.
    Resumed on 2 ranks again from the 1-rank run's epoch-end checkpoint: the uninterrupted epoch 1."""
    root = write_id_tree(tmp_path / "tree")
    data = functools.partial(ImageFolderDataModule, str(root), resolution=IMAGE_RES, num_workers=1)
    fit(tmp_path / "full", 1, 12, accumulate=2, module=ImageRecorder,
        data=functools.partial(ImageFolderDataModule, str(root), resolution=IMAGE_RES, num_workers=0))
    fit(tmp_path / "a", 2, 12, stop=2, data=data, module=ImageRecorder)
    fit(tmp_path / "b", 1, 12, ckpt_path=str(tmp_path / "a" / "stopped.ckpt"), max_per_device_batch=12, data=data,
        module=ImageRecorder, every_epoch=True)
    # and from b's epoch-end checkpoint back on 2 ranks: Lightning makes that iterator before it settles the epoch
    fit(tmp_path / "c", 2, 12, ckpt_path=str(next((tmp_path / "b" / "epochs").glob("epoch=0-*.ckpt"))), data=data,
        module=ImageRecorder)
    full, _ = read(tmp_path / "full", 1)
    (on2, _), (on1, _), (again, _) = read(tmp_path / "a", 2), read(tmp_path / "b", 1), read(tmp_path / "c", 2)
    assert [len(on2), len(on1)] == [2, STEPS - 2] and {s["accumulation"] for s in on1} == {2}
    assert [s["ids"] for s in on2 + on1] == [s["ids"] for s in full]
    assert [s["ids"] for s in again] == [s["ids"] for s in full if s["epoch"] == 1]
    assert [s["lr"] for s in on2 + on1] == [s["lr"] for s in full]
    for epoch in range(EPOCHS):
        seen = [int(i.split(":")[0]) for s in on2 + on1 if s["epoch"] == epoch for i in s["ids"]]
        assert len(seen) == len(set(seen)) == SIZE // GLOBAL_BATCH * GLOBAL_BATCH and set(seen) <= set(range(SIZE))
    crops = [{i.split(":")[0]: i for s in full if s["epoch"] == e for i in s["ids"]} for e in range(EPOCHS)]
    assert all(crops[0][k] != crops[1][k] for k in crops[0].keys() & crops[1].keys())  # a new crop each epoch
