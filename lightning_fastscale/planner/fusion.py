"""Gradient fusion planning (Jia et al. 2018, Sec. 4.2): which gradients to all-reduce together.

An exact dynamic programme over bucket boundaries; ``docs/methods/gradient_fusion.md``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from lightning_fastscale.strategies.options import MB

CostFn = Callable[[np.ndarray], np.ndarray]
"""Seconds to all-reduce buckets of the given sizes in bytes (vectorised over a numpy array)."""


@dataclass(frozen=True)
class FusionPlan:
    """A fusion plan in gradient-ready (backward) order and its predicted timeline from the start of backward.

    ``ends[k]`` is one past the index of bucket ``k``'s last gradient.
    """

    ends: tuple[int, ...]
    bucket_bytes: tuple[int, ...]
    finish_s: float
    backward_end_s: float
    comm_s: float

    @property
    def exposed_s(self) -> float:
        """Communication time not hidden behind backward compute."""
        return max(0.0, self.finish_s - self.backward_end_s)

    @property
    def num_buckets(self) -> int:
        """Number of buckets (all-reduce calls per step)."""
        return len(self.ends)

    def ddp_bucket_cap_mb_list(self) -> list[float]:
        """Per-bucket caps in MiB that make DDP form exactly these buckets (each cap its bucket's size)."""
        return [b / MB for b in self.bucket_bytes]

    def ddp_kwargs(self) -> dict:
        """DDP keyword arguments: ``bucket_cap_mb_list`` where torch has it, else the largest bucket's cap."""
        if ddp_supports_bucket_list():
            return {"bucket_cap_mb_list": self.ddp_bucket_cap_mb_list()}
        return {"bucket_cap_mb": max(self.bucket_bytes) / MB}

    def as_dict(self) -> dict:
        """JSON-friendly summary."""
        return {
            "num_buckets": self.num_buckets,
            "ends": list(self.ends),
            "bucket_mb": [round(b / MB, 4) for b in self.bucket_bytes],
            "finish_s": self.finish_s,
            "backward_end_s": self.backward_end_s,
            "exposed_s": self.exposed_s,
            "comm_s": self.comm_s,
        }


def ddp_supports_bucket_list() -> bool:
    """Whether this torch's DDP accepts ``bucket_cap_mb_list`` (exact per-bucket caps)."""
    from torch.nn.parallel import DistributedDataParallel

    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def _check(grad_bytes: Sequence[int], backward_s: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.asarray(grad_bytes, dtype=np.int64)
    times = np.asarray(backward_s, dtype=float)
    if sizes.ndim != 1 or sizes.size == 0:
        raise ValueError("grad_bytes must be a non-empty 1-D sequence of gradient sizes in bytes")
    if times.shape != sizes.shape:
        raise ValueError(
            f"backward_s has {times.size} entries but grad_bytes has {sizes.size}: give one "
            "backward time per gradient (0 for gradients produced by the same layer)"
        )
    if (sizes <= 0).any() or (times < 0).any():
        raise ValueError("grad_bytes must be > 0 and backward_s >= 0")
    return sizes, np.cumsum(times)


def simulate(
    ends: Sequence[int], grad_bytes: Sequence[int], backward_s: Sequence[float], cost: CostFn
) -> FusionPlan:
    """Predicted timeline of the buckets ``ends`` (one past each bucket's last gradient)."""
    sizes, ready = _check(grad_bytes, backward_s)
    ends = tuple(int(e) for e in ends)
    if not ends or ends[-1] != sizes.size or any(b <= a for a, b in zip((0,) + ends, ends)):
        raise ValueError(f"bucket ends {ends} must increase strictly and end at {sizes.size}")
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    bucket_bytes = np.diff(prefix[[0, *ends]])
    durations = np.asarray(cost(bucket_bytes.astype(float)), dtype=float)
    finish = 0.0
    for end, duration in zip(ends, durations):
        finish = max(finish, ready[end - 1]) + duration
    return FusionPlan(ends, tuple(int(b) for b in bucket_bytes), float(finish), float(ready[-1]), float(durations.sum()))


def plan_fusion(
    grad_bytes: Sequence[int],
    backward_s: Sequence[float],
    cost: CostFn,
    max_buckets: int | None = None,
) -> FusionPlan:
    """Bucket boundaries that minimise the predicted end of the last all-reduce.

    ``backward_s[i]``: compute between gradients ``i-1`` and ``i`` (backward order); ``cost``
    prices a bucket's bytes; ``max_buckets=2`` gives the two-segment plan of Jia et al. 2018.
    """
    sizes, ready = _check(grad_bytes, backward_s)
    n = sizes.size
    if max_buckets is not None and max_buckets < 1:
        raise ValueError(f"max_buckets={max_buckets} must be >= 1")
    prefix = np.concatenate([[0], np.cumsum(sizes)]).astype(float)
    # durations[i - 1][j]: the all-reduce of a last bucket holding gradients [j, i)
    durations = [np.asarray(cost(prefix[i] - prefix[:i]), dtype=float) for i in range(1, n + 1)]

    def next_row(previous: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # earliest finish covering gradients [0, i) with one bucket more than ``previous`` used
        row, arg = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=np.int64)
        for i in range(1, n + 1):
            candidates = np.maximum(previous[:i], ready[i - 1]) + durations[i - 1]
            j = int(np.argmin(candidates))
            row[i], arg[i] = candidates[j], j
        return row, arg

    # The earliest finish over any bucket count: one row that feeds on itself.
    target = None
    if max_buckets is None:
        unbounded = np.full(n + 1, np.inf)
        unbounded[0] = 0.0
        for i in range(1, n + 1):
            unbounded[i] = np.min(np.maximum(unbounded[:i], ready[i - 1]) + durations[i - 1])
        target = round(float(unbounded[n]), 12)
    # Then the fewest buckets reaching it (or, bounded, the best count up to max_buckets): a link
    # priced without latency makes every split before the end of backward free in the model,
    # while DDP and the network still pay for each bucket.
    k_max = n if max_buckets is None else min(int(max_buckets), n)
    previous = np.full(n + 1, np.inf)
    previous[0] = 0.0
    rows, args = [], []
    for _ in range(k_max):
        previous, arg = next_row(previous)
        rows.append(previous[n])
        args.append(arg)
        if target is not None and round(float(previous[n]), 12) <= target:
            break
    k = int(np.argmin(rows)) + 1
    ends, i = [], n
    while k > 0:
        ends.append(i)
        i, k = int(args[k - 1][i]), k - 1
    return simulate(sorted(ends), sizes, backward_s, cost)


def ddp_buckets(grad_bytes: Sequence[int], caps_bytes: Sequence[int]) -> tuple[int, ...]:
    """Bucket ends that DDP's own assignment forms over ``grad_bytes`` (ready order); the last cap repeats."""
    tensors = [torch.empty(1, dtype=torch.uint8).expand(int(b)) for b in grad_bytes]
    indices = list(range(len(tensors)))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        tensors, [int(c) for c in caps_bytes], [False] * len(tensors), indices
    )
    return tuple(max(bucket) + 1 for bucket in buckets)


def best_uniform_cap(
    grad_bytes: Sequence[int], backward_s: Sequence[float], cost: CostFn, candidates_mb: Sequence[float] | None = None
) -> tuple[float, FusionPlan]:
    """The single ``bucket_cap_mb`` whose DDP buckets give the earliest predicted finish (default: a grid + prefixes)."""
    sizes, _ = _check(grad_bytes, backward_s)
    if candidates_mb is None:
        total = float(sizes.sum())
        grid = np.geomspace(0.25 * MB, max(total, 0.25 * MB), 64)
        candidates = np.unique(np.concatenate([grid, np.cumsum(sizes)]).astype(np.int64))
    else:
        candidates = np.unique(np.asarray([c * MB for c in candidates_mb], dtype=np.int64))
    best_cap, best_plan, seen = None, None, set()
    for cap in candidates:
        ends = ddp_buckets(sizes, [int(cap)])
        if ends in seen:
            continue
        seen.add(ends)
        plan = simulate(ends, sizes, backward_s, cost)
        if best_plan is None or plan.finish_s < best_plan.finish_s - 1e-12:
            best_cap, best_plan = int(cap), plan
    return best_cap / MB, best_plan
