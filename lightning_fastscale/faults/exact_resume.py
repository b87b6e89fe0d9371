"""Exact mid-epoch resume: a run stopped at any step continues with the batches it would have seen.

Lightning restores the weights, optimizer, LR scheduler, loop counters and callback state
from a mid-epoch checkpoint, but a plain ``DataLoader`` starts its epoch over (Lightning warns
"your dataloader is not resumable"), so the resumed epoch repeats its first batches, drops
its last ones and ends at another step than the uninterrupted run; the random-number
generators also restart from the seed instead of where the run was. For a preempted
large-batch job (see [`PreemptionCheckpoint`][lightning_fastscale.faults.PreemptionCheckpoint]) that means
a different run, not a resumed one.

This callback makes the training ``DataLoader`` resumable through Lightning's own interface
(a loader with ``state_dict`` / ``load_state_dict`` is saved in the checkpoint and restored
before its iterator is made): the saved state is how many batches of the current epoch the
loop has consumed plus every rank's RNG states (torch, CUDA, NumPy, ``random``) at the start
of the epoch and at the moment of saving. On resume the epoch's sampler order is rebuilt
from the epoch-start state (``DistributedSampler`` orders by seed and epoch; a single-device
``RandomSampler`` draws from the global generator), the consumed batches' indices are
skipped without loading them, and the generators are put back where the run was before it
loads the next batch. On CPU the resumed run is then bitwise equal to the uninterrupted one
(tests/test_faults_resume.py).

Not covered: random augmentation inside DataLoader worker processes (``num_workers > 0``)
restarts in the workers, so such a resume is statistically, not bitwise, the same; loaders
that are not a ``torch.utils.data.DataLoader`` (or a collection of them) are left alone.
A loader that already has ``state_dict`` (torchdata's ``StatefulDataLoader``, litdata's
``StreamingDataLoader``) keeps its own position; for it the callback saves only every rank's
generator states (in its own checkpoint entry) and puts them back as the first batch after a
mid-epoch resume starts, so a model that draws random numbers (dropout) continues as in the
uninterrupted run (tests/test_faults_resume_streaming.py); after an epoch-end checkpoint
such a loader starts its next epoch with the generators restarted from the seed.

A checkpoint written at the end of an epoch (``ModelCheckpoint``'s default) is exact too:
Lightning hands the loader no state there and makes the next epoch's iterator from
generators restarted from the seed, so a single-device ``RandomSampler`` would draw another
order and dropout other masks; at ``on_train_start`` the callback puts every rank's
generators back as they were at the save and makes the iterator again.

Lightning 2.6 drops the saved loader state when the training loader is built before the
checkpoint's loop state is restored, which ``trainer.estimated_stepping_batches`` does when
``configure_optimizers`` sizes an LR schedule by it (the default cosine schedule does;
Lightning issue #20550): the fit loop then never hands the state to the loader, and the
resumed epoch re-runs its first batches. At ``on_train_start`` the callback gives the loader
the pending state and makes its iterator again (`load_pending_loader_state`), as
Lightning's own restore path does when it builds the loader after the restore.

A checkpoint written by another number of processes continues with the same global batch
(split again by ``decompose``), the same epoch order (`GlobalOrderSampler`, which serves every
shuffled map-style loader) and the LR schedule as saved; not bitwise (reduction order, fresh
per-rank generators); streaming data keeps its position through litdata's elastic resume. What
cannot be carried (other per-rank data positions, a global batch with no split) is refused
before the first step unless ``allow_world_size_change=True``. More in ``docs/faults.md``.

Functional core: `collect_rng_states`, `set_rng_states`, `SkipFirstBatches`, `GlobalOrderSampler`.
Lightning adapter: [`ExactResume`][lightning_fastscale.faults.ExactResume].
"""
from __future__ import annotations

