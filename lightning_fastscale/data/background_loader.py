"""Background batches: with ``num_workers=0``, decode the next batches on a thread of the training process.

Without loader workers the batch is decoded in the training process, which on few cores is
the fastest way to use them all (one process, no batch pickled between processes, the decode
threads of `fast_decode.train_batch`), as FFCV (Leclerc et al. 2023) does. Run synchronously,
though, that decoding sits on the training thread between steps and the accelerator idles.
`BackgroundStreamingDataLoader` runs litdata's iterator on one producer thread that keeps a
bounded queue of ``batches_ahead`` finished batches; the training thread only pops them, so
decoding overlaps the step (pipelined loading, Jia et al. 2018).

Resumption stays exact: litdata's ``state_dict`` counts the samples its iterator yielded,
which includes the batches decoded ahead (and past an epoch's end its dataset has already
counted the next epoch); `BackgroundStreamingDataLoader.state_dict` reports the state taken
when the batch last handed out was produced, which is what the synchronous loader reports
after handing it out.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from typing_extensions import override

from .device_prefetch import rewind_streaming_state
from .streaming_datasets import EpochAwareStreamingDataLoader

__all__ = ["BackgroundStreamingDataLoader"]

_POLL_S = 0.1  # how often a blocked put/get looks at the stop flag / the producer's liveness
_JOIN_S = 60.0  # longest wait for the producer to finish the batch it is decoding when stopped
_BATCH, _END, _ERROR = range(3)


class BackgroundStreamingDataLoader(EpochAwareStreamingDataLoader):
    """`EpochAwareStreamingDataLoader` with ``num_workers=0`` whose batches come from a producer thread.

    The producer iterates the parent loader (epoch set-up, reading, the collate function's
    decode) up to ``batches_ahead`` batches ahead of the consumer. An exception raised while
    producing a batch (a `CorruptDataError`) is raised by ``next`` at that batch. Leaving the
    loop early (``break``, Lightning's ``limit_train_batches``) or starting a new iteration
    stops the producer; every wait polls, so no thread stays blocked, and the thread is a
    daemon. ``state_dict`` is the state after the batches handed out, not those decoded ahead.

    Examples:
        >>> from litdata import StreamingDataset  # doctest: +SKIP
        >>> loader = BackgroundStreamingDataLoader(StreamingDataset("data/train"), batch_size=32,
        ...                                        batches_ahead=2)  # doctest: +SKIP
        >>> for images, labels in loader:  # doctest: +SKIP
        ...     ...
    """

    def __init__(self, *args: Any, batches_ahead: int = 2, **kwargs: Any) -> None:
        if kwargs.get("num_workers", 0) != 0:
            raise ValueError("BackgroundStreamingDataLoader decodes in the training process: num_workers must be 0")
        if isinstance(batches_ahead, bool) or not isinstance(batches_ahead, int) or batches_ahead < 1:
            raise ValueError(f"prefetch_factor={batches_ahead!r} (batches decoded ahead) must be an integer >= 1")
        super().__init__(*args, **kwargs)
        self.batches_ahead = batches_ahead
        self._lock = threading.Lock()  # held by the producer while it advances the parent iterator
        self._produced = 0  # batches the producer finished this iteration (written by the producer)
        self._consumed = 0  # batches handed out this iteration (written by the consumer)
        self._consumed_state: dict[str, Any] | None = None  # the loader's state at that position
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _in_flight(self) -> int:
        return self._produced - self._consumed

    def _snapshot(self) -> dict[str, Any]:
        state = super().state_dict()
        return {**state, "dataset": dict(state["dataset"])}  # litdata returns its live dict

    def _produce(self, source: Iterator[Any], out: queue.Queue[tuple[int, Any]], stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                with self._lock:
                    try:
                        batch = next(source)
                    except StopIteration:
                        break
                    self._produced += 1
                    # The state the synchronous loader would report once this batch is handed
                    # out, taken now: running on, the producer moves litdata's counter and, past
                    # the epoch's end, the dataset's epoch count and loaded state.
                    state = self._snapshot()
                    if self._produced == 1:  # the position before any batch is handed out
                        self._consumed_state = rewind_streaming_state(self, state, 1)
                if not _put(out, (_BATCH, (batch, state)), stop):
                    return
            _put(out, (_END, None), stop)
        except BaseException as err:  # raised in the training thread, at the batch it belongs to
            _put(out, (_ERROR, err), stop)
        finally:
            with self._lock:
                source.close()  # runs the parent iterator's clean-up on the thread that advanced it

    def _stop_producer(self) -> None:
        thread, stop = self._thread, self._stop
        if thread is None or stop is None:
            return
        stop.set()
        thread.join(_JOIN_S)
        if thread.is_alive():
            raise RuntimeError(f"the background batch thread did not stop within {_JOIN_S:.0f} s")
        self._thread = self._stop = None
        # Batches decoded ahead and dropped were never handed out: the position is the consumer's,
        # as the synchronous loader's would be.
        if self._in_flight() and self._consumed_state is not None:
            self._num_samples_yielded_streaming = self._consumed_state["num_samples_yielded"]
            self.dataset.current_epoch = self._consumed_state["dataset"]["current_epoch"]
        self._produced = self._consumed

    @override
    def __iter__(self) -> Any:
        self._stop_producer()
        self._produced = self._consumed = 0
        self._consumed_state = None
        out: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=self.batches_ahead)
        stop = threading.Event()
        source = super().__iter__()
        thread = threading.Thread(
            target=self._produce, args=(source, out, stop), name="fastscale-background-batches", daemon=True
        )
        self._thread, self._stop = thread, stop
        thread.start()
        try:
            while True:
                kind, item = _get(out, thread)
                if kind == _END:
                    return
                if kind == _ERROR:
                    raise item
                batch, self._consumed_state = item
                self._consumed += 1
                yield batch
        finally:
            if self._thread is thread:
                self._stop_producer()

    @override
    def state_dict(self) -> dict[str, Any]:
        """litdata's state as of the last batch handed out (batches decoded ahead do not count)."""
        with self._lock:  # the producer is between batches
            if self._in_flight() and self._consumed_state is not None:
                return {**self._consumed_state, "dataset": dict(self._consumed_state["dataset"])}
            return super().state_dict()

    @override
    def load_state_dict(self, obj: dict[str, Any]) -> None:
        self._stop_producer()
        self._produced = self._consumed = 0
        super().load_state_dict(obj)


def _put(out: queue.Queue[tuple[int, Any]], item: tuple[int, Any], stop: threading.Event) -> bool:
    """Put ``item``, waiting for room until ``stop`` is set; whether it was put."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _get(out: queue.Queue[tuple[int, Any]], producer: threading.Thread) -> tuple[int, Any]:
    """The next item; an error if the producer is gone without leaving one."""
    while True:
        try:
            return out.get(timeout=_POLL_S)
        except queue.Empty:
            if not producer.is_alive() and out.empty():
                raise RuntimeError("the background batch thread ended without a batch or an error") from None
