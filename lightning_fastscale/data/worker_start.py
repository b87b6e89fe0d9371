"""How loader workers start: from a fork server by default, not by forking the training process.

Forking a process that runs other threads (gloo's, litdata's, a loader's queue feeders) can
leave the child, or the parent inside ``fork``, waiting on a lock that one of them held
(pytorch issue 130610; Python 3.12 warns about it and 3.14 makes the fork server Linux's
default). The server is one single-threaded process per training process, started with torch
and this package imported, so every worker after the first starts about as fast as a fork.
As with ``spawn``, the script that starts training needs an ``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

START_METHODS = ("forkserver", "spawn", "fork")


def check_start_method(multiprocessing_context: str | None) -> str | None:
    """``multiprocessing_context`` as given, or a ``ValueError`` naming the values this platform has."""
    if multiprocessing_context is None:
        return None
    available = [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]
    if multiprocessing_context not in available:
        raise ValueError(
            f"multiprocessing_context={multiprocessing_context!r}: must be one of {available} "
            "or None (Python's default start method)"
        )
    return multiprocessing_context


def worker_context(multiprocessing_context: str | None, dataset: object, num_workers: int) -> BaseContext | None:
    """The context a ``DataLoader`` of ``num_workers`` starts them in (None: Python's default,
    and always with no workers, as ``DataLoader`` requires).

    A fork server not yet running will import torch, this package's data modules and
    ``dataset``'s module when it starts.
    """
    if multiprocessing_context is None or num_workers == 0:
        return None
    context = multiprocessing.get_context(multiprocessing_context)
    if multiprocessing_context == "forkserver":
        preload = ["torch", "lightning_fastscale.data", type(dataset).__module__]
        context.set_forkserver_preload([m for m in dict.fromkeys(preload) if m != "__main__"])
    return context
