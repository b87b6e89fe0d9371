"""Loader workers start from a fork server by default (`lightning_fastscale.data.worker_start`).

The hazard it removes, made deterministic: another thread of the training process holds a lock
while the loader starts its workers, and the dataset takes that lock for each sample (as library
code in a worker takes its module's lock). A forked worker inherits the lock held and waits
forever; a worker from the fork server imports the module afresh and reads its batch.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lightning_fastscale.data import ImageFolderDataModule, ProceduralDataModule, ProceduralShapes, StreamingDataModule
from lightning_fastscale.data.convert import convert
from tests.data_streaming_utils import write_tree

HELD = threading.Lock()


class LockingShapes(ProceduralShapes):
    """Takes ``HELD`` for each batch of samples it renders."""

    def __getitems__(self, indices):
        with HELD:
            return super().__getitems__(indices)


@contextmanager
def held_by_another_thread() -> Iterator[None]:
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with HELD:
            taken.set()
            release.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(10)


def locking_datamodule(**kwargs) -> ProceduralDataModule:
    dm = ProceduralDataModule(train_size=16, val_size=8, resolution=8, batch_size=8, num_workers=1, **kwargs)
    dm.train_set = LockingShapes(10, 16, 8, 0, "train", 0.06, 3)
    return dm


def test_by_default_workers_start_beside_a_thread_holding_a_lock_they_need():
    loader = locking_datamodule().train_dataloader()
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    loader.timeout = 120  # a fork server's first start imports torch: seconds on a loaded machine
    with held_by_another_thread():
        images, labels = next(iter(loader))
    assert images.shape == (8, 3, 8, 8) and labels.shape == (8,)


def test_a_forked_worker_inherits_the_held_lock_and_never_reads_its_batch():
    loader = locking_datamodule(multiprocessing_context="fork").train_dataloader()
    loader.timeout = 2  # unlocked, a forked worker's batch takes milliseconds
    with held_by_another_thread():
        batches = iter(loader)  # the worker is forked here
        try:
            with pytest.raises(RuntimeError, match="timed out"):
                next(batches)
        finally:
            for worker in batches._workers:  # stuck for good: ended now, not after the loader's 5 s join
                worker.terminate()


def test_every_datamodule_takes_the_setting_and_refuses_an_unknown_one(tmp_path):
    write_tree(tmp_path, train_per_class=1, val_per_class=1)
    for make in (lambda **k: ProceduralDataModule(train_size=8, val_size=8, **k),
                 lambda **k: ImageFolderDataModule(str(tmp_path), **k)):
        assert make().multiprocessing_context == "forkserver"
        assert make(multiprocessing_context=None).multiprocessing_context is None
        with pytest.raises(ValueError, match=r"multiprocessing_context='forks': must be one of \['forkserver', 'spawn', 'fork'\]"):
            make(multiprocessing_context="forks")


def test_the_streaming_loaders_start_their_workers_from_the_fork_server(tmp_path):
    convert("procedural", tmp_path / "stream", max_side=16, quality=95, num_workers=1,
            procedural={"num_classes": 10, "train_size": 32, "val_size": 8, "resolution": 16, "seed": 0})
    dm = StreamingDataModule(str(tmp_path / "stream"), resolution=16, batch_size=8, num_workers=1)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert loader.multiprocessing_context.get_start_method() == "forkserver"
        images, _ = next(iter(loader))
        assert images.shape == (8, 3, 16, 16)
    assert StreamingDataModule(str(tmp_path / "stream"), resolution=16, num_workers=0).train_dataloader().multiprocessing_context is None
