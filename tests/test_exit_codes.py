"""Each kind of ending: its exit status, retryable or not, and one line on stderr naming the run's log."""
from __future__ import annotations

import errno
import logging

import pytest

from lightning_fastscale.config_check import ConfigError
from lightning_fastscale.data.stored_format import CorruptDataError
from lightning_fastscale.exit_codes import ExitCode, exit_code_for
from lightning_fastscale.faults.checkpoint_reading import CheckpointError
from lightning_fastscale.faults.non_finite_guard import NonFiniteStepsError
from lightning_fastscale.run_folder import end_run


def test_the_documented_table():
    assert {c.name: (int(c), c.retryable) for c in ExitCode} == {
        "FINISHED": (0, False), "BAD_SETTING": (2, False), "BAD_DATA": (3, False), "DIVERGED": (4, False),
        "PREEMPTED": (75, True), "FAULT": (76, True),
    }


@pytest.mark.parametrize(
    ("error", "status", "line"),
    [
        (ConfigError("optimizer.lr=-1: use a learning rate > 0", key="optimizer.lr"), 2,
         "fastscale-train: error: optimizer.lr=-1: use a learning rate > 0 (log: "),
        (CorruptDataError("chunk-3.bin sample 7: not a JPEG"), 3, "[exit 3: bad data, not retryable]: CorruptDataError"),
        (CheckpointError("last.ckpt", "is truncated"), 3, "[exit 3: bad data, not retryable]: CheckpointError"),
        (NonFiniteStepsError("loss is nan at step 12"), 4, "[exit 4: diverged, not retryable]: NonFiniteStepsError"),
        (RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500"), 76, "[exit 76: fault, retryable]"),
        (RuntimeError("Timed out waiting 1800000ms for send operation to complete"), 76, "[exit 76: fault, retryable]"),
        (OSError(errno.ENOSPC, "No space left on device"), 76, "[exit 76: fault, retryable]: OSError"),
        (KeyError("state"), 1, "[exit 1: a bug (KeyError), not retryable]"),
    ],
)
def test_each_kind_ends_in_one_line_with_its_status_and_the_log(tmp_path, capsys, error, status, line):
    log_file = tmp_path / "train.log"
    handler = logging.FileHandler(log_file)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        try:
            raise error
        except Exception as raised:  # noqa: BLE001 - as the entry point catches it, with a traceback
            with pytest.raises(SystemExit) as ended:
                end_run(raised, [handler], log_was_empty=False, run_dir=tmp_path)
    finally:
        root.removeHandler(handler)
        handler.close()
    assert ended.value.code == status
    assert exit_code_for(error) == (None if status == 1 else ExitCode(status))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and line in err[0] and err[0].endswith(f"(log: {log_file})"), err
    assert "Traceback" in log_file.read_text()  # the log keeps what the console leaves out


@pytest.mark.parametrize("environment", ["torchelastic", "slurm"])
def test_a_layout_the_launcher_refuses_is_a_bad_setting(monkeypatch, environment):
    """Lightning's own refusal of trainer.devices x trainer.num_nodes under torchrun or srun: exit 2, not retried."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if environment == "torchelastic":
        monkeypatch.setenv("WORLD_SIZE", "4")
        cluster = TorchElasticEnvironment()
    else:
        monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
        monkeypatch.setenv("SLURM_NNODES", "2")
        cluster = SLURMEnvironment()
    with pytest.raises(ValueError) as refused:
        cluster.validate_settings(num_devices=1, num_nodes=1)
    assert exit_code_for(refused.value) is ExitCode.BAD_SETTING
    assert exit_code_for(ValueError("lr must be positive")) is None
    assert exit_code_for(ValueError("the shape [3] does not match the shape [4]")) is None


@pytest.mark.parametrize(
    ("env", "leaves_with_0"),
    [
        ({"LOCAL_RANK": "1"}, True),  # a rank Lightning's launcher started: its local rank 0 reports
        ({"LOCAL_RANK": "0"}, False),  # the launcher's own rank reports the status
        ({"TORCHELASTIC_RUN_ID": "r", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "0",
          "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, False),  # torchrun's worker
    ],
)
def test_an_agreed_ending_leaves_with_0_only_where_lightnings_launcher_started_the_rank(tmp_path, monkeypatch, env,
                                                                                       leaves_with_0):
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    from lightning_fastscale.exit_codes import end_agreed

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # the Trainer sets the process-wide rank of rank_zero_warn to its own (1 here): put it back after
    for rank_holder in (rank_zero_only, utils_rank_zero_only):
        monkeypatch.setattr(rank_holder, "rank", rank_holder.rank)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", default_root_dir=tmp_path)
    assert trainer.local_rank == int(env["LOCAL_RANK"])
    error = NonFiniteStepsError("loss is nan at step 12")
    with pytest.raises(BaseException) as ended:
        end_agreed(trainer, error)
    if leaves_with_0:
        assert type(ended.value) is SystemExit and ended.value.code == 0 and ended.value.__cause__ is error
    else:
        assert ended.value is error
