"""``num_workers: auto``: pick the loader worker count by measuring, and remember the pick.

Tencent Cloud 2020 tune the number of preprocessing threads automatically instead of asking the
user. `probe_num_workers` times a few batches at each candidate worker count and picks
the smallest count whose throughput reaches ``threshold`` (95%) of the best one measured: more
workers than that only take cores and memory from the training processes. The pick and its
curve are stored in a small JSON file keyed by machine, dataset and resolution
(`WorkerCountCache`), so later runs on the same machine skip the probe.
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
    """0, 1, 2, 4, ... up to ``max_workers``, always including ``max_workers`` itself."""
    counts, n = [0], 1
    while n < max_workers:
        counts.append(n)
        n *= 2
    if max_workers > 0:
        counts.append(max_workers)
    return counts


def images_per_second(loader: Iterable[Any], batches: int, warmup: int, batch_size: int) -> float:
    """Samples per second over ``batches`` batches after ``warmup`` untimed ones.

    A loader shorter than that is iterated again (its restart is then part of the timing,
    as it is in training).
    """
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
    """Measure images/s for each worker count in ``candidates``; return (pick, curve).

    ``make_loader(n)`` builds a loader with ``n`` workers. Each count gets ``max(2, n)``
    warm-up batches (worker start-up and the first prefetch), then ``batches`` timed ones.
    """
    curve: dict[int, float] = {}
    for n in candidates:
        curve[n] = images_per_second(make_loader(n), batches, warmup=max(2, n), batch_size=batch_size)
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
    """Worker-count picks keyed by (machine, dataset, resolution, batch size, ranks per machine).

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
    def key(dataset_id: str, resolution: int, batch_size: int, local_ranks: int) -> str:
        """One string for one probe setting on this machine."""
        digest = hashlib.sha1(dataset_id.encode()).hexdigest()[:12]
        return f"{machine_key()}|{digest}|{resolution}px|b{batch_size}|{local_ranks}ranks"

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored pick and curve (worker count -> images/s) for ``key``, or None."""
        entry = self._read().get(key)
        if entry is None:
            return None
        return {"num_workers": int(entry["num_workers"]),
                "images_per_s": {int(k): float(v) for k, v in entry["images_per_s"].items()}}

    def put(self, key: str, num_workers: int, curve: dict[int, float]) -> None:
        """Store a pick; written atomically so concurrent ranks never leave half a file."""
        entries = self._read()
        entries[key] = {"num_workers": num_workers, "images_per_s": {str(k): round(v, 1) for k, v in curve.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, self.path)


def resolve_num_workers(
    make_loader: Callable[[int], Iterable[Any]],
    cache: WorkerCountCache,
    dataset_id: str,
    resolution: int,
    batch_size: int,
    local_ranks: int = 1,
    max_workers: int | None = None,
) -> tuple[int, dict[str, Any]]:
    """``(worker count, probe record)`` for one loader setting: cached, else measured and cached.

    ``max_workers`` bounds the probe (default: this machine's cores shared by its
    ``local_ranks`` training processes). The record holds the curve and whether it came
    from the cache; the pick is logged either way.
    """
    max_workers = max_workers or max(1, (os.cpu_count() or 1) // local_ranks)
    key = cache.key(dataset_id, resolution, batch_size, local_ranks)
    hit = cache.get(key)
    if hit is not None:
        log.info("data.num_workers=auto: %d (cached in %s)", hit["num_workers"], cache.path)
        return int(hit["num_workers"]), {**hit, "cached": True}
    pick, curve = probe_num_workers(make_loader, candidate_worker_counts(max_workers), batch_size)
    cache.put(key, pick, curve)
    log.info(
        "data.num_workers=auto: %d (images/s by workers: %s; cached in %s)",
        pick, ", ".join(f"{n}: {r:.0f}" for n, r in curve.items()), cache.path,
    )
    return pick, {"num_workers": pick, "images_per_s": curve, "cached": False}
