"""Test-only view of what the communication core did: collectives per stage, hook calls, buckets.

The package keeps no counters on its hot path; tests patch the two seams instead:
``allreduce._issue`` (every collective, with its stage name) and ``comm_hooks._enqueue``
(every DDP bucket handed to a hook).
"""
from __future__ import annotations

from collections import Counter
from typing import Any
from unittest import mock

from lightning_fastscale.strategies import allreduce, comm_hooks


class CommRecorder:
    """Context manager recording ``stages`` (stage name -> collectives issued), ``hook_calls`` and
    ``buckets`` (bucket index -> elements, latest layout) in this process."""

    def __init__(self) -> None:
        self.stages: Counter[str] = Counter()
        self.hook_calls = 0
        self.buckets: dict[int, int] = {}
        self._patches: list[Any] = []

    def __enter__(self) -> CommRecorder:
        issue, enqueue = allreduce._issue, comm_hooks._enqueue

        def counted_issue(stage: str, *args: Any, **kwargs: Any) -> Any:
            self.stages[stage] += 1
            return issue(stage, *args, **kwargs)

        def counted_enqueue(state: Any, bucket: Any, *args: Any, **kwargs: Any) -> Any:
            self.hook_calls += 1
            self.buckets[bucket.index()] = bucket.buffer().numel()
            return enqueue(state, bucket, *args, **kwargs)

        self._patches = [mock.patch.object(allreduce, "_issue", counted_issue),
                         mock.patch.object(comm_hooks, "_enqueue", counted_enqueue)]
        for patch in self._patches:
            patch.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for patch in reversed(self._patches):
            patch.stop()