import functools
import os
import random
import weakref
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.lightning_internals import (
    checkpoint_fit_loop,
    fit_loader_owner,
    is_stateful_loader,
    load_pending_loader_state,
    make_loader_stateful,
    restart_train_iterator,
)


def collect_rng_states() -> dict[str, Any]:
    """This process's generator states: torch CPU, every CUDA device, NumPy, Python ``random``.

    Only tensors, numbers, strings and tuples, so a checkpoint holding them still loads with
    ``torch.load(weights_only=True)`` (Lightning's default with torch >= 2.6).
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": (int(version), torch.tensor(internal, dtype=torch.int64), gauss_next),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `collect_rng_states` returned."""
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), gauss_next))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class SkipFirstBatches:
    """An index sampler whose first pass skips ``skip`` items, then calls ``after_skip``.

    The skip happens when the pass is first advanced, as the wrapped sampler's own first
    draw would, so a ``RandomSampler`` draws its seed at the same point of the generator
    sequence as in an uninterrupted run. Later passes (persistent workers re-iterate the same
    object) are complete.
    """

    def __init__(self, sampler: Any, skip: int, after_skip: Any = None) -> None:
        self.sampler = sampler
        self.skip = skip
        self.after_skip = after_skip
        self._used = False

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.sampler)
        if not self._used:
            # the first advance of the first pass does the skip (an unadvanced pass made by a
            # DataLoader iterator that is reset before use does not count)
            return self._skipping(iterator)
        return iterator

    def _skipping(self, iterator: Iterator[Any]) -> Iterator[Any]:
        self._used = True
        for _ in range(self.skip):
            next(iterator, None)
        if self.after_skip is not None:
            self.after_skip()
        yield from iterator

    def __len__(self) -> int:
        return len(self.sampler) - (0 if self._used else self.skip)


