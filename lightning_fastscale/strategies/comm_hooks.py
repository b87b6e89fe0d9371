"""DDP communication hooks that run the two-level all-reduces on DDP's gradient buckets.

A hook is ``(state, GradBucket) -> Future[Tensor]`` (torch's ``register_comm_hook`` contract,
like ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``): DDP keeps
bucketing the gradients and calling the hook as buckets fill during backward; the hook returns
the averaged bucket. Register with ``ddp_model.register_comm_hook(state, hier_hook)``
on any backend (gloo included).

More in ``docs/strategy.md`` ("Communication hooks").
"""
# No ``from __future__ import annotations``: DDP checks the hooks' annotations as real objects.
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fastscale.strategies.allreduce import (
    CollectiveStageError,
    TopKErrorFeedback,
    flat_allreduce_,
    hier_allreduce_,
    torus2d_allreduce_,
)
from lightning_fastscale.strategies.topology import ProcessGroups

_INLINE_BACKENDS = frozenset({"nccl"})


class CommHookError(RuntimeError):
    """The all-reduce of one DDP bucket failed; ``__cause__`` is the backend's error.

    Attributes: ``algorithm``, ``stage`` (one of
    [`STAGES`][lightning_fastscale.strategies.allreduce.STAGES], or ``"hook"`` outside a
    collective), ``bucket`` (DDP bucket index), ``rank``.
    """

    def __init__(self, algorithm: str, stage: str, bucket: int, rank: int, cause: BaseException) -> None:
        root = cause.__cause__ if isinstance(cause, CollectiveStageError) and cause.__cause__ else cause
        super().__init__(
            f"{algorithm} all-reduce of DDP bucket {bucket} failed on rank {rank} in stage '{stage}': "
            f"{type(root).__name__}: {root}"
        )
        self.algorithm, self.stage, self.bucket, self.rank = algorithm, stage, bucket, rank


class _CommWorker:
    """One daemon thread running submitted jobs in submission order; each completes a Future."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fastscale-comm", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[torch.futures.Future], None], future: torch.futures.Future) -> None:
        self._jobs.put((job, future))

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            try:
                job(future)
            except BaseException as error:  # the job records its own failures; this is a last resort
                if not future.done():
                    future.set_exception(error)

    def close(self, wait_s: float) -> None:
        self._jobs.put(None)
        # Daemon thread: if it is still blocked in a collective, the process can exit anyway.
        self._thread.join(timeout=wait_s)


@dataclass
class HierarchicalHookState:
    """Everything the hooks need, created once at setup.

    ``wire_dtype``: a name of [`WIRE_DTYPES`][lightning_fastscale.strategies.options.WIRE_DTYPES].
    ``topk``: top-k compression of the inter-node stage, from hook iteration ``topk_start_iter``
    on (DDP rebuilds buckets after iteration 0: the PowerSGD practice). ``iteration``: completed
    hook iterations. ``inline``: run in the hook, not the worker thread (default: on NCCL).
    ``algorithm``: the name errors report; ``error``: the first failure. ``param_index``:
    ``id(parameter) -> index``, so top-k residuals are kept in parameter order in every run.
    """

    groups: ProcessGroups
    wire_dtype: str = "fp32"
    topk: Optional[TopKErrorFeedback] = None
    topk_start_iter: int = 2
    chunk_numel: Optional[int] = None
    iteration: int = 0
    inline: Optional[bool] = None
    algorithm: str = ""
    error: Optional[CommHookError] = None
    param_index: dict = field(default_factory=dict)
    _worker: Optional[_CommWorker] = field(default=None, repr=False)
    _streams: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.inline is None:
            self.inline = self.groups.backend in _INLINE_BACKENDS

    def submit(self, job: Callable[[torch.futures.Future], None], device: torch.device) -> torch.futures.Future:
        """Run ``job(future)`` on the communication thread (started on first use); ``job`` completes ``future``."""
        future = _future(device)
        if self._worker is None:
            self._worker = _CommWorker()
        self._worker.submit(job, future)
        return future

    def comm_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """This worker's CUDA stream on ``device`` (made on first use, on the worker thread)."""
        if device not in self._streams:
            torch.cuda.set_device(device)
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def raise_if_failed(self) -> None:
        """Raise the first communication failure of this run, if there was one."""
        if self.error is not None:
            raise self.error

    def close(self, wait_s: float = 5.0) -> None:
        """Stop the communication thread (at teardown), waiting at most ``wait_s`` seconds for it."""
        if self._worker is not None:
            self._worker.close(wait_s)
            self._worker = None


