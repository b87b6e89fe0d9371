"""Background batches: with ``num_workers=0``, decode the next batches on a thread of the training process.

More in ``docs/input_pipeline.md`` ("Background loading").
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from litdata.streaming.collate import litdata_collate
from typing_extensions import override

from .device_prefetch import rewind_streaming_state
from .streaming_datasets import EpochAwareStreamingDataLoader

__all__ = ["BackgroundStreamingDataLoader"]

_POLL_S = 0.1  # how often a blocked put/get looks at the stop flag / the producer's liveness
_JOIN_S = 60.0  # longest wait for the producer to finish the batch it is reading when stopped
_BATCH, _END, _ERROR = range(3)


class BackgroundStreamingDataLoader(EpochAwareStreamingDataLoader):
    """`EpochAwareStreamingDataLoader` with ``num_workers=0`` whose batches come from a producer thread.

    The producer reads up to ``batches_ahead`` batches ahead; ``collate_fn`` (litdata's by default)
    decodes them on as many threads. An error is raised by ``next`` at its batch; ``state_dict``
    counts the batches handed out only. Details: ``docs/input_pipeline.md`` ("Background loading").

    Examples:
        >>> from litdata import StreamingDataset  # doctest: +SKIP
        >>> loader = BackgroundStreamingDataLoader(StreamingDataset("data/train"), batch_size=32,
        ...                                        batches_ahead=2)  # doctest: +SKIP
        >>> for images, labels in loader:  # doctest: +SKIP
        ...     ...
    """

    def __init__(
        self, *args: Any, batches_ahead: int = 2, collate_fn: Callable[[list[Any]], Any] | None = None, **kwargs: Any
    ) -> None:
        if kwargs.get("num_workers", 0) != 0:
            raise ValueError("BackgroundStreamingDataLoader decodes in the training process: num_workers must be 0")
        if isinstance(batches_ahead, bool) or not isinstance(batches_ahead, int) or batches_ahead < 1:
            raise ValueError(f"prefetch_factor={batches_ahead!r} (batches decoded ahead) must be an integer >= 1")
        # the parent loader only reads (a batch is its list of samples); the collate function
        # decodes, on the pool below, so that the next batch is read while this one decodes
        super().__init__(*args, collate_fn=list, **kwargs)
        self.collate = collate_fn or litdata_collate
        self.batches_ahead = batches_ahead
        self._collate_pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # held by the producer while it advances the parent iterator
        self._produced = 0  # batches the producer finished this iteration (written by the producer)
        self._consumed = 0  # batches handed out this iteration (written by the consumer)
        self._consumed_state: dict[str, Any] | None = None  # the loader's state at that position
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _in_flight(self) -> int:
        return self._produced - self._consumed

    def _produce(self, source: Iterator[Any], out: queue.Queue[tuple[int, Any]], stop: threading.Event) -> None:
        if self._collate_pool is None:
            self._collate_pool = ThreadPoolExecutor(self.batches_ahead, thread_name_prefix="fastscale-collate")
        try:
            while not stop.is_set():
                with self._lock:
                    try:
                        samples = next(source)
                    except StopIteration:
                        break
                    self._produced += 1
                    # taken now: running on, the producer moves litdata's counter (and epoch)
                    state = super().state_dict()
                    state = {**state, "dataset": dict(state["dataset"])}  # litdata returns its live dict
                    if self._produced == 1:  # the position before any batch is handed out
                        self._consumed_state = rewind_streaming_state(self, state, 1)
                batch = self._collate_pool.submit(self.collate, samples)
                if not _put(out, (_BATCH, (batch, state)), stop):
                    batch.cancel()
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
                decoding, state = item
                batch = decoding.result()  # a decode error is raised here, at its batch
                self._consumed_state = state
                self._consumed += 1
                yield batch
        finally:
            if self._thread is thread:
                self._stop_producer()
            _cancel_all(out)

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


def _cancel_all(out: queue.Queue[tuple[int, Any]]) -> None:
    """Cancel the decodes of the batches left in ``out`` that have not started."""
    while True:
        try:
            kind, item = out.get_nowait()
        except queue.Empty:
            return
        if kind == _BATCH:
            item[0].cancel()


def _get(out: queue.Queue[tuple[int, Any]], producer: threading.Thread) -> tuple[int, Any]:
    """The next item; an error if the producer is gone without leaving one."""
    while True:
        try:
            return out.get(timeout=_POLL_S)
        except queue.Empty:
            if not producer.is_alive() and out.empty():
                raise RuntimeError("the background batch thread ended without a batch or an error") from None
