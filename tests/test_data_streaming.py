"""StreamingDataModule: transforms, protocol, DDP sharding, mid-epoch resume, num_workers auto, errors."""
import json
import os
import shutil
import threading
import time
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from litdata import StreamingDataset
from torch import nn

from lightning_fastscale.data import ImageFolderDataModule, StreamingDataModule, jpeg_decode, transforms
from lightning_fastscale.data.background_loader import BackgroundStreamingDataLoader
from lightning_fastscale.data.device_prefetch import DevicePrefetcher
from lightning_fastscale.data.stored_format import CorruptDataError
from lightning_fastscale.data.streaming import DecodedStreamingDataset, EpochAwareStreamingDataLoader
from lightning_fastscale.data.worker_autotune import WorkerCountCache, pick_smallest_within
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy

from .data_streaming_utils import convert_tree
from .distributed import run_distributed


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """A converted folder shared read-only by the tests of this module (24 train, 6 val)."""
    tmp = tmp_path_factory.mktemp("stream")
    return convert_tree(tmp, max_side=64)


def _dm(root, **kw):
    kw.setdefault("num_workers", 0)
    return StreamingDataModule(str(root), **{"resolution": 32, "batch_size": 4, **kw})


def test_batches_are_uint8_and_normalised_on_device_like_imagefolder(stream):
    dm = _dm(stream)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32) and labels.dtype == torch.int64
    x, y = dm.on_after_batch_transfer((images, labels), 0)
    mean = torch.tensor(transforms.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(transforms.IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x, (images.float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, labels)
    cl = transforms.normalize_on_device(images, channels_last=True)
    assert cl.is_contiguous(memory_format=torch.channels_last) and torch.allclose(cl, x, atol=1e-5)

    # Validation: the same resize + centre crop as ImageFolderDataModule on the source files
    # (which were stored at quality 95, so only JPEG re-encoding differs).
    reference = ImageFolderDataModule(str(stream.parent / "tree"), resolution=32, batch_size=6, num_workers=0)
    ref_x, ref_y = next(iter(reference.val_dataloader()))
    val_u8, val_y = next(iter(_dm(stream, val_batch_size=6).val_dataloader()))
    val_x, _ = dm.on_after_batch_transfer((val_u8, val_y), 0)
    order = torch.argsort(val_y * 100 + torch.arange(6), stable=True)  # val is read in index order
    assert torch.equal(val_y[order], ref_y)
    # Each class's first file (120 px wide) was stored at 64 px, the others at full size: those
    # differ only by the JPEG re-encoding.
    diff = (val_x[order] - ref_x).abs().mean((1, 2, 3))
    assert diff[1::2].max() < 0.05, diff  # normalised units


def test_crop_box_follows_random_resized_crop_rules():
    g = torch.Generator().manual_seed(0)
    fractions, ratios = [], []
    for _ in range(300):
        top, left, h, w = transforms.random_resized_crop_box(300, 400, g)
        assert 0 <= top and top + h <= 300 and 0 <= left and left + w <= 400
        fractions.append(h * w / 120000)
        ratios.append(w / h)
    assert min(fractions) >= 0.07 and max(fractions) <= 1.0 and 0.4 < sum(fractions) / 300 < 0.65
    assert min(ratios) > 0.7 and max(ratios) < 1.4
    assert transforms.random_resized_crop_box(10, 1000, g)[2:] == (10, 13)  # fallback: clamp to 4/3
    a = transforms.random_resized_crop_box(300, 400, transforms.sample_generator(1, 2, 3))
    assert a == transforms.random_resized_crop_box(300, 400, transforms.sample_generator(1, 2, 3))


def test_decode_gives_the_pixels_pil_and_torchvision_give(stream):
    """The decoder behind ``decode_rgb`` (TorchCodec, or torchvision where it is missing) reads a
    JPEG to the same pixels as PIL, the decoder of ImageFolderDataModule, and torchvision."""
    from PIL import Image
    from torchvision.io import decode_jpeg

    files = sorted((stream.parent / "tree" / "train").rglob("*.JPEG"))[:6]
    for path in files:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        decoded = jpeg_decode.decode_rgb(data)
        with Image.open(path) as image:
            pil = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
        assert decoded.dtype == torch.uint8 and torch.equal(decoded, pil), path
        with warnings.catch_warnings():  # torchvision's decoders are deprecated from 0.29
            warnings.simplefilter("ignore")
            assert torch.equal(decoded, decode_jpeg(data)), path


def test_protocol_changes_batch_size_and_resolution_between_loaders(stream):
    dm = _dm(stream)
    dm.set_train_batch_size(3)
    dm.set_train_resolution(24)
    dm.set_val_resolution(40)
    assert next(iter(dm.train_dataloader()))[0].shape == (3, 3, 24, 24)
    # 6 validation samples in batches of at most 4: two near-equal batches of 3
    assert [x.shape for x, _ in dm.val_dataloader()] == [(3, 3, 40, 40)] * 2
    with pytest.raises(ValueError, match="max_side=64"):
        dm.set_train_resolution(96)
    with pytest.raises(ValueError, match="resolution=128 .* --max-side 128"):
        _dm(stream, resolution=128)


class _IndexDataset(DecodedStreamingDataset):
    """Yields each sample's stored index instead of its pixels."""

    def decode(self, item):
        return int(item["index"]), int(item["label"])


class _IndexDataModule(StreamingDataModule):
    dataset_class = _IndexDataset


def _epoch_indices(rank, world_size, root):
    dm = _IndexDataModule(str(root), resolution=16, batch_size=3, num_workers=0)
    loader = dm.train_dataloader()
    return {"indices": [i for idx, _ in loader for i in idx.tolist()], "len": len(loader)}


@pytest.mark.slow  # the same sharding check under a Trainer: test_hier_ring_on_two_emulated_nodes_reads_each_sample_once
def test_two_rank_ddp_epoch_sees_every_sample_once(stream):
    per_rank = run_distributed(_epoch_indices, 2, str(stream), timeout=180)
    seen = per_rank[0]["indices"] + per_rank[1]["indices"]
    assert sorted(seen) == list(range(24))  # 24 samples, 12 per rank: nothing dropped, nothing twice
    assert all(len(r["indices"]) == 3 * r["len"] == 12 for r in per_rank)


class _IndexRecorder(pl.LightningModule):
    """Records the sample indices of its training batches (a one-weight model, so DDP has a gradient)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        indices, _ = batch
        self.seen += indices.tolist()
        return (self.w * indices.double().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _hier_ring_epoch(rank, world_size, root, tmp):
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    model = _IndexRecorder()
    trainer = pl.Trainer(
        strategy=HierarchicalAllReduceStrategy(ranks_per_node=1), accelerator="cpu", devices=world_size,
        max_epochs=1, limit_val_batches=0, default_root_dir=tmp,
    )
    trainer.fit(model, datamodule=_IndexDataModule(root, resolution=16, batch_size=3, num_workers=0))
    return {"seen": model.seen, "hook_iterations": trainer.strategy.hook_state.iteration,
            "nodes": trainer.strategy.topology.num_nodes}


def test_hier_ring_on_two_emulated_nodes_reads_each_sample_once(stream, tmp_path):
    """The same sharding under the package's strategy, 2 processes as 2 nodes (ranks_per_node=1)."""
    per_rank = run_distributed(_hier_ring_epoch, 2, str(stream), str(tmp_path), timeout=180)
    assert all(r["nodes"] == 2 and r["hook_iterations"] == 4 for r in per_rank)  # 12 per rank / 3: hook ran
    assert sorted(per_rank[0]["seen"] + per_rank[1]["seen"]) == list(range(24))


def _yielded(root, batch_size, num_workers, epochs=2):
    """Per epoch, the stored indices of each batch the datamodule's training loader yields; and its length."""
    dm = _IndexDataModule(str(root), resolution=16, batch_size=batch_size, num_workers=num_workers)
    loader = dm.train_dataloader()  # no Trainer: each iteration is litdata's next epoch
    return [[idx.tolist() for idx, _ in loader] for _ in range(epochs)], len(loader)


def _yielded_by_workers(rank, world_size, root):
    return {workers: _yielded(root, 5, workers) for workers in (0, 1)}


def _streams(root, epochs=2):
    """Per epoch, its stream: its chunks in the order one process reads them, each chunk's samples in stored order."""
    sizes = [c["chunk_size"] for c in json.loads((root / "train" / "index.json").read_text())["chunks"]]
    starts = np.cumsum([0] + sizes)
    stored = StreamingDataset(str(root / "train"))  # stored order (convert shuffles the tree's)
    stored = [int(stored[k]["index"]) for k in range(len(stored))]
    chunk_of = {i: int(np.searchsorted(starts, k, side="right")) - 1 for k, i in enumerate(stored)}
    assert len(sizes) > 5
    # The stream: one process, batch 1 (nothing left out), as read; each chunk read whole, in one go.
    reference, _ = _yielded(root, 1, 0, epochs)
    streams = []
    for epoch in reference:
        order = [i for b in epoch for i in b]
        assert sorted(order) == list(range(len(stored)))
        visits = [chunk_of[i] for k, i in enumerate(order) if k == 0 or chunk_of[order[k - 1]] != chunk_of[i]]
        assert sorted(visits) == list(range(len(sizes)))
        streams.append([i for c in visits for i in stored[starts[c]:starts[c + 1]]])
    assert len(streams) < 2 or streams[0] != streams[1]
    return streams


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks: ~15 s
def test_epoch_tail_is_the_last_samples_of_the_epochs_chunk_order_modulo_ranks_x_batch(tmp_path, world_size):
    """The tail rule of docs/faults.md ("Streaming data"), measured on 27 samples in 14 chunks, batch 5.

    An epoch yields each sample at most once and leaves out the last ``27 % (W x 5)`` samples of
    its stream (its chunks in the order one process reads them, each chunk's samples in stored
    order): 2 on one process, 7 (more than a per-device batch) on 2 ranks; 0 or 1 loader workers
    change nothing. Two epochs: each its own chunk order, so its own samples left out.
    """
    root = convert_tree(tmp_path, max_side=16, chunk_bytes="2KB", train_per_class=9, val_per_class=1)
    streams = _streams(root)
    n, batch = len(streams[0]), 5
    assert n == 27

    if world_size == 1:
        runs = [_yielded_by_workers(0, 1, root)]
    else:
        runs = run_distributed(_yielded_by_workers, world_size, str(root), timeout=180)
    left_out = n % (world_size * batch)
    assert left_out == (2 if world_size == 1 else 7)
    for workers in (0, 1):
        assert all(r[workers][1] == n // (world_size * batch) for r in runs)  # len(loader) per rank
        for e, stream in enumerate(streams):
            batches = [b for r in runs for b in r[workers][0][e]]
            seen = [i for b in batches for i in b]
            assert all(len(b) == batch for b in batches)
            assert len(seen) == len(set(seen)) == n - left_out, (workers, e)
            assert set(range(n)) - set(seen) == set(stream[n - left_out:]), (workers, e)


def test_with_accumulation_an_epoch_is_whole_global_batches_and_leaves_out_the_last_n_mod_g(tmp_path):
    """The tail rule with accumulation (docs/faults.md, "Streaming data"): 104 samples, batch 8.

    litdata gives one process 13 batches (104 % 8 = 0); with the Trainer's accumulation 2
    (global batch 16) the loader yields 12, leaving out the last 104 % 16 = 8 samples of the
    epoch's stream, with 0 or 1 loader workers, in two epochs; with accumulation 1 all 13. A
    mid-epoch resume (after 2 steps) yields the rest of the same 12.
    """
    root = convert_tree(tmp_path, max_side=16, chunk_bytes="2KB", classes=("n01", "n02", "n03", "n04"),
                        train_per_class=26, val_per_class=1)
    streams = _streams(root)
    n, batch = len(streams[0]), 8
    assert n == 104

    def loader(workers, accumulation):
        dm = _IndexDataModule(str(root), resolution=16, batch_size=batch, num_workers=workers)
        dm.trainer = pl.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=accumulation,
                                default_root_dir=str(tmp_path))
        return dm.trainer, dm.train_dataloader()

    for workers in (0, 1):
        trainer, cut = loader(workers, 2)
        _, whole = loader(workers, 1)
        assert len(cut) == 12 and len(whole) == 13
        for epoch, stream in enumerate(streams):
            trainer.fit_loop.epoch_progress.current.completed = epoch  # the trainer's current_epoch
            batches = [idx.tolist() for idx, _ in cut]
            seen = [i for b in batches for i in b]
            assert [len(b) for b in batches] == [batch] * 12, (workers, epoch)
            assert len(seen) == len(set(seen)) == n - n % 16
            assert set(range(n)) - set(seen) == set(stream[n - n % 16:]), (workers, epoch)
        assert sorted(i for idx, _ in whole for i in idx.tolist()) == list(range(n))

        trainer.fit_loop.epoch_progress.current.completed = 0
        iterator = iter(cut)
        first = [next(iterator)[0].tolist() for _ in range(4)]
        state = cut.state_dict()
        del iterator
        resumed_trainer, resumed = loader(workers, 2)
        resumed.load_state_dict(state)
        rest = [idx.tolist() for idx, _ in resumed]
        assert len(rest) == 8
        assert set(range(n)) - {i for b in first + rest for i in b} == set(streams[0][n - n % 16:])


class _Recorder(pl.LightningModule):
    """Records a fingerprint of every training batch it sees."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert x.dtype == torch.float32  # normalised by the datamodule on the device
        self.seen.append((tuple(y.tolist()), round(float(x.double().sum()), 2)))
        return nn.functional.cross_entropy(self.head(x.mean((2, 3))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, default_root_dir=str(tmp), **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_gives_the_same_next_batches(stream, tmp_path, num_workers):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1,
                           filename="{step}")
    full = _Recorder()
    _trainer(tmp_path, callbacks=[ckpt]).fit(full, datamodule=_dm(stream, num_workers=num_workers))
    assert len(full.seen) == 12  # 2 epochs x 24 / 4
    assert full.seen[:6] != full.seen[6:]  # each epoch has its own order and crops

    for step in (4, 8):  # mid-epoch 0 (batch 4 of 6) and mid-epoch 1 (batch 2 of 6)
        resumed = _Recorder()
        _trainer(tmp_path).fit(resumed, datamodule=_dm(stream, num_workers=num_workers),
                               ckpt_path=str(tmp_path / "ckpt" / f"step={step}.ckpt"))
        assert resumed.seen == full.seen[step:]


def test_device_prefetcher_state_is_the_handed_out_position(stream):
    dm = _dm(stream, num_workers=2)
    reference = [y.tolist() for _, y in dm.train_dataloader()]
    prefetched = DevicePrefetcher(dm.train_dataloader(), "cpu")
    it = iter(prefetched)
    first = [next(it)[1].tolist() for _ in range(2)]
    state = prefetched.state_dict()  # the loader has produced 3 batches, 2 handed out
    fresh = dm.train_dataloader()
    fresh.load_state_dict(state)
    assert first + [y.tolist() for _, y in fresh] == reference


def _batches(loader):
    return [(y.tolist(), x.clone()) for x, y in loader]


def _same(a, b):
    return len(a) == len(b) and all(ya == yb and torch.equal(xa, xb) for (ya, xa), (yb, xb) in zip(a, b))


def _wait_until(condition):
    for _ in range(500):  # bounded: 5 s
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("the background thread never got there")


def _wait_until_ahead(loader, batches):
    _wait_until(lambda: loader._in_flight() >= batches)  # decoded by the thread, not handed out


@pytest.mark.parametrize("handed_out", [2, 4])  # 4 of 6: the thread has run past the epoch's end
def test_background_loader_resumes_at_the_batches_handed_out_not_those_decoded_ahead(stream, handed_out):
    dm = _dm(stream, num_workers=0, decode_threads=2)
    dataset = dm.train_dataset()
    synchronous = EpochAwareStreamingDataLoader(dataset, batch_size=4, num_workers=0,
                                                collate_fn=dataset.batch_decoder(1, False))
    reference = _batches(synchronous)
    loader = dm.train_dataloader()
    assert isinstance(loader, BackgroundStreamingDataLoader) and len(loader) == len(reference) == 6
    it = iter(loader)
    first = [(y.tolist(), x.clone()) for x, y in (next(it) for _ in range(handed_out))]
    _wait_until_ahead(loader, 2)  # prefetch_factor=2 batches decoded ahead, not handed out
    if handed_out == 4:  # litdata's dataset counts its epoch up there; the state must not
        _wait_until(lambda: loader.dataset.current_epoch == 2)
    state = loader.state_dict()
    assert state["num_samples_yielded"] == 4 * handed_out and state["current_epoch"] == 1
    assert state["dataset"]["current_epoch"] == 1
    rest = [(y.tolist(), x.clone()) for x, y in it]  # the same iteration goes on undisturbed
    assert _same(first + rest, reference)

    fresh = dm.train_dataloader()
    fresh.load_state_dict(state)
    assert _same(first + _batches(fresh), reference)
    assert fresh.current_epoch == 1 and len(_batches(fresh)) == 6 and fresh.current_epoch == 2  # next epoch: all


def test_device_prefetcher_over_the_background_loader_resumes_at_the_handed_out_batch(stream):
    dm = _dm(stream, num_workers=0)
    reference = [y.tolist() for _, y in dm.train_dataloader()]
    loader = dm.train_dataloader()
    prefetched = DevicePrefetcher(loader, "cpu")  # what the datamodule wraps the loader in on CUDA
    it = iter(prefetched)
    first = [next(it)[1].tolist() for _ in range(4)]  # 5 handed out by the loader, 6 produced
    _wait_until(lambda: loader.dataset.current_epoch == 2)  # the thread ran past the epoch's end
    state = prefetched.state_dict()
    assert state["num_samples_yielded"] == 16 and state["dataset"]["current_epoch"] == 1
    fresh = dm.train_dataloader()
    fresh.load_state_dict(state)
    assert first + [y.tolist() for _, y in fresh] == reference


def test_background_loader_stops_its_thread_on_break_and_restarts_on_iter(stream):
    loader = _dm(stream, num_workers=0).train_dataloader()
    whole = _batches(loader)
    for epoch in range(2):
        it = iter(loader)
        next(it)
        _wait_until_ahead(loader, 2)
        thread = loader._thread
        del it  # Lightning's limit_train_batches: the iterator is dropped mid-epoch
        assert not thread.is_alive() and loader._thread is None
        assert loader.state_dict()["num_samples_yielded"] == 4  # the dropped batches do not count
        assert loader.current_epoch == epoch + 2
    assert len(_batches(loader)) == 6 and not any(t.name == "fastscale-background-batches"
                                                  for t in threading.enumerate())
    assert [y for y, _ in whole] != [y for y, _ in _batches(loader)]  # a later epoch: another order


def test_background_loader_raises_a_producer_error_at_its_batch(stream):
    dataset = _dm(stream, num_workers=0).train_dataset()
    decode = dataset.batch_decoder(1, False)
    calls = []

    def collate(samples):
        calls.append(len(samples))
        if len(calls) == 3:
            raise CorruptDataError("sample 9: cannot decode")
        return decode(samples)

    loader = BackgroundStreamingDataLoader(dataset, batch_size=4, collate_fn=collate)
    it = iter(loader)
    assert [y.shape[0] for _, y in (next(it), next(it))] == [4, 4]
    with pytest.raises(CorruptDataError, match="sample 9"):
        next(it)
    assert loader._thread is None
    decoded = len(calls)  # the failing batch and at most the batches read ahead of it
    time.sleep(0.3)
    assert len(calls) == decoded <= 3 + loader.batches_ahead  # nothing decoded after the error
    with pytest.raises(ValueError, match="prefetch_factor=0"):
        BackgroundStreamingDataLoader(dataset, batch_size=4, batches_ahead=0)


def test_training_and_validation_read_one_stored_sample_per_item(stream):
    """Not litdata's default window of neighbouring samples per read, which a shuffled or planned
    order mostly throws away (the read cost is in benchmarks/README.md)."""
    dm = _dm(stream)
    dm.setup("fit")
    assert dm.train_dataset().batch_decode == 0 and dm.val_dataloader().dataset.samples.batch_decode == 0


def test_training_order_is_a_full_permutation_within_each_chunk(stream):
    """Not litdata's default of shuffled blocks of 256 neighbouring samples: a tree converted class
    by class then gives one-class batches (at batch 256 of a 10-class tree every batch held one or
    two classes, and the recipe of benchmarks/time_to_accuracy.py stayed at chance)."""
    dataset = _dm(stream).train_dataset()
    assert getattr(dataset, "item_shuffle_window", 0) == 0


def test_background_loader_decodes_the_next_batch_while_one_is_decoding(stream):
    """The collate function (the decode) of batch k + 1 starts before that of batch k has
    finished: each call waits, with a time-out, until two are running at once."""
    dataset = _dm(stream, num_workers=0).train_dataset()
    decode = dataset.batch_decoder(1, False)
    both_running = threading.Barrier(2, timeout=10)

    def collate(samples):
        both_running.wait()  # raises BrokenBarrierError after 10 s alone
        return decode(samples)

    reference = _batches(EpochAwareStreamingDataLoader(dataset, batch_size=4, num_workers=0, collate_fn=decode))
    loader = BackgroundStreamingDataLoader(dataset, batch_size=4, collate_fn=collate)  # 6 batches: pairs
    assert _same(_batches(loader), reference)


def test_num_workers_auto_picks_and_caches(stream, tmp_path):
    assert pick_smallest_within({0: 100.0, 1: 190.0, 2: 200.0, 4: 203.0}) == 2
    assert pick_smallest_within({0: 100.0, 1: 50.0}) == 0
    cache_file = tmp_path / "nw.json"
    dm = _dm(stream, num_workers="auto", max_workers=2, num_workers_cache=str(cache_file))
    dm.setup("fit")
    probe = dm.num_workers_probe
    assert probe["cached"] is False and set(probe["images_per_s"]) == {0, 1, 2}
    assert dm.num_workers == pick_smallest_within(probe["images_per_s"])
    stored = json.loads(cache_file.read_text())
    assert len(stored) == 1 and next(iter(stored.values()))["num_workers"] == dm.num_workers

    # A second run with the same machine, data, resolution and batch size skips the probe.
    key = next(iter(stored))
    WorkerCountCache(cache_file).put(key, 3, {1: 1.0, 3: 2.0})  # a pick the probe would not make
    again = _dm(stream, num_workers="auto", max_workers=2, num_workers_cache=str(cache_file))
    again.setup("fit")
    assert again.num_workers == 3 and again.num_workers_probe["cached"] is True
    other = _dm(stream, resolution=24, num_workers="auto", max_workers=2, num_workers_cache=str(cache_file))
    other.setup("fit")
    assert other.num_workers_probe["cached"] is False  # another resolution is probed afresh


def test_missing_and_half_written_folders_are_named(stream, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*fastscale-data convert"):
        _dm(tmp_path / "nowhere")
    half = tmp_path / "half"
    shutil.copytree(stream, half)
    (half / "dataset.json").unlink()
    with pytest.raises(FileNotFoundError, match="no dataset.json.*did not finish"):
        _dm(half)
    chunks = tmp_path / "chunks"
    shutil.copytree(stream, chunks)
    next((chunks / "val").glob("chunk-*.bin")).unlink()
    with pytest.raises(FileNotFoundError, match="val lacks 1 chunk file"):
        _dm(chunks)


def test_corrupt_jpeg_mid_epoch_names_index_and_file(stream, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(stream, bad)
    chunk = next((bad / "val").glob("chunk-*.bin"))
    data = bytearray(chunk.read_bytes())
    second = data.index(b"\xff\xd8\xff", data.index(b"\xff\xd8\xff") + 3)  # the second stored image
    data[second : second + 2] = b"\x00\x00"
    chunk.write_bytes(bytes(data))
    dm = _dm(bad, val_batch_size=1)
    with pytest.raises(CorruptDataError, match=rf"{chunk}: sample 1: cannot decode stored image \d+ "
                                                r"\(n0\d/n0\d_\d\.JPEG\) of .*bad"):
        for _ in dm.val_dataloader():
            pass


def test_remote_source_reads_through_a_size_limited_local_cache(stream, tmp_path):
    cache = tmp_path / "cache"
    dm = _dm(f"local:{stream}", cache_dir=str(cache), max_cache_size="1GB")
    assert dm.classes == ["n01", "n02", "n03"]
    n = sum(len(y) for _, y in dm.train_dataloader())
    assert n == 24
    cached = [p for p in cache.rglob("chunk-*.bin")]
    assert cached, "the remote chunks were not cached locally"
    assert dm.train_dataset().max_cache_size == "1GB"


def test_bench_cli_times_within_one_epoch_and_refuses_more(stream, capsys):
    from lightning_fastscale.data.cli import main

    common = ["--resolution", "32", "--batch-size", "4", "--warmup", "1"]
    for pipeline, root, extra in (("streaming", stream, []), ("streaming", stream, ["--uint8"]),
                                  ("imagefolder", stream.parent / "tree", [])):
        assert main(["bench", str(root), "--pipeline", pipeline, "--batches", "4", *common, *extra]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["pipeline"] == pipeline and result["images_per_s"] > 0
    # 24 training images in batches of 4: 6 batches, fewer than 1 + 6
    assert main(["bench", str(stream), "--batches", "6", *common]) == 2
    err = capsys.readouterr().err
    assert "--warmup 1 + --batches 6 is more than one epoch" in err and "(6 batches of 4)" in err


def test_batch_hook_takes_a_bare_input_tensor_as_the_model_summary_hands_it(stream):
    """Lightning's model summary sends the module's example_input_array through this hook."""
    dm = _dm(stream, num_workers=0)
    example = torch.zeros(2, 3, 8, 8)
    assert dm.on_after_batch_transfer(example, 0) is example  # a float input is left as it is
    raw = torch.full((2, 3, 8, 8), 255, dtype=torch.uint8)
    images, labels = dm.on_after_batch_transfer((raw, torch.tensor([0, 1])), 0)
    assert torch.equal(dm.on_after_batch_transfer(raw, 0), images)
    assert torch.allclose(images[:, 0], torch.full((2, 8, 8), (1 - 0.485) / 0.229)) and labels.tolist() == [0, 1]


def _stored(stream, resolution=32, epoch=0):
    """The training split's stored samples in litdata order, as the loader's collate receives them."""
    dataset = DecodedStreamingDataset(str(stream / "train"), resolution=resolution)
    dataset.set_epoch(epoch)
    return dataset, [dataset[i] for i in range(24)]


def test_threaded_batch_decode_gives_the_batches_of_one_thread_and_of_the_per_sample_transform(stream):
    dataset, samples = _stored(stream, epoch=3)
    batch = samples[:7]
    one = dataset.batch_decoder(threads=1)(batch)
    for threads in (2, 3):
        images, labels = dataset.batch_decoder(threads=threads)(batch)
        assert torch.equal(images, one[0]) and torch.equal(labels, one[1])
    # The per-sample reference: the same crop and flip; enlarged crops may differ by the rounding
    # of train_batch's faster resize (at most 1, transforms.train_batch).
    for image, label, s in zip(one[0], one[1], batch):
        jpeg = torch.frombuffer(bytearray(s.jpeg), dtype=torch.uint8)
        reference = transforms.train_transform(jpeg, 32, transforms.sample_generator(0, 3, s.index))
        assert (image.int() - reference.int()).abs().max() <= 1 and int(label) == s.label

    # Through the datamodule: the same epoch of batches whatever the threads, with and without workers.
    for workers in (0, 1):
        runs = [[(x, y) for x, y in _dm(stream, num_workers=workers, decode_threads=t).train_dataloader()]
                for t in (1, 2)]
        assert len(runs[0]) == len(runs[1]) == 6
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(*runs))
        images = runs[1][0][0]  # written where it leaves the loader: channels-last, shared from a worker
        assert images.is_contiguous(memory_format=torch.channels_last) and images.is_shared() == (workers > 0)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_corrupt_sample_in_a_threaded_batch_names_its_chunk_and_sample(stream, tmp_path, num_workers):
    bad = tmp_path / "bad"
    shutil.copytree(stream, bad)
    chunk = bad / "train" / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    offset = int.from_bytes(data[4 + 4 * 9 : 8 + 4 * 9], "little")  # where litdata sample 9 starts
    sos = data.index(b"\xff\xda", offset)  # its first entropy-coded byte, after the start-of-scan header
    data[sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")] ^= 0xFF
    chunk.write_bytes(bytes(data))
    dm = _dm(bad, num_workers=num_workers, decode_threads=2)
    with pytest.raises(CorruptDataError, match=rf"{chunk}: sample 9: cannot decode stored image \d+ "
                                                r"\(n0\d/n0\d_\d\.JPEG\) of .*bad.*Corrupt JPEG data.*fastscale-data verify"):
        for _ in dm.train_dataloader():
            pass


def test_decode_threads_auto_fills_the_cores_and_bad_values_are_named(stream):
    from lightning_fastscale.data.worker_autotune import threads_per_worker

    dm = _dm(stream, num_workers=0, max_workers=4)
    assert dm.resolved_decode_threads() == 4
    dm.num_workers = 4  # another worker count (the doctor's loader probe sets it): threads follow
    assert dm.resolved_decode_threads() == 1
    assert _dm(stream, num_workers=2, max_workers=4).resolved_decode_threads() == 2
    assert _dm(stream, num_workers=2, decode_threads=3).resolved_decode_threads() == 3
    assert threads_per_worker(4, 8) == 1
    for bad in (0, "many", True):
        with pytest.raises(ValueError, match=f"decode_threads={bad!r} must be an integer >= 1 or 'auto'"):
            _dm(stream, decode_threads=bad)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_dct_scaling_reaches_the_batches_and_is_train_batch_s(stream, num_workers):
    """``dct_scaling=True`` gives each batch exactly `train_batch(..., dct_scaling=True)` of the
    samples read (in the training process and in a loader worker alike), and changes some of
    them against the default (at 16 px from images stored at max side 64, crops of >= 32 px on
    both axes are decoded at half scale)."""
    dm = _dm(stream, resolution=16, dct_scaling=True, num_workers=num_workers, decode_threads=1)
    got = _batches(dm.train_dataloader())
    dataset = dm.train_dataset()
    read = EpochAwareStreamingDataLoader(dataset, batch_size=4, num_workers=0, collate_fn=list)
    expected = []
    for samples in read:
        jpegs = [torch.frombuffer(bytearray(s.jpeg), dtype=torch.uint8) for s in samples]
        gens = [transforms.sample_generator(0, s.epoch, s.index) for s in samples]
        expected.append(([s.label for s in samples], transforms.train_batch(jpegs, gens, 16, dct_scaling=True)))
    assert _same(got, expected)
    default = _batches(_dm(stream, resolution=16, num_workers=num_workers, decode_threads=1).train_dataloader())
    assert [y for y, _ in default] == [y for y, _ in got]
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(default, got))
    with pytest.raises(ValueError, match="dct_scaling='yes' must be True or False"):
        _dm(stream, dct_scaling="yes")


def test_probe_tries_each_worker_count_with_the_threads_that_fill_the_cores(tmp_path):
    from lightning_fastscale.data.worker_autotune import resolve_num_workers

    tried = []

    def make_loader(workers, threads):  # a stand-in loader: what matters here is which pairs are tried
        tried.append((workers, threads))
        return [torch.zeros(4)] * 20

    cache = WorkerCountCache(tmp_path / "nw.json")
    workers, threads, record = resolve_num_workers(make_loader, cache, "data", 32, 4, max_workers=8)
    assert tried == [(0, 8), (1, 8), (2, 4), (4, 2), (8, 1)]  # workers x threads within the 8 cores
    assert record["threads_by_workers"][workers] == threads and record["cached"] is False
    assert (workers, threads) == (cache.get(cache.key("data", 32, 4, 1))["num_workers"],
                                  cache.get(cache.key("data", 32, 4, 1))["decode_threads"])
    tried.clear()
    again = resolve_num_workers(make_loader, cache, "data", 32, 4, max_workers=8)
    assert tried == [] and again[:2] == (workers, threads) and again[2]["cached"] is True

    # Threads set by the user: only the worker counts whose threads fit the cores are tried.
    resolve_num_workers(make_loader, cache, "data", 32, 4, max_workers=8, decode_threads=3)
    assert tried == [(0, 3), (1, 3), (2, 3)]


def test_streaming_source_alone_locates_splits_and_checks_resolutions(stream, tmp_path):
    from lightning_fastscale.data.streaming_source import StreamingSource

    local = StreamingSource(str(stream))
    assert local.split("val") == (str(stream / "val"), {}) and local.metadata.max_side == 64
    local.check_resolution("data.resolution", 64)
    with pytest.raises(ValueError, match="resolution=65 is larger .* --max-side 65"):
        local.check_resolution("data.resolution", 65)
    remote = StreamingSource(f"local:{stream}", cache_dir=str(tmp_path), max_cache_size="1GB")
    assert remote.remote and remote.metadata == local.metadata  # dataset.json read through the cache
    assert remote.split("train") == (f"local:{stream}/train", {"cache_dir": str(tmp_path), "max_cache_size": "1GB"})
