"""DDP communication hooks that run the two-level all-reduces on DDP's gradient buckets.

A hook is ``(state, GradBucket) -> Future[Tensor]`` (torch's ``register_comm_hook`` contract,
like ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``): DDP keeps
bucketing the gradients and calling the hook as buckets fill during backward; the hook returns
the averaged bucket. Register with ``ddp_model.register_comm_hook(state, hierarchical_hook)``
on any backend (gloo included).

Why a worker thread: a bucket goes through several collectives on different groups. Issuing
them from future callbacks (as PowerSGD does) lets the order in which ranks issue collectives
on one group differ between ranks on gloo, whose callbacks run on its own threads; a mismatch
there corrupts or hangs. Here the hook only enqueues the bucket; one thread per process runs
the buckets in the order DDP produced them (the same on every rank) while backward continues,
so communication still overlaps computation.
"""
# No ``from __future__ import annotations``: DDP checks the hooks' annotations as real objects.
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fastscale.strategies.allreduce import (
    TopKErrorFeedback,
    hierarchical_allreduce_,
    flat_allreduce_,
    torus2d_allreduce_,
)
from lightning_fastscale.strategies.topology import ProcessGroups


class _CommWorker:
    """One daemon thread running submitted jobs in submission order; each completes a Future."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fastscale-comm", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Tensor]) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            try:
                future.set_result(job())
            except BaseException as error:  # surfaced to DDP when it waits on the future
                future.set_exception(error)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


@dataclass
class HierarchicalHookState:
    """Everything the hooks need, created once at setup.

    ``wire_dtype``: inter-node wire dtype (``None`` keeps the gradient dtype). ``topk``: top-k compression
    of the inter-node stage with its per-bucket residuals, used from hook iteration
    ``topk_start_iter`` on (DDP rebuilds buckets after iteration 0; starting later keeps the
    residuals on the final layout, the PowerSGD practice). ``chunk_numel``: pipeline chunk
    size inside a bucket. ``iteration``: completed hook iterations (decides when top-k starts).
    """

    groups: ProcessGroups
    wire_dtype: torch.dtype | None = None
    topk: TopKErrorFeedback | None = None
    topk_start_iter: int = 2
    chunk_numel: int | None = None
    iteration: int = 0
    _worker: _CommWorker | None = field(default=None, repr=False)

    def submit(self, job: Callable[[], Tensor]) -> torch.futures.Future:
        """Run ``job`` on the communication thread (started on first use)."""
        if self._worker is None:
            self._worker = _CommWorker()
        return self._worker.submit(job)

    def close(self) -> None:
        """Stop the communication thread (at teardown)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def _enqueue(state: HierarchicalHookState, bucket: dist.GradBucket, algorithm: Callable[..., Tensor],
             sparse: bool) -> torch.futures.Future:
    tensor = bucket.buffer()
    index = bucket.index()
    topk = state.topk if sparse and state.iteration >= state.topk_start_iter else None
    if bucket.is_last():
        state.iteration += 1
    world_size = state.groups.topology.world_size

    def job() -> Tensor:
        # Average before casting, like DDP's fp16 hook, so fp16 sums cannot overflow.
        tensor.div_(world_size)
        kwargs = {"topk": topk, "key": index} if sparse else {}
        return algorithm(tensor, state.groups, wire_dtype=state.wire_dtype, chunk_numel=state.chunk_numel, **kwargs)

    return state.submit(job)


def flat_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one flat all-reduce (the baseline, with the wire dtype option)."""
    return _enqueue(state, bucket, flat_allreduce_, sparse=False)


def hierarchical_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with the hierarchical all-reduce of Jia et al. 2018 (Tencent)."""
    return _enqueue(state, bucket, hierarchical_allreduce_, sparse=True)


def torus2d_hook(state: HierarchicalHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with the 2D-torus all-reduce of Mikami et al. 2018 (Sony)."""
    return _enqueue(state, bucket, torus2d_allreduce_, sparse=True)


HOOKS = {"flat": flat_hook, "hier": hierarchical_hook, "torus2d": torus2d_hook}
"""Algorithm name -> DDP communication hook."""
