"""The user-facing example: a plain LightningModule with Trainer(strategy="hier_ring", devices=4).

Runs the script as a user would; Lightning's own launcher starts the other 3 ranks.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)  # 4 freshly started ranks; slow only when the machine is shared
def test_example_trains_with_hier_ring() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hier_ring_plain_module.py"), "--max-epochs", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(text for text in done.stdout.splitlines() if text.startswith("final train_loss="))
    assert "Topology(num_nodes=2, ranks_per_node=2)" in line and "algorithm=hier" in line
    assert "comm_hook=hier_hook" in line
    assert int(re.search(r"comm_hook_calls=(\d+)", line).group(1)) == 4  # 512 samples / (32 x 4 ranks) = 4 steps
    assert float(re.search(r"train_loss=([\d.]+)", line).group(1)) < 1.386  # below ln(4): it learned
