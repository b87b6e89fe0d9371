"""``--help`` of every console script says what it does and names its own flags (not Hydra's boilerplate)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(("script", "says"), [
    ("fastscale-train", ("fastscale-train: train an image classifier", "exit status", "-m / --multirun", "== Config ==")),
    ("fastscale-doctor", ("why is this training job slow", "--verify", "--json", "doctor.json")),
    ("fastscale-plan", ("Predict all-reduce time per algorithm", "--json")),
    ("fastscale-data", ("convert image data to the streaming format", "verify")),
])
def test_help_says_what_it_does_and_its_flags(script, says):
    proc = subprocess.run([str(Path(sys.executable).with_name(script)), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(s in proc.stdout for s in says), proc.stdout[:1500]
    assert "powered by Hydra" not in proc.stdout
