"""SLURM launch: the shipped submitit launcher config, no spawn under a cluster launcher, a
sweep through submitit's local launcher (needs no SLURM)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.strategies import DDPStrategy

from lightning_fastscale import train

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the [slurm] extra")

SLURM_TASK_ENV = {  # what srun sets in each task of a 2-task job
    "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "train",
    "SLURM_NODELIST": "node1",
}


def _compose(overrides, hydra_config=False):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_fastscale.conf", version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra_config)


@pytest.fixture
def no_cluster_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "LSB_", "JSM_")) or key == "TORCHELASTIC_RUN_ID":
            monkeypatch.delenv(key)
    monkeypatch.setattr(train, "_is_multirun", lambda: True)


def test_multirun_spawns_ranks_without_a_cluster_launcher(no_cluster_env):
    cfg = _compose(["strategy=ddp", "trainer.devices=2"])
    assert not train.cluster_launches_ranks()
    strategy = train.build_strategy(cfg, cfg.trainer.devices)
    assert isinstance(strategy, DDPStrategy) and strategy._start_method == "spawn"


@pytest.mark.parametrize("cluster_env", [SLURM_TASK_ENV, {"TORCHELASTIC_RUN_ID": "job"}], ids=["slurm", "torchrun"])
@pytest.mark.parametrize("strategy_name", ["ddp", "hier_ring"])
def test_no_spawn_when_the_cluster_starts_one_process_per_rank(no_cluster_env, monkeypatch, cluster_env, strategy_name):
    for key, value in cluster_env.items():
        monkeypatch.setenv(key, value)
    cfg = _compose([f"strategy={strategy_name}", "trainer.devices=2"])
    assert train.cluster_launches_ranks()
    strategy = train.build_strategy(cfg, cfg.trainer.devices)
    assert strategy._start_method == "popen"  # Lightning's default: no processes of its own under SLURM/torchrun


def test_slurm_launcher_config_one_task_per_gpu_and_trainer_follows_it():
    cfg = _compose(["hydra/launcher=slurm", "trainer=slurm", "hydra.launcher.nodes=3",
                    "hydra.launcher.gpus_per_node=4"], hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (3, 4, 4)
    HydraConfig.instance().set_config(cfg)
    assert (cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.accelerator) == (4, 3, "gpu")


@pytest.mark.slow
def test_sweep_through_submitit_local_launcher(tmp_path):
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("fastscale-train")), "-m", "hydra/launcher=submitit_local",
         "hydra.launcher.timeout_min=5", "optimizer.lr=0.05,0.1", "logger=csv", "trainer.accelerator=cpu",
         "data.train_size=32", "data.val_size=32", "data.batch_size=16", "model.model_kwargs.widths=[8,8,8]",
         "trainer.max_epochs=1", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (sweep_dir / ".submitit").is_dir()  # the jobs really went through submitit
    for job, lr in (("0", "0.05"), ("1", "0.1")):
        assert f"optimizer.lr={lr}" in (sweep_dir / job / ".hydra" / "overrides.yaml").read_text()
        assert (sweep_dir / job / "checkpoints" / "last.ckpt").is_file()
        assert (sweep_dir / job / "csv").is_dir()
