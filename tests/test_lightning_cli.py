"""LightningCLI (jsonargparse) builds every option of the module, the strategy, the LARS plugin
and the callbacks from ``examples/lightning_cli.yaml`` and trains with them."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("jsonargparse", reason="needs the [cli] extra")

from lightning_fastscale.callbacks import LabelSmoothing, ZeroInitResidualBN  # noqa: E402
from lightning_fastscale.planner import CostModelPlanner  # noqa: E402
from lightning_fastscale.precision import LARSMixedPrecision  # noqa: E402
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "lightning_cli.py"
CONFIG = REPO / "examples" / "lightning_cli.yaml"


def _example_main():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import lightning_cli
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return lightning_cli.main


def test_yaml_builds_strategy_plugin_callbacks_and_factories(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])  # the CLI's arguments are only the ones given here
    cli = _example_main()(
        ["--config", str(CONFIG), f"--trainer.default_root_dir={tmp_path}",
         "--data.num_classes=7"],
        run=False,
    )
    trainer, module = cli.trainer, cli.model
    assert isinstance(trainer.strategy, HierarchicalAllReduceStrategy)
    assert isinstance(trainer.precision_plugin, LARSMixedPrecision)
    kinds = {type(c) for c in trainer.callbacks}
    assert {ZeroInitResidualBN, LabelSmoothing} <= kinds
    assert module.hparams.num_classes == 7  # linked from the datamodule
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["lr"] == 0.1
    assert [g["weight_decay"] for g in optimizer.param_groups] == [5e-5, 0.0]  # no decay on bias/norm
    scheduler = module.scheduler_factory(optimizer)
    assert isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR) and scheduler.T_max == 100


def test_planner_flags_as_documented_plan_without_a_backward_time(tmp_path, monkeypatch):
    """The flags of docs/lightning_cli.md, exactly: no backward_time_s, so the planner prices
    backward from the module's FLOPs on the batch the datamodule serves (the module takes it as
    example_input_array at setup, before the strategy plans)."""
    import lightning.pytorch as pl

    from lightning_fastscale.strategies.topology import Topology

    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    cli = _example_main()(
        ["--config", str(CONFIG), f"--trainer.default_root_dir={tmp_path}",
         "--trainer.strategy.init_args.algorithm=auto",
         "--trainer.strategy.init_args.planner=lightning_fastscale.planner.CostModelPlanner",
         "--trainer.strategy.init_args.planner.init_args.params=emulated_local",
         "--data.train_size=64", "--data.val_size=64"],
        run=False,
    )
    planner = cli.trainer.strategy.planner
    assert isinstance(planner, CostModelPlanner) and planner.params is not None
    assert planner.backward_time_s is None and planner.sustained_tflops  # from the cluster file
    # the module's setup hook, as the 2-process fit runs it (one step on one process here)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, default_root_dir=tmp_path).fit(cli.model, cli.datamodule)
    assert tuple(cli.model.example_input_array.shape) == (64, 3, 32, 32)  # the YAML's batch, 32 px
    plan = planner.plan(cli.model, Topology(num_nodes=2, ranks_per_node=1))
    assert plan.algorithm in ("flat", "hier", "torus2d") and 1 <= plan.plan.num_buckets <= 3


@pytest.mark.slow  # the YAML-building tests above run by default; this adds two fit steps
def test_fit_two_steps_from_the_yaml(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "fit", "--config", str(CONFIG), "--trainer.max_steps=2",
         "--data.train_size=128", "--data.val_size=64", f"--trainer.default_root_dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "HierarchicalAllReduceStrategy: algorithm=hier, num_nodes=2, ranks_per_node=1, world_size=2" in out
    assert "ImageClassifier: weight decay 0" in out and "ZeroInitResidualBN: zeroed" in out
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == 2  # 128 samples / (2 ranks x 64) = 1 step per epoch, 2 epochs
    assert state["lr_schedulers"][0]["T_max"] == 100  # the YAML's CosineAnnealingLR stepped with the run
    assert state["lr_schedulers"][0]["last_epoch"] == 2


@pytest.mark.slow  # two short 2-process fits
def test_the_documented_command_runs_twice_in_the_same_folder(tmp_path):
    """Each run writes under its own ``runs/lightning_cli/<stamp>`` (config.yaml is never overwritten)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for _ in range(2):
        env.pop("LIGHTNING_CLI_RUN_STAMP", None)
        proc = subprocess.run([sys.executable, str(SCRIPT), "fit", "--config", str(CONFIG), "--trainer.max_steps=1",
                               "--data.train_size=128", "--data.val_size=64"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        time.sleep(1.1)  # the stamp has one-second resolution
    runs = sorted((tmp_path / "runs" / "lightning_cli").iterdir())
    assert len(runs) == 2 and all((r / "config.yaml").is_file() and list((r / "checkpoints").glob("*.ckpt")) for r in runs)
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "checkpoints").exists()
