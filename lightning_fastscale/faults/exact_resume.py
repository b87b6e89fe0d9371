"""Exact mid-epoch resume: a run stopped at any step continues with the batches it would have seen.

Lightning starts a plain ``DataLoader``'s epoch over on resume and the generators from the seed.
``ExactResume`` keeps the epoch's position and every rank's generator states in its own
checkpoint entry; the loader's batch sampler draws from a `SkipFirstBatches`, which skips the
consumed batches when the resumed epoch's first batch is drawn, and `GlobalOrderSampler` gives
shuffled map-style data an epoch order that does not depend on the world size. Loaders with
their own ``state_dict`` (streaming) keep their position (on another world size through litdata's
elastic resume); only the generators are ours.
Why and how, the limits and the Lightning issues: ``docs/faults.md``.
"""
from __future__ import annotations

import functools
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler
from typing_extensions import override

from lightning_fastscale._validation import positive_int
from lightning_fastscale.data.protocol import whole_global_batches
from lightning_fastscale.lightning_internals import (
    checkpoint_fit_loop,
    fit_loader_owner,
    load_pending_loader_state,
    loader_with_sampler,
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
    """An index sampler whose next pass skips ``skip`` items, then calls ``after_skip``.

    Each pass calls ``before_pass`` when first advanced, and the skip happens there too, as
    the wrapped sampler's own first draw would, so a ``RandomSampler`` draws its seed at the
    same point of the generator sequence as in an uninterrupted run. Later passes (persistent
    workers re-iterate the same object) are complete. Its length stays whole: Lightning counts
    a resumed epoch's consumed batches itself and ends the epoch at the loader's length.
    """

    def __init__(self, sampler: Any, skip: int = 0, after_skip: Any = None, before_pass: Any = None) -> None:
        self.sampler, self.skip, self.after_skip, self.before_pass = sampler, skip, after_skip, before_pass

    def __iter__(self) -> Iterator[Any]:
        # an unadvanced pass made by a DataLoader iterator that is reset before use does not count
        if self.before_pass is not None:
            self.before_pass()
        iterator = iter(self.sampler)
        skip, self.skip, after, self.after_skip = self.skip, 0, self.after_skip, None
        for _ in range(skip):
            next(iterator, None)
        if after is not None:
            after()
        yield from iterator

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (Lightning calls it on a loader's samplers each epoch)."""
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)


class GlobalOrderSampler(DistributedSampler):
    """This rank's share of an epoch order that does not depend on the number of ranks.

    The epoch's order is ``torch.randperm`` seeded with ``seed + epoch`` (as ``DistributedSampler``
    seeds it) over the whole dataset; optimizer step ``i`` trains on ``order[i*G:(i+1)*G]``,
    ``G = batch_size x accumulation x world_size`` (Goyal et al. 2017 treat a global batch as
    one batch however it is split). Its micro-batch ``m`` on rank ``r`` is the ``batch_size``
    samples at ``(m * world_size + r) * batch_size`` in that slice, so a per-device batch (the
    group batch norm normalises over) holds the same samples on every world size that keeps
    the per-device batch. The tail rule, the same on every world size: the last
    ``size % G`` samples of the epoch's order (a partial global batch) are not trained on that
    epoch. A ``DistributedSampler``, so Lightning keeps it instead of adding its own.

    Examples:
        Global batch 4 as 2 per device on 2 ranks: step 0 trains on [4, 1 | 7, 5], step 1 on
        [3, 9 | 0, 8]; the tail (2 samples) is left out.

        >>> [list(GlobalOrderSampler(10, 2, 1, rank, 2, seed=0)) for rank in (0, 1)]
        [[4, 1, 3, 9], [7, 5, 0, 8]]
    """

    def __init__(self, size: int, batch_size: int, accumulation: int, rank: int, world_size: int, seed: int,
                 epoch: int = 0) -> None:
        super().__init__(range(size), num_replicas=world_size, rank=rank, seed=seed)
        self.size, self.batch_size, self.accumulation, self.world_size, self.epoch = size, batch_size, accumulation, world_size, epoch

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.batch_size * self.accumulation * self.world_size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator)[:whole_global_batches(self.size, self.global_batch)]
        return iter(order.view(-1, self.accumulation, self.world_size, self.batch_size)[:, :, self.rank].flatten().tolist())

    def __len__(self) -> int:
        return whole_global_batches(self.size, self.global_batch) // self.world_size


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
    position = saved_position(checkpoint)
    if position:
        position["batches_consumed"] = position["batches_consumed"] // saved_accumulation * accumulation
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