class GlobalOrderSampler(Sampler[int]):
    """This rank's share of an epoch order that does not depend on the number of ranks.

    The epoch's order is ``torch.randperm`` seeded with ``seed + epoch`` (as ``DistributedSampler``
    seeds it) over the whole dataset; optimizer step ``i`` trains on ``order[i*G:(i+1)*G]``,
    ``G = batch_size x accumulation x world_size`` (Goyal et al. 2017 treat a global batch as
    one batch however it is split). Its micro-batch ``m`` on rank ``r`` is the ``batch_size``
    samples at ``(m * world_size + r) * batch_size`` in that slice, so a per-device batch (the
    group batch norm normalises over) holds the same samples on every world size that keeps
    the per-device batch. The tail rule, the same on every world size: the last
    ``size % G`` samples of the epoch's order (a partial global batch) are not trained on that
    epoch.

    Examples:
        Global batch 4 as 2 per device on 2 ranks: step 0 trains on [4, 1 | 7, 5], step 1 on
        [3, 9 | 0, 8]; the tail (2 samples) is left out.

        >>> [list(GlobalOrderSampler(10, 2, 1, rank, 2, seed=0)) for rank in (0, 1)]
        [[4, 1, 3, 9], [7, 5, 0, 8]]
    """

    def __init__(self, size: int, batch_size: int, accumulation: int, rank: int, world_size: int, seed: int,
                 epoch: int = 0) -> None:
        self.size, self.batch_size, self.accumulation = size, batch_size, accumulation
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, epoch
        self.global_batch = batch_size * accumulation * world_size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator)[:self.size // self.global_batch * self.global_batch]
        return iter(order.view(-1, self.accumulation, self.world_size, self.batch_size)[:, :, self.rank].flatten().tolist())

    def __len__(self) -> int:
        return self.size // self.global_batch * self.global_batch // self.world_size


def _resumable_class(base: type, owner: ExactResume) -> type:
    """``base`` (a DataLoader class) plus Lightning's stateful-loader interface.

    The methods go into a direct subclass of ``base`` (not a mixin base), because Python
    only lets an existing object's class be swapped for a subclass with the same layout.
    """
    owner_ref = weakref.ref(owner)
    base_index_sampler = base._index_sampler

    def own_index_sampler(self: Any) -> Any:
        callback = owner_ref()
        ordered = callback._global_order(self) if callback is not None else None
        return ordered if ordered is not None else base_index_sampler.fget(self)

    def _index_sampler(self: Any) -> Any:
        pending = self.__dict__.get("_fastscale_skip")
        return pending if pending is not None else own_index_sampler(self)

    def __iter__(self: Any) -> Any:
        callback = owner_ref()
        resume = self.__dict__.pop("_fastscale_resume", None)
        if callback is None:
            return base.__iter__(self)
        if resume is None:
            callback._epoch_start_rng = collect_rng_states()
            return base.__iter__(self)
        epoch_start, at_save, skip = resume
        if epoch_start is not None:
            set_rng_states(epoch_start)
        callback._epoch_start_rng = collect_rng_states()
        after = functools.partial(set_rng_states, at_save) if at_save is not None else None
        self.__dict__["_fastscale_skip"] = SkipFirstBatches(own_index_sampler(self), skip, after)
        try:
            return base.__iter__(self)
        finally:
            # the iterator holds the skipping sampler; the loader's own length stays whole
            self.__dict__.pop("_fastscale_skip", None)

    def state_dict(self: Any) -> dict[str, Any]:
        callback = owner_ref()
        return callback._loader_state() if callback is not None else {}

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        callback = owner_ref()
        if callback is not None and state_dict:
            resume = callback._resume_plan(state_dict, len(self))
            if resume is not None:
                self.__dict__["_fastscale_resume"] = resume

    namespace = {
        "_index_sampler": property(_index_sampler),
        "__iter__": __iter__,
        "state_dict": state_dict,
        "load_state_dict": load_state_dict,
        "_fastscale_resumable": True,
        "__module__": __name__,
        "__doc__": f"{base.__name__} that resumes mid-epoch (see ExactResume).",
    }
    return type(f"Resumable{base.__name__}", (base,), namespace)


class WorldSizeChangeError(RuntimeError):
    """A resume from a checkpoint written by ``saved`` processes into ``current`` that cannot be carried.

    ``why`` says what cannot be kept; ``sizes`` are the world sizes that would keep it. The
    message names the settings that fix it; `advice` says the same with other names for them
    (``fastscale-train`` gives its Hydra keys).
    """

    def __init__(self, saved: int, current: int, checkpoint: str = "", why: str = "", sizes: list[int] | None = None) -> None:
        self.saved, self.current, self.checkpoint, self.why = saved, current, checkpoint, why
        self.sizes = sizes or [saved]
        super().__init__("ExactResume: " + self.advice(
            "the Trainer's devices x num_nodes", "ExactResume(allow_world_size_change=True)"))

    def advice(self, world_size_setting: str, allow_setting: str) -> str:
        """What cannot be kept, then: resume with ``world_size_setting`` in `sizes`, or set ``allow_setting``."""
        sizes = " or ".join(str(w) for w in self.sizes)
        return (f"{world_size_change(self.saved, self.current, self.checkpoint)}: {self.why}. Resume with "
                f"{world_size_setting} = {sizes}, or set {allow_setting} to continue anyway (not exactly: "
                "another global batch and sample order)")


def world_size_change(saved: int, current: int, checkpoint: str = "") -> str:
    """The one statement of a resume across world sizes (errors and warnings)."""
    return (f"the checkpoint {checkpoint + ' ' if checkpoint else ''}was written by {saved} processes, "
            f"this run has {current}")


def _scale_position(checkpoint: dict[str, Any], saved_accumulation: int, accumulation: int) -> bool:
    """Count the fit loop's batches (and the loader's) in micro-batches of ``accumulation``.

    Each counter keeps its offset from ``processed`` (Lightning reads where in the step the
    checkpoint was written from it). False where it was written between the micro-batches of
    one optimizer step.
    """
    progress = checkpoint_fit_loop(checkpoint).get("epoch_loop.batch_progress") or {}
    current, total = progress.get("current"), progress.get("total")
    if not current or current["processed"] % saved_accumulation:
        return not current
    delta = current["processed"] // saved_accumulation * accumulation - current["processed"]
    for counters in (current, total or {}):
        for key in counters:
            counters[key] += delta
    loader = saved_loader_state(checkpoint)
    if loader:
        loader["batches_consumed"] = loader["batches_consumed"] // saved_accumulation * accumulation
    return True


_PER_RANK = ("its data position is per rank (a training loader with its own state_dict that is not litdata's "
             "StreamingDataLoader, or a checkpoint written before world-size-independent epoch orders)")


def _litdata_elastic_refusal(loader: Any) -> str:
    """Why litdata cannot resume ``loader``'s position exactly once on another world size ("" if it can).

    litdata (>= 0.2.69) rebuilds the epoch's sample stream as the first world size read it and
    restripes the unread rest onto the new ranks (``litdata/streaming/elastic.py``) at item
    granularity; with its window shuffle (chunks on NFS, Lustre, GPFS, Vast) it keeps whole chunks
    and drops the unread rest of a chunk already entered (``restripe_items``, ``granularity="chunk"``).
    """
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = getattr(loader, "dataset", None)
    if not isinstance(getattr(loader, "loader", loader), StreamingDataLoader) or not isinstance(dataset, StreamingDataset):
        return _PER_RANK
    posix = getattr(dataset, "posix_fast", None)
    if posix is not None and posix.window_shuffle:
        return (f"litdata reads this data in whole chunks ({posix.kind} filesystem, window shuffle): its resume on "
                "another world size skips the unread rest of the chunks being read. Resume on the same world size (a run "
                "started with LITDATA_POSIX_FAST=0 reads item by item and can change it)")
    return ""


def saved_loader_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The training-loader state ExactResume wrote into ``checkpoint``'s fit loop, or None."""
    loop_state = checkpoint_fit_loop(checkpoint).get("state_dict") or {}
    for loader_state in loop_state.get("combined_loader") or []:
        if isinstance(loader_state, dict) and "world_size" in loader_state and "batches_consumed" in loader_state:
            return loader_state
    return None


def saved_world_size(checkpoint: dict[str, Any]) -> int | None:
    """The number of processes that wrote ``checkpoint`` (from ExactResume's entries), or None."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if key.split("{", 1)[0] == "ExactResume" and isinstance(state, dict) and "world_size" in state:
            return int(state["world_size"])
    loader_state = saved_loader_state(checkpoint)
    return None if loader_state is None else int(loader_state["world_size"])


def _gather(obj: Any) -> list[Any]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ExactResume(Callback):
    """Make a mid-epoch resume continue with the same batches and random numbers.

    Add it to the Trainer's callbacks (``fastscale-train`` does by default); nothing else
    changes: checkpoints made at any step by any checkpoint callback (``ModelCheckpoint(
    every_n_train_steps=...)``, [`PreemptionCheckpoint`][lightning_fastscale.faults.PreemptionCheckpoint])
    carry the data position and RNG states, and ``Trainer.fit(ckpt_path=...)`` uses them.
    The training loader comes from the datamodule's or the LightningModule's
    ``train_dataloader`` (or is the loader given to ``fit``); its class is extended, not
    replaced, so a DataLoader subclass keeps its behaviour.

    On another number of processes (map-style data with a shuffled training loader) the run
    continues with the same global batch, per-device batch x accumulation x processes (from
    `decompose`, or the ``BatchSizeRamp``'s plan), the same epoch order (`GlobalOrderSampler`),
    the rest of the epoch exactly once, and the optimizer, LR schedule and loop counters as
    saved; the per-rank random numbers (dropout, augmentation) are drawn afresh, so it is not
    bitwise. Streaming data (litdata's ``StreamingDataLoader``) keeps the global batch, LR schedule
    and loop counters the same way and its position through litdata's elastic resume. Where
    the global batch cannot be kept it is refused before the first step, naming the world sizes
    that would keep it.

    Args:
        allow_world_size_change: resume anyway where the run cannot be carried to the new
            number of processes (a per-rank data position litdata does not carry, no split of
            the global batch): another global batch and sample order. Off by default: refused
            before the first step.
        max_per_device_batch: memory ceiling of one device when a resume on fewer processes
            must split the saved global batch; above it the resume accumulates gradients.
            ``None``: no ceiling. A ``BatchSizeRamp`` uses its own.

    Examples:
        >>> import lightning.pytorch as pl
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> trainer = pl.Trainer(callbacks=[ExactResume(), ModelCheckpoint(every_n_train_steps=50)])  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm, ckpt_path="checkpoints/epoch=0-step=150.ckpt")  # doctest: +SKIP
    """

    schedule_neutral = True

    def __init__(self, allow_world_size_change: bool = False, max_per_device_batch: int | None = None) -> None:
        if not isinstance(allow_world_size_change, bool):
            raise ValueError(
                f"ExactResume(allow_world_size_change={allow_world_size_change!r}) must be true or false"
            )
        if max_per_device_batch is not None:
            positive_int("ExactResume.max_per_device_batch", max_per_device_batch, hint="or None for no ceiling")
        self.allow_world_size_change = allow_world_size_change
        self.max_per_device_batch = max_per_device_batch
        self._ordered, self._legacy_order, self._layout = False, False, (0, 1)
        self._trainer: pl.Trainer | None = None
        self._classes: dict[type, type] = {}
        self._epoch_start_rng: dict[str, Any] | None = None
        self._wrapped: list[tuple[Any, str]] = []
        self._loader_keeps_position = False
        self._generators_to_restore: dict[str, Any] | None = None
        self._saved_loader_state: dict[str, Any] | None = None

    # -- making the loader resumable ------------------------------------------------------
    def _resumable(self, loader: Any) -> Any:
        if getattr(loader, "_fastscale_resumable", False):
            return loader
        if is_stateful_loader(loader):
            self._loader_keeps_position = True  # Lightning restores it; the generators are ours
            return loader
        if isinstance(loader, DataLoader):
            base = type(loader)
            cls = self._classes.get(base)
            if cls is None:
                cls = self._classes[base] = _resumable_class(base, self)
            make_loader_stateful(loader, cls)
            return loader
        if isinstance(loader, (list, tuple)):
            return type(loader)(self._resumable(item) for item in loader)
        if isinstance(loader, dict):
            return {key: self._resumable(item) for key, item in loader.items()}
        return loader

    def _wrap_hook(self, owner: Any, name: str = "train_dataloader") -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def train_dataloader() -> Any:
            return self._resumable(original())

        setattr(owner, name, train_dataloader)  # an instance attribute, removed at teardown
        self._wrapped.append((owner, name))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        # the restore comes after setup
        self._loader_keeps_position, self._generators_to_restore, self._saved_loader_state = False, None, None
        self._ordered, self._legacy_order, self._layout = False, False, (0, 1)
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden("train_dataloader", datamodule, pl.LightningDataModule):
            self._wrap_hook(datamodule)
            return
        instance = fit_loader_owner(trainer)
        if isinstance(instance, pl.LightningModule):
            self._wrap_hook(pl_module)
        elif instance is not None:
            self._resumable(instance)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for owner, name in self._wrapped:
            owner.__dict__.pop(name, None)
        self._wrapped = []

    def _global_order(self, loader: DataLoader) -> BatchSampler | None:
        """A shuffled map-style loader's batches in the epoch order of `GlobalOrderSampler`, else None."""
        trainer, sampler = self._trainer, loader.sampler
        shuffled = isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)
        if trainer is None or self._legacy_order or not shuffled or type(loader.batch_sampler) is not BatchSampler or loader.batch_size is None:
            return None
        # the epoch's layout (a BatchSizeRamp changes the accumulation at the epoch's end, before a checkpoint)
        self._ordered, self._layout = True, (loader.batch_size, trainer.accumulate_grad_batches)
        seed = getattr(sampler, "seed", None)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed  # as Lightning seeds DistributedSampler
        order = GlobalOrderSampler(len(loader.dataset), loader.batch_size, trainer.accumulate_grad_batches,
                                   trainer.global_rank, trainer.world_size, seed, trainer.current_epoch)
        return BatchSampler(order, loader.batch_size, drop_last=True)

    # -- what goes into the checkpoint ----------------------------------------------------
    def _loader_state(self) -> dict[str, Any]:
        """Called on every rank while a checkpoint is made (Lightning saves on all ranks)."""
        trainer = self._trainer
        assert trainer is not None
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        per_rank = _gather({"epoch_start": self._epoch_start_rng, "at_save": collect_rng_states()})
        return {
            "epoch": trainer.current_epoch,
            "batches_consumed": int(progress.processed),
            "world_size": trainer.world_size,
            "rng": per_rank,
        }

    @staticmethod
    def _saved_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
        return next((v for k, v in (checkpoint.get("callbacks") or {}).items()
                     if k.split("{", 1)[0] == "ExactResume" and isinstance(v, dict)), {})

    def _carry(self, trainer: pl.Trainer, checkpoint: dict[str, Any], saved: int) -> str | WorldSizeChangeError:
        """Carry the run to ``trainer.world_size`` processes; the reason it cannot be, or the refusal."""
        from lightning_fastscale.callbacks.batch_size_ramp import BatchSizeRamp, decompose, world_sizes_that_split

        state = self._saved_state(checkpoint)
        if not state.get("global_order") and state.get("elastic_refusal", _PER_RANK):
            return state.get("elastic_refusal", _PER_RANK)
        global_batch, ckpt = int(state["global_batch"]), str(trainer.ckpt_path or "")
        ramp = next((c for c in trainer.callbacks if isinstance(c, BatchSizeRamp)), None)
        try:  # a ramp has checked every stage on this world size at setup
            plan = ramp.plan(checkpoint["epoch"]) if ramp else decompose(global_batch, trainer.world_size, self.max_per_device_batch)
        except ValueError:
            sizes = world_sizes_that_split([global_batch], self.max_per_device_batch, trainer.world_size)
            return WorldSizeChangeError(saved, trainer.world_size, ckpt, (
                f"its global batch {global_batch} does not split into per-device batch x accumulation x "
                f"{trainer.world_size} processes (max_per_device_batch={self.max_per_device_batch})"), sizes)
        if plan.global_batch != global_batch:
            return f"its global batch was {global_batch}, this run's BatchSizeRamp has {plan.global_batch} at epoch {checkpoint['epoch']}"
        datamodule = trainer.datamodule
        if ramp is None and not callable(getattr(datamodule, "set_train_batch_size", None)):
            return (f"keeping its global batch {global_batch} needs per-device batch {plan.per_device}, and the "
                    "datamodule has no set_train_batch_size (see BatchSizeControllable)")
        if not _scale_position(checkpoint, int(state["accumulation"]), plan.accumulation):
            return "it was written between the micro-batches of an accumulated step"
        if ramp is None:
            datamodule.set_train_batch_size(plan.per_device)
        trainer.accumulate_grad_batches = plan.accumulation
        rank_zero_info(f"ExactResume: {world_size_change(saved, trainer.world_size, ckpt)}: global batch {global_batch} "
                       f"kept as {plan.per_device} per device x {plan.accumulation} accumulation x {trainer.world_size}")
        return ""

    def _resume_plan(self, state: dict[str, Any], length: int) -> tuple[Any, Any, int] | None:
        trainer = self._trainer
        assert trainer is not None
        consumed = int(state["batches_consumed"])
        if state["epoch"] != trainer.current_epoch or consumed >= length or consumed <= 0:
            return None  # saved at an epoch boundary: the new epoch starts from its beginning
        if state["world_size"] != trainer.world_size or len(state["rng"]) != trainer.world_size:
            return None, None, consumed  # counted in this run's micro-batches (_carry); fresh generators
        mine = state["rng"][_rank()]
        return mine["epoch_start"], mine["at_save"], consumed

    # -- loaders that keep their own position: only the generators ------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """Every rank's generators, for a training loader with its own ``state_dict`` (else empty).

        Called on every rank while a checkpoint is made (Lightning saves on all ranks).
        """
        trainer = self._trainer
        if trainer is None:
            return {}
        if not self._loader_keeps_position:
            batch, accumulation = self._layout
            return {"world_size": trainer.world_size, "global_order": self._ordered,
                    "global_batch": batch * accumulation * trainer.world_size, "accumulation": accumulation}
        consumed = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        loader = trainer.train_dataloader
        return {
            "global_step": trainer.global_step,
            "mid_epoch": 0 < consumed < trainer.num_training_batches,
            "world_size": trainer.world_size,
            "rng": _gather(collect_rng_states()),
            # for a resume on another world size: litdata carries the position (_carry keeps the global batch)
            "global_batch": int(getattr(loader, "batch_size", 0) or 0) * trainer.accumulate_grad_batches * trainer.world_size,
            "accumulation": trainer.accumulate_grad_batches,
            "elastic_refusal": _litdata_elastic_refusal(loader),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._generators_to_restore = state_dict if state_dict and "rng" in state_dict else None

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Carry a checkpoint of another world size (before any state is restored), or refuse it unless allowed."""
        self._saved_loader_state = saved_loader_state(checkpoint)
        state = self._saved_state(checkpoint)
        # a checkpoint written before the global order continues in the order it was written in
        self._legacy_order = "world_size" in state and "global_order" not in state and "rng" not in state
        saved = saved_world_size(checkpoint)
        if saved is None or saved == trainer.world_size:
            return
        why = self._carry(trainer, checkpoint, saved)
        if not why:
            return
        error = why if isinstance(why, WorldSizeChangeError) else WorldSizeChangeError(
            saved, trainer.world_size, str(trainer.ckpt_path or ""), why)
        if not self.allow_world_size_change:
            raise error
        rank_zero_warn(f"ExactResume: {world_size_change(saved, trainer.world_size, str(trainer.ckpt_path or ''))}: "
                       f"{error.why}; continuing with another global batch and order (allow_world_size_change=True)")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        saved, self._saved_loader_state = self._saved_loader_state, None
        if load_pending_loader_state(trainer) or saved is None or trainer.fit_loop.restarting:
            return
        # Saved at an epoch boundary: Lightning hands the loader no state and starts the next
        # epoch. Its iterator (made already) drew the worker seed and will draw a
        # RandomSampler's order from generators restarted from the seed; the uninterrupted run
        # drew both from the generators as they were at the save. Put those back and make the
        # iterator again, so the new epoch's order and random numbers are the uninterrupted ones.
        if saved["world_size"] == trainer.world_size and len(saved["rng"]) == trainer.world_size:
            restart_train_iterator(trainer, before=functools.partial(set_rng_states, saved["rng"][_rank()]["at_save"]))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        state, self._generators_to_restore = self._generators_to_restore, None
        if state is None or not state.get("mid_epoch") or state["global_step"] != trainer.global_step:
            return  # an epoch boundary: the new epoch draws as Lightning's would
        if state["world_size"] != trainer.world_size or len(state["rng"]) != trainer.world_size:
            rank_zero_warn(f"ExactResume: {world_size_change(state['world_size'], trainer.world_size)}")
            return
        # after the loader made its iterator (which draws worker seeds), before the step draws
        set_rng_states(state["rng"][_rank()])
