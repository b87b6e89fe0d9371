"""The peer watchdog ends a rank once a peer reported a failure or the rendezvous store is gone,
and leaves alone a rank that stopped watching (it ends on its own error, or the run finished)."""
from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from lightning_fastscale.emulation.faults import free_port
from lightning_fastscale.faults.peer_watchdog import FAULT_EXIT_CODE, PeerWatchdog


def watching(port: int, rank: int, **kwargs) -> tuple[PeerWatchdog, threading.Event, list[int]]:
    ended, codes = threading.Event(), []

    def exit(code: int) -> None:
        codes.append(code)
        ended.set()

    watchdog = PeerWatchdog("127.0.0.1", port, rank, poll_s=0.05, settle_s=0.2, exit=exit, **kwargs)
    watchdog.start()
    return watchdog, ended, codes


def test_a_hung_rank_ends_with_the_fault_code_once_a_peer_reports_and_the_reporter_does_not():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
    failing, failing_ended, failing_codes = watching(port, 0)
    hung, hung_ended, hung_codes = watching(port, 1)
    finished, finished_ended, _ = watching(port, 2)
    finished.stop()  # the run ended here: no longer watching
    assert not hung_ended.wait(0.3)  # nothing reported yet
    failing.report_failure("CommHookError: all-reduce timed out")
    assert hung_ended.wait(5) and hung_codes == [FAULT_EXIT_CODE]
    assert store.get("fastscale/peer_failed").decode() == "rank 0: CommHookError: all-reduce timed out"
    assert not failing_ended.wait(0.5) and failing_codes == []  # it ends on its own error
    assert not finished_ended.is_set()


def test_a_rank_ends_when_the_store_is_gone_for_the_grace_period():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
    watchdog, ended, codes = watching(port, 1, grace_s=0.5)
    assert not ended.wait(0.3)
    del store  # the store's host (rank 0, or torchrun's agent) is gone
    assert ended.wait(10) and codes == [FAULT_EXIT_CODE]