def _saved_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """ExactResume's own entry of ``checkpoint`` (empty if none)."""
    return next((v for k, v in (checkpoint.get("callbacks") or {}).items()
                 if k.split("{", 1)[0] == "ExactResume" and isinstance(v, dict)), {})


def _is_position(state: Any) -> bool:
    return isinstance(state, dict) and "world_size" in state and "batches_consumed" in state


def saved_position(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """Where the epoch stood in ``checkpoint``: ExactResume's entry, or (written before it kept
    the position itself) its training-loader state in the fit loop; None where neither has it."""
    state = _saved_state(checkpoint)
    if _is_position(state):
        return state
    loop_state = checkpoint_fit_loop(checkpoint).get("state_dict") or {}
    return next((s for s in loop_state.get("combined_loader") or [] if _is_position(s)), None)


def saved_world_size(checkpoint: dict[str, Any]) -> int | None:
    """The number of processes that wrote ``checkpoint`` (from ExactResume's entries), or None."""
    state = _saved_state(checkpoint)
    state = state if "world_size" in state else saved_position(checkpoint) or {}
    return int(state["world_size"]) if "world_size" in state else None


def _loaders(obj: Any) -> Iterator[Any]:
    """The loaders in a training loader collection (a loader, or lists and dicts of them)."""
    if isinstance(obj, (list, tuple, dict)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _loaders(item)
    elif obj is not None:
        yield obj


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
    ``train_dataloader`` (or is the loader given to ``fit``); its class is left alone, so a
    DataLoader subclass keeps its behaviour.

    On another number of processes it keeps the global batch, epoch order and LR schedule, and
    sees the rest of the epoch once (not bitwise); what is carried and refused:
    ``docs/faults.md`` ("Resume on another number of processes").

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
        self._trainer: pl.Trainer | None = None
        self._wrapped: list[tuple[Any, str]] = []
        self._legacy_order, self._loader_keeps_position = False, False
        self._epoch_start_rng: dict[str, Any] | None = None
        self._restore_at_pass: dict[str, Any] | None = None
        self._generators_to_restore: dict[str, Any] | None = None
        self._position: dict[str, Any] | None = None
        self._silenced: Any = None
        self._old_layout = False
        # the batch layout came from a carry, not the configuration: a later resume carries it again
        self._carried = False

    # -- giving the loader the epoch order and a sampler that can skip ---------------------
    def _install(self, loader: Any, rebuild: bool = True) -> Any:
        """``loader`` with the epoch order and a skipping sampler (``rebuild``: made again, as
        Lightning makes a loader again for a ``DistributedSampler``; else changed in place)."""
        if isinstance(loader, (list, tuple)):
            return type(loader)(self._install(item, rebuild) for item in loader)
        if isinstance(loader, dict):
            return {key: self._install(item, rebuild) for key, item in loader.items()}
        if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
            self._loader_keeps_position = True  # Lightning restores its position; the generators are ours
            return loader
        if not isinstance(loader, DataLoader) or type(loader.batch_sampler) is not BatchSampler:
            return loader
        order = self._global_order(loader)
        if order is not None and rebuild:
            loader = loader_with_sampler(loader, order)
        elif order is not None:
            loader.batch_sampler.sampler = order
        self._skipper(loader)
        return loader

    def _skipper(self, loader: Any) -> SkipFirstBatches | None:
        """The `SkipFirstBatches` inside ``loader``'s batch sampler, put there if missing."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        if type(batch_sampler) is not BatchSampler:
            return None
        if not isinstance(batch_sampler.sampler, SkipFirstBatches):
            batch_sampler.sampler = SkipFirstBatches(batch_sampler.sampler, before_pass=self._pass_starts)
        return batch_sampler.sampler

    def _pass_starts(self) -> None:
        restore, self._restore_at_pass = self._restore_at_pass, None
        if restore is not None:
            set_rng_states(restore)
        self._epoch_start_rng = collect_rng_states()

    def _wrap_hook(self, owner: Any, name: str = "train_dataloader") -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def train_dataloader() -> Any:
            return self._install(original())

        setattr(owner, name, train_dataloader)  # an instance attribute, removed at teardown
        self._wrapped.append((owner, name))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        # the restore comes after setup
        self._loader_keeps_position, self._generators_to_restore, self._position = False, None, None
        self._legacy_order, self._restore_at_pass, self._carried = False, None, False
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden("train_dataloader", datamodule, pl.LightningDataModule):
            self._wrap_hook(datamodule)
            return
        instance = fit_loader_owner(trainer)
        if isinstance(instance, pl.LightningModule):
            self._wrap_hook(pl_module)
        elif instance is not None:
            self._install(instance, rebuild=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for owner, name in self._wrapped:
            owner.__dict__.pop(name, None)
        self._wrapped = []
        if self._silenced in warnings.filters:
            warnings.filters.remove(self._silenced)
        self._silenced = None

    def _global_order(self, loader: DataLoader) -> GlobalOrderSampler | None:
        """A shuffled map-style loader's epoch order as a `GlobalOrderSampler`, else None."""
        trainer, sampler = self._trainer, loader.sampler
        shuffled = isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)
        if trainer is None or self._legacy_order or not shuffled or loader.batch_size is None:
            return None
        seed = getattr(sampler, "seed", None)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed  # as Lightning seeds DistributedSampler
        return GlobalOrderSampler(len(loader.dataset), loader.batch_size, trainer.accumulate_grad_batches,
                                  trainer.global_rank, trainer.world_size, seed, trainer.current_epoch)

    # -- what goes into the checkpoint ----------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """The epoch's position and every rank's generators (for a loader with its own ``state_dict``: the generators).

        Called on every rank while a checkpoint is made (Lightning saves on all ranks).
        """
        trainer = self._trainer
        if trainer is None or trainer.train_dataloader is None:
            return {}
        consumed = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        if self._loader_keeps_position:
            loader = trainer.train_dataloader
            return {"global_step": trainer.global_step, "mid_epoch": 0 < consumed < trainer.num_training_batches,
                    "world_size": trainer.world_size, "rng": _gather(collect_rng_states()),
                    # for a resume on another world size: litdata carries the position, _carry the global batch
                    "global_batch": int(getattr(loader, "batch_size", 0) or 0) * trainer.accumulate_grad_batches
                    * trainer.world_size,
                    "accumulation": trainer.accumulate_grad_batches, "elastic_refusal": _litdata_elastic_refusal(loader),
                    "carried": self._carried}
        order = next((loader.sampler for loader in _loaders(trainer.train_dataloader)
                      if isinstance(getattr(loader, "sampler", None), GlobalOrderSampler)), None)
        # the epoch's layout (a BatchSizeRamp changes the accumulation at the epoch's end, before a checkpoint)
        return {
            "world_size": trainer.world_size, "global_order": order is not None, "carried": self._carried,
            "global_batch": order.global_batch if order else 0, "accumulation": order.accumulation if order else 1,
            "epoch": trainer.current_epoch, "batches_consumed": consumed,
            "rng": _gather({"epoch_start": self._epoch_start_rng, "at_save": collect_rng_states()}),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._generators_to_restore = state_dict if state_dict and "mid_epoch" in state_dict else None

    def _carry(self, trainer: pl.Trainer, checkpoint: dict[str, Any], saved: int) -> str | WorldSizeChangeError:
        """Carry the run to ``trainer.world_size`` processes; the reason it cannot be, or the refusal."""
        from lightning_fastscale.callbacks.batch_size_ramp import BatchSizeRamp, decompose, world_sizes_that_split

        state = _saved_state(checkpoint)
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
        self._carried = True
        rank_zero_info(f"ExactResume: {world_size_change(saved, trainer.world_size, ckpt)}: global batch {global_batch} "
                       f"kept as {plan.per_device} per device x {plan.accumulation} accumulation x {trainer.world_size}")
        return ""

    def _resume_plan(self, state: dict[str, Any]) -> tuple[Any, Any, int] | None:
        trainer = self._trainer
        assert trainer is not None
        consumed = int(state["batches_consumed"])
        if state["epoch"] != trainer.current_epoch or consumed >= trainer.num_training_batches or consumed <= 0:
            return None  # saved at an epoch boundary: the new epoch starts from its beginning
        if state["world_size"] != trainer.world_size or len(state["rng"]) != trainer.world_size:
            return None, None, consumed  # counted in this run's micro-batches (_carry); fresh generators
        mine = state["rng"][_rank()]
        return mine["epoch_start"], mine["at_save"], consumed

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Carry a checkpoint of another world size (before any state is restored), or refuse it unless allowed."""
        state = _saved_state(checkpoint)
        # a checkpoint written before the global order continues in the order it was written in
        self._legacy_order = "world_size" in state and "global_order" not in state and "rng" not in state
        self._position = saved_position(checkpoint)
        # an older layout kept the position as the loader's state, its epoch-start generators as at the iterator's making
        self._old_layout = self._position is not None and self._position is not state
        saved = saved_world_size(checkpoint)
        carry = saved is not None and (saved != trainer.world_size or state.get("carried", False))
        why = self._carry(trainer, checkpoint, saved) if carry else ""
        if why:
            error = why if isinstance(why, WorldSizeChangeError) else WorldSizeChangeError(
                saved, trainer.world_size, str(trainer.ckpt_path or ""), why)
            if not self.allow_world_size_change:
                raise error
            rank_zero_warn(f"ExactResume: {world_size_change(saved, trainer.world_size, str(trainer.ckpt_path or ''))}: "
                           f"{error.why}; continuing with another global batch and order (allow_world_size_change=True)")
        loop_state = checkpoint_fit_loop(checkpoint).get("state_dict") or {}
        if "combined_loader" in loop_state:  # Lightning would look for a stateful loader to give it to
            loop_state["combined_loader"] = [s for s in loop_state["combined_loader"] if not _is_position(s)]

    def _skippers(self, trainer: pl.Trainer) -> list[tuple[SkipFirstBatches, int]]:
        """The skipping samplers of the loaders Lightning iterates (put in where it made its own), with their batch sizes."""
        skippers = []
        for loader in _loaders(trainer.train_dataloader):
            if isinstance(getattr(loader, "sampler", None), GlobalOrderSampler):
                loader.sampler.accumulation = trainer.accumulate_grad_batches  # a carried run changed it
            skipper = self._skipper(loader)
            if skipper is not None:
                skippers.append((skipper, loader.batch_size))
        return skippers

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        position, self._position = self._position, None
        if self._loader_keeps_position:
            load_pending_loader_state(trainer)
            return
        skippers = self._skippers(trainer)
        if position is None:
            return
        for skipper, _ in skippers:
            # Lightning made the iterator before it sets the epoch; one with workers drew its first indices then
            skipper.set_epoch(trainer.current_epoch)
        plan = self._resume_plan(position) if trainer.fit_loop.restarting else None
        if plan is not None:  # mid-epoch: Lightning starts the loader over, the samplers skip
            if not skippers:
                return
            epoch_start, at_save, consumed = plan
            if len(skippers) == len(list(_loaders(trainer.train_dataloader))) and not self._silenced:
                # Lightning warns of any mid-epoch resume of a loader without state_dict; this one is exact
                warnings.filterwarnings("ignore", "You're resuming from a checkpoint that ended before the epoch ended")
                self._silenced = warnings.filters[0]
            self._restore_at_pass = None if self._old_layout else epoch_start
            for skipper, batch_size in skippers:
                skipper.skip = consumed * batch_size
                skipper.after_skip = None if at_save is None else functools.partial(set_rng_states, at_save)
            old = self._old_layout and epoch_start is not None
            restart_train_iterator(trainer, before=functools.partial(set_rng_states, epoch_start) if old else None)
            return
        # Saved at an epoch boundary (or after an epoch's last batch): Lightning starts the next
        # epoch. Its iterator (made already) drew the worker seed and (with workers) its first
        # indices in the saved epoch's order, and will draw a RandomSampler's order from generators
        # restarted from the seed; the uninterrupted run drew them from the generators as they were
        # at the save. Put those back (same world size) and make the iterator again.
        same = position["world_size"] == trainer.world_size and len(position["rng"]) == trainer.world_size
        restart_train_iterator(trainer, before=functools.partial(set_rng_states, position["rng"][_rank()]["at_save"])
                               if same else None)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._skippers(trainer)  # a loader made again this epoch

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
