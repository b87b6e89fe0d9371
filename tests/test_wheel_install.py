"""The package as a user installs it: a wheel in a fresh virtual environment, no source tree.

The wheel is built from a copy of the files a source distribution would carry, installed with
``pip --no-deps`` into a new venv whose heavy dependencies (torch, Lightning, Hydra, ...) come
from this interpreter's site-packages through a ``.pth`` line (nothing is downloaded), and its
console scripts run from an empty working directory, so the configs and cluster files can only
come from inside the installed package.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, timeout=120):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "lightning_fastscale", src / "lightning_fastscale",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_NO_INDEX"] = "1"  # nothing may come from the network
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src],
         cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("lightning_fastscale-*.whl")

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env).strip())
    # the heavy dependencies, read from this interpreter's environment (appended after the venv's own)
    (site / "_shared_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel], cwd=tmp, env=env)
    work = tmp / "work"
    work.mkdir()
    return env_dir, work, env, site


def test_wheel_carries_configs_and_imports_from_the_venv(installed_venv):
    env_dir, work, env, site = installed_venv
    out = _run([env_dir / "bin" / "python", "-c", "import lightning_fastscale, sys; print(lightning_fastscale.__file__)"],
               work, env)
    assert Path(out.strip()).is_relative_to(site)  # the installed copy, not a checkout
    assert (site / "lightning_fastscale" / "conf" / "train.yaml").is_file()
    assert (site / "lightning_fastscale" / "conf" / "model" / "resnet_small.yaml").is_file()


def test_fastscale_train_runs_from_the_wheel(installed_venv):
    env_dir, work, env, _ = installed_venv
    run_dir = work / "run"
    out = _run(
        [env_dir / "bin" / "fastscale-train", "logger=none", "trainer.max_steps=2", "trainer.max_epochs=1",
         "trainer.accelerator=cpu", "data.train_size=32", "data.val_size=32", "data.batch_size=16",
         "model.model_kwargs.widths=[8,8,8]", "trainer.enable_progress_bar=false",
         f"hydra.run.dir={run_dir}"],
        work, {**env, "OMP_NUM_THREADS": "1"}, timeout=180,
    )
    assert "final val/top1:" in out
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow  # the wheel's configs and fastscale-train are checked by default
def test_fastscale_plan_runs_from_the_wheel(installed_venv):
    env_dir, work, env, _ = installed_venv
    out = _run([env_dir / "bin" / "fastscale-plan", "resnet18", "tencent_p40_100g", "--json"], work, env)
    report = json.loads(out)
    assert report["cluster"]["name"] == "tencent_p40_100g"  # the shipped cluster file was found
