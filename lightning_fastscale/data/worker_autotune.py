"""``num_workers: auto``: pick the loader worker count by measuring, and remember the pick (Tencent Cloud 2020).

More in ``docs/input_pipeline.md`` ("Worker auto-tuning").
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_ENV = "FASTSCALE_CACHE_DIR"


def candidate_worker_counts(max_workers: int) -> list[int]:
    """0 (decode in the training process, in the background), 1, 2, 4, ... up to and including ``max_workers``.

    Examples:
        >>> candidate_worker_counts(6)
        [0, 1, 2, 4, 6]
    """
    counts, n = [0], 1
    while n < max_workers:
        counts.append(n)
        n *= 2
    counts.append(max(1, max_workers))
    return counts


def images_per_second(loader: Iterable[Any], batches: int, warmup: int, batch_size: int) -> float:
    """Samples per second over ``batches`` batches after ``warmup`` untimed ones (a short loader restarts, timed)."""
    iterator = _cycle(loader)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    elapsed = time.perf_counter() - start
    iterator.close()  # stops the workers
    return batches * batch_size / elapsed


def _cycle(loader: Iterable[Any]) -> Generator[Any, None, None]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the loader yields no batches; nothing to probe num_workers with")


def pick_smallest_within(curve: dict[int, float], threshold: float = 0.95) -> int:
    """The smallest worker count whose throughput is at least ``threshold`` x the best."""
    best = max(curve.values())
    return min(n for n, rate in curve.items() if rate >= threshold * best)


def probe_num_workers(
    make_loader: Callable[[int], Iterable[Any]],
    candidates: Sequence[int],
    batch_size: int,
    batches: int = 8,
    threshold: float = 0.95,
) -> tuple[int, dict[int, float]]:
    """``(pick, curve)``: images/s of ``make_loader(n)`` for each ``n`` in ``candidates``, after ``max(2, n)`` warm-up batches."""
    curve = {n: images_per_second(make_loader(n), batches, warmup=max(2, n), batch_size=batch_size)
             for n in candidates}
    return pick_smallest_within(curve, threshold), curve


def machine_key() -> str:
    """Host name, CPU count and processor: what the best worker count depends on."""
    return f"{socket.gethostname()}/{os.cpu_count()}cpu/{platform.processor() or platform.machine()}"


def default_cache_file() -> Path:
    """``$FASTSCALE_CACHE_DIR/num_workers.json``, else the user cache directory."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root) / "num_workers.json"
    import platformdirs

    return Path(platformdirs.user_cache_dir("lightning_fastscale")) / "num_workers.json"


class WorkerCountCache:
    """Worker-count picks keyed by (machine, dataset, resolution, batch size, ranks per machine, threads).

    Examples:
        >>> import tempfile
        >>> cache = WorkerCountCache(Path(tempfile.mkdtemp()) / "nw.json")
        >>> key = cache.key("/data/x", 224, 64, 1)
        >>> cache.get(key) is None
        True
        >>> cache.put(key, 4, {0: 10.0, 4: 50.0}); cache.get(key)["num_workers"]
        4
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_file()

    @staticmethod
    def key(dataset_id: str, resolution: int, batch_size: int, local_ranks: int, threads: int | str = "auto") -> str:
        """One string for one probe setting on this machine (``threads``: the decode threads asked for)."""
        digest = hashlib.sha1(dataset_id.encode()).hexdigest()[:12]
        return f"{machine_key()}|{digest}|{resolution}px|b{batch_size}|{local_ranks}ranks|threads={threads}"

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored pick, its decode threads and the curve (worker count -> images/s) for ``key``, or None."""
        entry = self._read().get(key)
        if entry is None:
            return None
        return {"num_workers": int(entry["num_workers"]), "decode_threads": int(entry.get("decode_threads", 1)),
                "images_per_s": {int(k): float(v) for k, v in entry["images_per_s"].items()}}

    def put(self, key: str, num_workers: int, curve: dict[int, float], decode_threads: int = 1) -> None:
        """Store a pick; written atomically so concurrent ranks never leave half a file."""
        entries = self._read()
        entries[key] = {"num_workers": num_workers, "decode_threads": decode_threads,
                        "images_per_s": {str(k): round(v, 1) for k, v in curve.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, self.path)


def cores_per_rank(local_ranks: int = 1, max_workers: int | None = None) -> int:
    """The cores one training process's loader may use: ``max_workers``, else its share of the cores it may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max_workers or max(1, cores // max(1, local_ranks))


def threads_per_worker(cores: int, num_workers: int) -> int:
    """Decode threads per loader process (or the training process, for 0 workers) that fill ``cores``.

    Examples:
        >>> [threads_per_worker(8, w) for w in (0, 1, 2, 4, 8)]
        [8, 8, 4, 2, 1]
    """
    return max(1, cores // max(1, num_workers))


def resolve_num_workers(
    make_loader: Callable[[int, int], Iterable[Any]],
    cache: WorkerCountCache,
    dataset_id: str,
    resolution: int,
    batch_size: int,
    local_ranks: int = 1,
    max_workers: int | None = None,
    decode_threads: int | None = None,
) -> tuple[int, int, dict[str, Any]]:
    """``(worker count, decode threads, probe record)``: cached, else measured over `cores_per_rank` cores and cached.

    ``make_loader(workers, threads)`` builds the loader; ``decode_threads`` fixes the threads (fewer workers fit).
    """
    cores = cores_per_rank(local_ranks, max_workers)
    key = cache.key(dataset_id, resolution, batch_size, local_ranks, decode_threads or "auto")
    hit = cache.get(key)
    if hit is not None:
        log.info("num_workers=auto: %d, decode_threads=%d (cached in %s)",
                 hit["num_workers"], hit["decode_threads"], cache.path)
        return int(hit["num_workers"]), int(hit["decode_threads"]), {**hit, "cached": True}

    def threads(workers: int) -> int:
        return decode_threads or threads_per_worker(cores, workers)

    counts = candidate_worker_counts(cores // decode_threads if decode_threads else cores)
    pick, curve = probe_num_workers(lambda w: make_loader(w, threads(w)), counts, batch_size)
    cache.put(key, pick, curve, threads(pick))
    log.info(
        "num_workers=auto: %d, decode_threads=%d (images/s by workers x threads: %s; cached in %s)",
        pick, threads(pick), ", ".join(f"{n}x{threads(n)}: {r:.0f}" for n, r in curve.items()), cache.path,
    )
    record = {"num_workers": pick, "decode_threads": threads(pick), "images_per_s": curve,
              "threads_by_workers": {n: threads(n) for n in curve}, "cached": False}
    return pick, threads(pick), record
