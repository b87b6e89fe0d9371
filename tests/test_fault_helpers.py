"""The fault tests' own diagnostics: a run that hangs is killed with its stacks shown."""
from __future__ import annotations

import os
import sys

import pytest

from benchmarks.fault_helpers import finish, popen_group, stacks


@pytest.mark.slow  # a child that imports numpy, then the SIGABRT round: several seconds
def test_a_hung_run_is_killed_and_its_stacks_are_shown_without_the_module_lists(tmp_path):
    hung = "import time, numpy\ndef wait_forever():\n    time.sleep(600)\nprint('started', flush=True)\nwait_forever()\n"
    proc = popen_group([sys.executable, "-c", hung], cwd=tmp_path, env=dict(os.environ))
    with pytest.raises(AssertionError) as failure:
        finish(proc, timeout=3)
    message = str(failure.value)
    assert "did not finish in 3 s" in message and "started" in message
    assert "in wait_forever" in message  # the hung thread's stack, printed on SIGABRT
    assert "Extension modules:" not in message
    assert proc.poll() is not None


def test_stacks_keeps_a_module_list_another_process_interrupts():
    own = "Extension modules: numpy.core, torch._C (total: 2)"
    interrupted = 'Extension modules: numpy,\n  File "x.py", line 3 in f\n torch (total: 2)'
    assert stacks(f"a\n{own}\nb") == "a\n\nb"
    assert stacks(interrupted) == interrupted
