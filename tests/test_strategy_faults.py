"""A rank killed or hung mid-backward ends the run on every rank with an error naming the cause.

Four CPU ranks over gloo (2 emulated nodes x 2 for the hierarchical strategies), a 3 s
process-group time-out, one rank faulting in the middle of backward at step 2
(:func:`lightning_fastscale.emulation.faults.run_fault_scenario`). Every other rank must end on
its own, non-zero, within twice the time-out plus the time a Python process takes to tear down
on this shared machine. A hung rank ends itself with the fault exit code under the package's
strategies (their peer watchdog); under Lightning's DDP it is left for the launcher to stop.
"""
from __future__ import annotations

import re

import pytest

from lightning_fastscale.emulation.faults import run_fault_scenario
from lightning_fastscale.faults.peer_watchdog import FAULT_EXIT_CODE

TIMEOUT_S = 3.0
EXIT_SLACK_S = 12.0  # raising, Lightning's teardown and interpreter exit of 4 ranks on 2 loaded cores
ALGORITHM = {"hier_ring": "hier", "hier_torus": "torus2d"}
CAUSE = re.compile(r"timed out|timeout|connection (reset|closed)|closed by peer|broken pipe", re.IGNORECASE)
pytestmark = pytest.mark.timeout(420)


# A killed rank under the strategy's own hook runs by default; the hung rank, plain DDP (the
# baseline) and the torus cases, about 25 s each, run with ``-m slow``.
@pytest.mark.parametrize(("strategy", "fault"), [
    ("hier_ring", "kill"),
    pytest.param("hier_ring", "hang", marks=pytest.mark.slow),
    pytest.param("hier_torus", "kill", marks=pytest.mark.slow),
    pytest.param("hier_torus", "hang", marks=pytest.mark.slow),
    pytest.param("ddp", "kill", marks=pytest.mark.slow),
    pytest.param("ddp", "hang", marks=pytest.mark.slow),
])
def test_every_rank_ends_with_the_cause(strategy: str, fault: str) -> None:
    outcome = run_fault_scenario(strategy, fault, timeout_s=TIMEOUT_S, fault_rank=1, startup_s=300,
                                 bound_s=2 * TIMEOUT_S + 60)
    detail = f"{outcome}\n{outcome.log_tail}"
    survivors = [0, 2, 3]
    assert outcome.exited, detail
    assert outcome.finished == (), detail
    assert outcome.seconds_to_exit is not None and outcome.seconds_to_exit <= 2 * TIMEOUT_S + EXIT_SLACK_S, detail
    assert all(outcome.exit_codes[r] != 0 for r in survivors), detail
    if fault == "kill":
        assert outcome.exit_codes[1] == -9 and outcome.killed_leftovers == (), detail
    elif strategy in ALGORITHM:  # the strategy's watchdog ends the hung rank once its peers failed
        assert outcome.killed_leftovers == () and outcome.exit_codes[1] == FAULT_EXIT_CODE, detail
    else:
        assert outcome.killed_leftovers == (1,), detail  # under Lightning's DDP it waits for its launcher
    assert sorted(outcome.rank_errors) == survivors, detail
    for rank in survivors:
        error = outcome.rank_errors[rank]
        assert CAUSE.search(error), (rank, error)
        if strategy in ALGORITHM:
            head = error.splitlines()[0]
            assert head.startswith(f"CommHookError: {ALGORITHM[strategy]} all-reduce of DDP bucket"), (rank, error)
            assert re.search(rf"failed on rank {rank} in stage '(in-node|inter-node) [a-z -]+'", head), (rank, error)
