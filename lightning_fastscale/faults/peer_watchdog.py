"""End a rank whose peers have failed, so a hung rank does not outlive its run.

When one rank fails (a collective timed out, a peer vanished) the others raise and exit, but a
rank stuck outside any collective (in a data loader, a hook, a driver call) never notices: an
orphan holding its device until its own hang ends. gloo has no watchdog that aborts it, and
Lightning's launcher stops its children only on Ctrl-C (and nothing stops the launching rank).
Each rank polls the run's rendezvous store from a daemon thread: a failing rank writes its
reason there, and a rank still running a few seconds after reading one (or after finding the
store gone for ``grace_s``) exits with 76, a fault: retryable from the last periodic checkpoint.
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

    ``report_failure`` (on the rank that fails) writes the reason and stops this rank's own
    watching: it ends on its own error. Another rank that reads a reason waits ``settle_s`` for
    its own error path (a collective failing there too calls ``stop``), then calls ``exit``
    with [`FAULT_EXIT_CODE`][lightning_fastscale.faults.peer_watchdog.FAULT_EXIT_CODE]; so does a rank that cannot reach the store for
    ``grace_s``. The form of torch elastic's agent, which stops every worker once one fails,
    kept inside the ranks so that it also holds under Lightning's launcher and SLURM's ``srun``.

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
