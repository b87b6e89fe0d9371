"""``fastscale-train`` end to end: single run with W&B offline, resume, multirun with DDP."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = [
    "data.train_size=192", "data.val_size=64", "data.batch_size=32",
    "model.model_kwargs.widths=[8,16,16]", "trainer.max_epochs=1", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
]


def fastscale_train(args, cwd, timeout=300):
    exe = Path(sys.executable).with_name("fastscale-train")
    env = {**os.environ, "WANDB_MODE": "", "WANDB_API_KEY": "", "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if v != ""}
    proc = subprocess.run(
        [str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def wandb_logged_values(run_dir: Path, key: str) -> list[float]:
    """Values logged under ``key`` in an offline W&B run file.

    Offline runs keep everything in ``run-*.wandb`` (protobuf records); a history item is the
    key as field 2 followed by its JSON value as field 16, which is all this needs to read.
    """
    data = _only(run_dir.glob("run-*.wandb")).read_bytes()
    k = key.encode()
    pattern = re.escape(bytes([0x12, len(k)]) + k + b"\x82\x01") + rb".([-0-9.eE]+)"
    return [float(m.group(1)) for m in re.finditer(pattern, data, re.DOTALL)]


def _only(paths):
    paths = list(paths)
    assert len(paths) == 1, paths
    return paths[0]


@pytest.mark.slow  # 24 s: the longest test of the fast suite, which must stay under 10 minutes on 2 cores
def test_single_run_wandb_offline_then_resume(tmp_path):
    run_dir = tmp_path / "first"
    # two epochs, every epoch's checkpoint kept: the resume below starts from the first one, into
    # the same two epochs, so the default cosine schedule keeps its length
    out = fastscale_train(
        [*TINY, "trainer.max_epochs=2", "callbacks.model_checkpoint.save_top_k=-1", f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert "final val/top1:" in out
    assert "(offline)" in out  # no API key: W&B ran offline and said where
    assert "anonymous setting" not in out  # Lightning's anonymous=None is not handed to wandb.init
    # The run folder's log holds Lightning's lines and the summary; samples/s even in 6 steps.
    run_log = (run_dir / "train.log").read_text()
    for line in ("GPU available", "Step breakdown", "samples/s", "W&B run written to",
                 "final val/top1:"):
        assert line in run_log and line in out, line

    wandb_run = _only((run_dir / "wandb").glob("offline-run-*"))
    logged = wandb_logged_values(wandb_run, "val/top1")
    assert logged and all(0.0 <= v <= 1.0 for v in logged)
    assert f"final val/top1: {logged[-1]:.4f}" in out  # the printed metric is the logged one
    run_file = _only(wandb_run.glob("run-*.wandb")).read_bytes()
    assert b"resnet_small" in run_file and b"ProceduralDataModule" in run_file  # the config
    # the step breakdown (on by default): logged every log_every_n_steps, report in the run folder
    assert wandb_logged_values(wandb_run, "breakdown/step_s")
    assert "Step breakdown" in out and (run_dir / "step_breakdown.png").exists()
    breakdown = json.loads((run_dir / "step_breakdown.json").read_text())
    assert breakdown["summary"]["bottleneck"] in breakdown["verdicts"]
    assert breakdown["summary"]["samples_per_s"] > 0 and breakdown["windows"][0]["first_step"] == 0

    first = run_dir / "checkpoints" / "epoch000.ckpt"
    first_state = torch.load(first, map_location="cpu", weights_only=False)
    assert first_state["epoch"] == 0 and first_state["global_step"] == 6  # 192 / 32 steps
    uninterrupted = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert uninterrupted["global_step"] == 12

    # Resuming writes into a new folder and continues at epoch 1, step 6
    resumed_dir = tmp_path / "resumed"
    out2 = fastscale_train(
        [*TINY, "trainer.max_epochs=2", f"ckpt_path={first}", f"hydra.run.dir={resumed_dir}", "logger=csv"],
        tmp_path,
    )
    metrics_csv = resumed_dir / "csv" / "version_0" / "metrics.csv"
    assert f"metrics written to {metrics_csv}" in out2 and metrics_csv.is_file()  # the console says where
    resumed = torch.load(resumed_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert resumed["epoch"] == 1 and resumed["global_step"] == 12
    # the resumed run's breakdown is numbered by the global step: steps 6..11
    windows = json.loads((resumed_dir / "step_breakdown.json").read_text())["windows"]
    assert windows[0]["first_step"] == 6 and windows[-1]["last_step"] == 11
    assert torch.load(first, map_location="cpu", weights_only=False)["global_step"] == 6  # untouched
    # under the cosine schedule, the resumed second epoch lands on the uninterrupted run's weights
    for name, value in uninterrupted["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)

    # a checkpoint of another world size whose global batch does not split here is refused at the
    # restore, in Hydra's keys, naming the world sizes that keep it (34 = 2 x 17 on a ceiling of 16)
    first_state["callbacks"]["ExactResume"].update(world_size=2, global_batch=34)
    torch.save(first_state, two_ranks := tmp_path / "two_ranks.ckpt")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}  # the console's one line
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("fastscale-train")), *TINY, f"ckpt_path={two_ranks}", "logger=csv",
         "callbacks.exact_resume.max_per_device_batch=16", f"hydra.run.dir={tmp_path / 'refused'}"],
        cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "fastscale-train: error: ckpt_path=" in proc.stderr
    assert "was written by 2 processes, this run has 1" in proc.stderr
    assert "its global batch 34 does not split" in proc.stderr
    assert "trainer.devices x trainer.num_nodes = 17 or 34," in proc.stderr
    assert "callbacks.exact_resume.allow_world_size_change=true" in proc.stderr


def test_refuses_to_overwrite_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"precious")
    exe = Path(sys.executable).with_name("fastscale-train")
    proc = subprocess.run(
        [str(exe), *TINY, "logger=csv", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "refusing to overwrite" in proc.stderr and "hydra.run.dir" in proc.stderr
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == b"precious"


@pytest.mark.slow  # the sweep path itself is covered by test_train_slurm's submitit_local sweep
def test_multirun_two_jobs_with_two_ddp_processes_each(tmp_path):
    sweep_dir = tmp_path / "sweep"
    out = fastscale_train(
        ["-m", *TINY, "optimizer.lr=0.05,0.1", "trainer.devices=2", "trainer.accelerator=cpu",
         "strategy=ddp", f"hydra.sweep.dir={sweep_dir}"],
        tmp_path, timeout=600,
    )
    assert out.count("final val/top1:") == 2
    for job in ("0", "1"):
        job_dir = sweep_dir / job
        assert (job_dir / "checkpoints" / "last.ckpt").is_file()
        wandb_run = _only((job_dir / "wandb").glob("offline-run-*"))
        assert wandb_logged_values(wandb_run, "val/top1")
    lrs = {(sweep_dir / j / ".hydra" / "overrides.yaml").read_text().count("optimizer.lr=0.05") for j in "01"}
    assert lrs == {0, 1}  # each job ran its own learning rate


@pytest.mark.slow  # 2-rank strategy=ddp fastscale-train also runs in tests/test_faults_resume.py
def test_plain_ddp_run_on_two_cpu_processes(tmp_path):
    run_dir = tmp_path / "ddp"
    out = fastscale_train(
        [*TINY, "trainer.devices=2", "trainer.accelerator=cpu", "strategy=ddp", "logger=csv",
         f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert "final val/top1:" in out
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 3  # 192 samples / (2 ranks x 32) per step