def _future(device: torch.device) -> torch.futures.Future:
    """A future for a bucket on ``device`` (CUDA-aware on a GPU, so DDP's use of it waits on its stream)."""
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def _fail(state: HierarchicalHookState, index: int, error: BaseException) -> CommHookError:
    if state.error is None:
        stage = error.stage if isinstance(error, CollectiveStageError) else "hook"
        wrapped = CommHookError(state.algorithm or "communication", stage, index, state.groups.rank, error)
        wrapped.__cause__ = error.__cause__ if isinstance(error, CollectiveStageError) else error
        state.error = wrapped
    return state.error


def run_bucket_job(
    state: HierarchicalHookState, tensor: Tensor, index: int, work: Callable[[torch.futures.Future], None]
) -> torch.futures.Future:
    """Run ``work(future)`` for DDP bucket ``index`` inline or on the communication thread; ``work`` sets the result.

    What every hook of the strategy shares: inline on NCCL, in bucket order on the worker thread
    otherwise (see the module docstring); an exception completes the future with the run's
    [`CommHookError`][lightning_fastscale.strategies.CommHookError], and once a bucket has failed
    the later ones fail at once instead of waiting on the broken groups.
    """

    def job(future: torch.futures.Future) -> None:
        if state.error is not None:  # the groups are broken: do not wait on them again
            future.set_exception(state.error)
            return
        try:
            work(future)
        except Exception as error:
            future.set_exception(_fail(state, index, error))

    if state.inline:
        future = _future(tensor.device)
        job(future)
        return future
    return state.submit(job, tensor.device)


def _residual_coordinates(
    state: HierarchicalHookState, bucket: dist.GradBucket, numel: int,
) -> tuple[Any, Optional[list[tuple[int, int]]]]:
    """Top-k residual key and layout of a bucket, independent of DDP's order inside the bucket.

    DDP fills its first buckets in reverse parameter order and rebuilds them in gradient-ready
    order after one iteration, so a resumed run starts on another order than the one its
    residuals were saved in. With ``state.param_index`` the bucket is compressed in parameter
    order (``segments``: ``(start, numel)`` of each parameter in the buffer, in that order) and
    keyed by its parameters' indices, so residuals mean the same entries in every run.
    """
    if not state.param_index:
        return bucket.index(), None
    params = bucket.parameters()
    ids = [state.param_index.get(id(p)) for p in params]
    sizes = [p.numel() for p in params]
    if None in ids or sum(sizes) != numel:
        return bucket.index(), None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    key = tuple(ids[i] for i in order)
    if order == list(range(len(ids))):
        return key, None
    return key, [(starts[i], sizes[i]) for i in order]


def _enqueue(state: HierarchicalHookState, bucket: dist.GradBucket, algorithm: Callable[..., Tensor],
             sparse: bool) -> torch.futures.Future:
    tensor = bucket.buffer()
    index = bucket.index()
    topk = state.topk if sparse and state.iteration >= state.topk_start_iter else None
    if bucket.is_last():
        state.iteration += 1
    world_size = state.groups.topology.world_size
    key, segments = _residual_coordinates(state, bucket, tensor.numel()) if topk is not None else (index, None)
    kwargs = {"topk": topk, "key": key} if sparse else {}

    def reduce(buffer: Tensor) -> None:
        # Average before casting, like DDP's fp16 hook, so fp16 sums cannot overflow.
        buffer.div_(world_size)
        if segments is None:
            algorithm(buffer, state.groups, wire_dtype=state.wire_dtype, chunk_numel=state.chunk_numel, **kwargs)
            return
        canonical = torch.cat([buffer[start:start + size] for start, size in segments])
        algorithm(canonical, state.groups, wire_dtype=state.wire_dtype, chunk_numel=state.chunk_numel, **kwargs)
        for (start, size), part in zip(segments, canonical.split([size for _, size in segments])):
            buffer[start:start + size].copy_(part)

    ready: Any = None
    if tensor.is_cuda and not state.inline:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))

    def work(future: torch.futures.Future) -> None:
        if ready is None:
            reduce(tensor)
            future.set_result(tensor)
            return
        stream = state.comm_stream(tensor.device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if state.groups.backend == "gloo":
                host = tensor.to("cpu")
                reduce(host)
                tensor.copy_(host)
            else:
                reduce(tensor)
            future.set_result(tensor)  # records an event on ``stream``: DDP waits for it

    return run_bucket_job(state, tensor, index, work)


def flat_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one flat all-reduce (the baseline, with the wire dtype option)."""
    return _enqueue(state, bucket, flat_allreduce_, sparse=False)


def hier_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with the hierarchical all-reduce of Jia et al. 2018 (Tencent)."""
    return _enqueue(state, bucket, hier_allreduce_, sparse=True)


def torus2d_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with the 2D-torus all-reduce of Mikami et al. 2018 (Sony)."""
    return _enqueue(state, bucket, torus2d_allreduce_, sparse=True)


HOOKS = {"flat": flat_hook, "hier": hier_hook, "torus2d": torus2d_hook}
"""Algorithm name -> DDP communication hook."""
