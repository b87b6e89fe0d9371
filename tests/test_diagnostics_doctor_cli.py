"""``fastscale-doctor`` end to end: four injected bottlenecks, each named, under real launchers.

Every run is the console entry point (``python -m lightning_fastscale.diagnostics.doctor_cli``,
what ``fastscale-doctor`` runs) on the package's Hydra config, with ``data=injected``
(``tests/conf/data/injected.yaml``: random images with an optional per-sample delay or one
slow rank) and tiny limits:

- a slow loader at 0 workers with a linear model -> ``input``, ``data.num_workers`` proposed
  (and with ``--verify``, measured faster);
- one rank slowed by an extra delay, two ranks started by Lightning's own launcher -> ``straggler``
  naming that rank;
- a convolutional network on fast in-memory data -> ``compute``;
- two emulated nodes (network namespaces, torchrun on each) joined by a capped link, a large
  gradient -> ``communication``, a 16-bit wire / hierarchical strategy proposed, and ``--verify``
  measures it faster.

Each run starts Python, Lightning and Hydra (tens of seconds on a loaded 2-core machine), so all
are in the slow set; ``test_diagnostics_doctor.py`` keeps the rules and the probe in the default run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fastscale.emulation import EmulatedCluster, NamespaceUnavailable, check_namespace_support

REPO = Path(__file__).resolve().parents[1]
DOCTOR = [sys.executable, "-m", "lightning_fastscale.diagnostics.doctor_cli"]
QUICK = [
    f"hydra.searchpath=[file://{REPO}/tests/conf]", "data=injected", "trainer.accelerator=cpu",
    "doctor.warmup_steps=2", "doctor.steps=6", "doctor.compute_steps=2", "doctor.loader_batches=3",
    "doctor.verify_warmup_steps=2", "doctor.verify_steps=5",
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _doctor(tmp_path: Path, *overrides: str, timeout: float = 240) -> dict:
    run_dir = tmp_path / "run"
    proc = subprocess.run([*DOCTOR, "--json", *QUICK, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)  # --json: the document is all of stdout
    assert json.loads((run_dir / "doctor.json").read_text())["bottleneck"] == doc["bottleneck"]
    assert (run_dir / "doctor.png").read_bytes()[:4] == b"\x89PNG"
    assert "bottleneck: " + doc["bottleneck"].upper() in proc.stderr  # the report, on stderr with --json
    return doc


@pytest.mark.slow
def test_slow_loader_is_input_and_more_workers_are_proposed(tmp_path):
    doc = _doctor(tmp_path, "model=linear", "data.resolution=8", "data.sample_delay_s=0.003")
    assert doc["bottleneck"] == "input", doc["reason"]
    assert set(doc["breakdown"]) == {"input", "compute", "communication", "optimizer", "rest"}
    fix = doc["fixes"][0]
    assert fix["overrides"][0].startswith("data.num_workers=") and fix["predicted_speedup"] > 1
    assert fix["measured_speedup"] is None  # no --verify


@pytest.mark.slow
def test_slow_loader_fix_is_verified_faster(tmp_path):
    doc = _doctor(tmp_path, "model=linear", "data.resolution=8", "data.sample_delay_s=0.004", "--verify")
    assert doc["bottleneck"] == "input"
    fix = doc["fixes"][0]
    assert fix["overrides"][0].startswith("data.num_workers=")
    assert fix["measured_speedup"] > 1.1, fix


@pytest.mark.slow
def test_one_slow_rank_is_the_straggler_under_lightnings_launcher(tmp_path):
    doc = _doctor(tmp_path, "model=linear", "data.resolution=8", "trainer.devices=2", "strategy=ddp",
                  "data.slow_rank=1", "data.rank_delay_s=0.15")
    assert doc["bottleneck"] == "straggler", doc["reason"]
    assert doc["straggler_rank"] == 1 and "rank 1" in doc["reason"]
    assert len(doc["breakdown_per_rank"]) == 2


@pytest.mark.slow
def test_verify_runs_a_sequence_of_fits_under_lightnings_launcher(tmp_path):
    # rank 0 starts rank 1 by re-running the command line; both then run the measured fit and
    # the baseline and fix fits one after another on the same process group
    # (2 workers per rank measured although this machine has 1 core per rank: a fix to verify)
    doc = _doctor(tmp_path, "model=linear", "data.resolution=8", "trainer.devices=2", "strategy=ddp",
                  "data.sample_delay_s=0.004", "doctor.max_workers=2", "--verify")
    assert doc["bottleneck"] == "input", doc["reason"]
    fix = doc["fixes"][0]
    assert fix["overrides"][0].startswith("data.num_workers=")
    assert fix["measured_speedup"] is not None and fix["verified_step_s"] > 0
    assert doc["baseline_step_s"] > 0 and doc["verify_rounds"] == 1


@pytest.mark.slow
def test_large_model_on_fast_data_is_compute(tmp_path):
    doc = _doctor(tmp_path, "model=resnet_small", "data.batch_size=32")
    assert doc["bottleneck"] == "compute", doc["reason"]
    assert doc["measurements"]["compute_alone_s"] > 0


def _namespaces_or_skip() -> None:
    try:
        check_namespace_support()
    except NamespaceUnavailable as err:
        pytest.skip(f"emulated cluster unavailable: {err}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_capped_link_is_communication_and_a_16bit_wire_is_verified_faster(tmp_path):
    _namespaces_or_skip()
    # linear classifier on 96 px images: 276k parameters, 1.1 MB of fp32 gradient over a 10 Mbit/s link
    job = ["model=linear", "data.resolution=96", "data.batch_size=8", "trainer.num_nodes=2", "trainer.devices=1",
           "strategy=ddp", "--verify"]
    with EmulatedCluster(2, bandwidth_mbit=10) as cluster:
        master = cluster.nodes[0].address
        commands = [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
             "--nproc_per_node", "1", "--master_addr", master, "--master_port", "29500",
             "-m", "lightning_fastscale.diagnostics.doctor_cli", "--json", *QUICK,
             f"hydra.run.dir={tmp_path / f'node{i}'}", *job]
            for i in range(2)
        ]
        results = cluster.run(commands, timeout=360, env=_env(), cwd=str(tmp_path))
    for r in results:
        assert r.returncode == 0, f"node {r.node}:\n{(r.stderr or '')[-4000:]}"
    doc = json.loads((tmp_path / "node0" / "doctor.json").read_text())
    assert doc["bottleneck"] == "communication", doc["reason"]
    allreduce = doc["measurements"]["allreduce_s"]
    # the fusion fix's inputs: DDP's default caps, each gradient's backward time (weight and bias)
    assert doc["measurements"]["bucket_caps_mb"] == [1.0, 25.0]
    assert sorted(doc["measurements"]["backward_profile"]["names"]) == ["model.1.bias", "model.1.weight"]
    assert {"flat/fp32", "flat/bf16", "hier/fp32", "hier/bf16"} <= set(allreduce)
    best = doc["fixes"][0]
    assert "strategy.wire_dtype=bf16" in best["overrides"] or best["overrides"][0].startswith("strategy=hier")
    assert best["predicted_speedup"] > 1.2
    assert best["measured_speedup"] > 1.2, best
