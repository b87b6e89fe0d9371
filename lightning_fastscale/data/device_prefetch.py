"""Device prefetch: copy the next batch to the accelerator while the current step runs (Jia et al. 2018).

More in ``docs/input_pipeline.md`` ("Device prefetch").
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection, move_data_to_device


class DevicePrefetcher:
    """Iterate ``loader`` with one batch copied ahead to ``device``.

    On CUDA the copy runs on a side stream; elsewhere it is an ordinary ``.to`` (still one batch ahead).

    Examples:
        >>> loader = [torch.zeros(2), torch.ones(2)]
        >>> [b.tolist() for b in DevicePrefetcher(loader, "cpu")]
        [[0.0, 0.0], [1.0, 1.0]]
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self._pending = 0  # batches the loader produced that have not been handed out

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # batch_size, dataset, num_workers, ... of the wrapped loader, for Lightning and users
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _copy(self, batch: Any, stream: torch.cuda.Stream | None) -> Any:
        with torch.cuda.stream(stream):  # a no-op for None
            return move_data_to_device(batch, self.device)

    def __iter__(self) -> Iterator[Any]:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        iterator = iter(self.loader)
        self._pending = 0
        try:
            ahead = self._copy(next(iterator), stream)
        except StopIteration:
            return
        self._pending = 1
        while True:
            if stream is not None:
                compute = torch.cuda.current_stream(self.device)
                compute.wait_stream(stream)
                # the side stream allocated these tensors; the compute stream uses them
                apply_to_collection(ahead, torch.Tensor, lambda t: t.record_stream(compute) if t.is_cuda else None)
            current = ahead
            try:
                ahead = self._copy(next(iterator), stream)
            except StopIteration:
                self._pending = 0
                yield current
                return
            yield current

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state, rewound by the look-ahead batch."""
        state = self.loader.state_dict()  # type: ignore[attr-defined]
        if not self._pending:
            return state
        return rewind_streaming_state(self.loader, state, self._pending)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wrapped loader."""
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]


def rewind_streaming_state(loader: Any, state: dict[str, Any], batches: int) -> dict[str, Any]:
    """A litdata ``StreamingDataLoader`` state as it was ``batches`` batches earlier, from ``state`` alone."""
    samples = batches * loader.batch_size
    dataset = state["dataset"]
    workers = max(1, loader.num_workers)
    return {
        **state,
        "dataset": {
            **dataset,
            "num_samples_yielded": dataset["num_samples_yielded"] - samples,
            "sample_in_epoch": dataset["sample_in_epoch"] - samples * dataset["world_size"],
        },
        "num_samples_yielded": state["num_samples_yielded"] - samples,
        "latest_worker_idx": (state["latest_worker_idx"] - batches) % workers,
    }
