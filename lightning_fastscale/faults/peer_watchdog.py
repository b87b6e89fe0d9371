"""End a rank whose peers have failed, so a hung rank does not outlive its run (torch elastic's agent, inside the ranks).

More in ``docs/faults.md`` ("The peer watchdog").
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

# The fault exit status (retryable, from the last periodic checkpoint), as lightning_fastscale.exit_codes names it.
FAULT_EXIT_CODE = 76
_KEY = "fastscale/peer_failed"

log = logging.getLogger(__name__)


class PeerWatchdog:
    """Polls the rendezvous store at ``host:port``; ends this process once a peer has failed.

    A rank that reads a peer's `report_failure` waits ``settle_s`` for its own error path, then
    exits with `FAULT_EXIT_CODE`; so does one that cannot reach the store for ``grace_s``.

    Examples:
        >>> watchdog = PeerWatchdog("127.0.0.1", 29500, rank=1)  # doctest: +SKIP
        >>> watchdog.start()  # doctest: +SKIP
        >>> watchdog.report_failure("CommHookError: ... timed out")  # on the failing rank  # doctest: +SKIP
    """

    def __init__(
        self, host: str, port: int, rank: int, poll_s: float = 2.0, settle_s: float = 5.0, grace_s: float = 60.0,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.host, self.port, self.rank = host, int(port), rank
        self.poll_s, self.settle_s, self.grace_s = poll_s, settle_s, grace_s
        self._exit = exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=max(self.poll_s, 1.0)))

    def start(self) -> None:
        """Watch from a daemon thread (its own store connection) until `stop`."""
        self._thread = threading.Thread(target=self._watch, name="fastscale-peer-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the run ended, or this rank is ending on its own error)."""
        self._stop.set()

    def report_failure(self, reason: str) -> None:
        """Tell the other ranks this one failed (best effort: the store may be gone), then `stop`."""
        self.stop()
        try:
            self._client().set(_KEY, f"rank {self.rank}: {reason}"[:500])
        except Exception as err:  # the store's host already went; the peers find it gone instead
            log.debug("could not report the failure to the rendezvous store: %s", err)

    def _watch(self) -> None:
        store, unreachable_since = None, None
        while not self._stop.wait(self.poll_s):
            try:
                store = store or self._client()
                if store.check([_KEY]):
                    reason = store.get(_KEY).decode(errors="replace")
                    if not self._stop.wait(self.settle_s):
                        self._end(f"a peer failed ({reason})")
                    return
                unreachable_since = None
            except Exception as err:  # connection refused or reset: the store's host is gone
                store = None
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= self.grace_s:
                    self._end(f"the run's rendezvous store {self.host}:{self.port} is gone ({type(err).__name__})")
                    return

    def _end(self, why: str) -> None:
        print(f"rank {self.rank}: {why}; ending this rank with exit code {FAULT_EXIT_CODE} "
              "(restart the run: it resumes from the last checkpoint)", file=sys.stderr, flush=True)
        self._exit(FAULT_EXIT_CODE)
