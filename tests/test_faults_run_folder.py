"""One run per run folder: two ``fastscale-train`` runs started together on one ``hydra.run.dir``
cannot both pass; the second is refused by name before it writes anything. A lock left by a
dead run is taken over; ranks of one run never refuse each other."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml

from benchmarks.fault_helpers import finish, kill_group, start
from lightning_fastscale.faults.run_folder_lock import (
    LOCK_NAME,
    RunFolderInUseError,
    claim,
    global_rank_from_env,
)

RUN = [
    "data.train_size=64", "data.val_size=16", "data.batch_size=16", "data.resolution=16",
    "model.model_kwargs.widths=[8,8,8]", "trainer.max_epochs=1", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1", "trainer.accelerator=cpu", "logger=csv",
]


class HoldUntil(pl.Callback):
    """Keep a run at its start until ``path`` exists (bounded), so a second run surely meets it."""

    def __init__(self, path: str, timeout: float = 300.0) -> None:
        self.path, self.timeout = Path(path), timeout

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.mark.slow  # two whole jobs, ~17 s; the claim itself is tested in process below
def test_two_runs_started_together_on_one_folder(tmp_path):
    folder, go_on = tmp_path / "run", tmp_path / "go-on"
    hold = [f"+callbacks.hold._target_={__name__}.HoldUntil", f"+callbacks.hold.path={go_on}"]
    first = start(folder, "seed=1", *hold, run=RUN)
    second = None
    try:
        deadline = time.monotonic() + 300
        while not (folder / LOCK_NAME).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (folder / LOCK_NAME).exists(), "the first run never claimed its folder"
        second = start(folder, "seed=2", run=RUN)
        code_b, refused = finish(second)
        go_on.touch()
        code_a, winner = finish(first)
    finally:
        go_on.touch()
        kill_group(first)
        if second is not None:
            kill_group(second)
    assert (code_a, code_b) == (0, 1), (winner[-2000:], refused[-2000:])
    assert f"run folder {folder} is in use by pid {first.pid} on host {socket.gethostname()}" in refused
    assert "Traceback" not in refused and "final val/top1" in winner
    # nothing of the refused run in the folder: the config is the winner's, the lock is released
    assert yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())["seed"] == 1
    assert not (folder / LOCK_NAME).exists()
    assert [p.name for p in (folder / "checkpoints").glob("epoch*.ckpt")] == ["epoch000.ckpt"]


def test_claim_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, caplog):
    held = claim(tmp_path)
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(RunFolderInUseError, match=rf"{tmp_path} is in use by pid {os.getpid()} on host"):
        claim(tmp_path)
    held.release()
    assert not (tmp_path / LOCK_NAME).exists()

    # a run killed while holding the folder leaves its lock file, but not its lock
    code = "from lightning_fastscale.faults.run_folder_lock import claim; import os, sys; claim(sys.argv[1]); os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env={**os.environ, "RANK": "0"})
    dead = json.loads((tmp_path / LOCK_NAME).read_text())["pid"]
    with caplog.at_level(logging.WARNING):
        held = claim(tmp_path)
    assert f"taking over the lock of pid {dead}" in caplog.text
    held.release()


def test_only_global_rank_zero_claims():
    assert global_rank_from_env({}) == 0
    assert global_rank_from_env({"LOCAL_RANK": "0", "NODE_RANK": "0"}) == 0
    assert global_rank_from_env({"LOCAL_RANK": "1"}) != 0  # Lightning's launcher, second process
    assert global_rank_from_env({"NODE_RANK": "1"}) != 0  # Lightning's launcher, second node
    assert global_rank_from_env({"RANK": "3", "LOCAL_RANK": "0"}) == 3  # torchrun
    assert global_rank_from_env({"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}) == 0
    assert global_rank_from_env({"SLURM_PROCID": "5"}) == 5  # srun
