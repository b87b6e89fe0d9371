"""Elastic launch: ``torchrun --nnodes=1:2`` (c10d rendezvous) with ``fastscale-train resume=auto``
on two emulated nodes; one node leaves mid-epoch, the other's agent restarts its workers on the
new world size and they resume: every sample of each epoch trained on exactly once (CPU, gloo).
Lost (SIGKILL, nothing written): from the last periodic checkpoint, the survivor's worker exits
76 (fault). Graceful (SIGTERM to its agent): from the preemption checkpoint, both exit 75."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from lightning_fastscale.emulation import EmulatedCluster, NamespaceUnavailable, check_namespace_support

REPO = Path(__file__).resolve().parents[1]
# trainer.num_nodes follows torchrun's node count by default: 2, then 1 after the loss.
# 256 samples, global batch 32 (16 per device x 2 nodes): 8 steps per epoch, 16 in all; a
# periodic checkpoint every 3 steps. Node 1 is lost after step 11 (epoch 1), so the run
# resumes on node 0 alone from step 9, mid-epoch 1, as 16 per device x 2 accumulation.
SIZE, GLOBAL_BATCH, EPOCHS, PERIOD, LOST_AFTER = 256, 32, 2, 3, 11
STEPS_PER_EPOCH = SIZE // GLOBAL_BATCH
RESUMED_AT = LOST_AFTER // PERIOD * PERIOD
RUN = [
    f"data.train_size={SIZE}", "data.val_size=32", f"data.batch_size={GLOBAL_BATCH // 2}", "data.resolution=16",
    "model.model_kwargs.widths=[8,8,8]", f"trainer.max_epochs={EPOCHS}", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1", "trainer.accelerator=cpu", "logger=csv", "strategy=ddp", "trainer.devices=1",
    f"callbacks.periodic_checkpoint.every_n_train_steps={PERIOD}",
    f"callbacks.exact_resume.max_per_device_batch={GLOBAL_BATCH // 2}", "resume=auto",
]


class SampleLog(pl.Callback):
    """One line per micro-batch in ``<folder>/samples.jsonl``: torchrun's restart count, the step,
    epoch, world size, emulated node and the ids of the samples (found by their pixels in the
    training set). On ``hold_rank`` of a world of ``hold_world``, after step ``hold_step``, it writes
    ``<folder>/held`` and waits (at most ``hold_s``) for the test to stop its node and write
    ``<folder>/release``."""

    def __init__(self, folder: str, hold_step: int, hold_rank: int = 1, hold_s: float = 90.0, hold_world: int = 2) -> None:
        self.folder, self.hold_step, self.hold_rank, self.hold_s = Path(folder), hold_step, hold_rank, hold_s
        self.hold_world = hold_world

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dataset = trainer.datamodule.train_set
        self.images = dataset.render(range(len(dataset))).flatten(1)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        nearest = torch.cdist(batch[0].detach().flatten(1).float(), self.images).topk(2, largest=False)
        self.record = {
            "attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "step": trainer.global_step,
            "epoch": trainer.current_epoch, "rank": trainer.global_rank, "world": trainer.world_size,
            "node": os.environ.get("FASTSCALE_EMULATED_NODE"), "ids": nearest.indices[:, 0].tolist(),
            # how much nearer the sample found is than the next one (0: the same pixels)
            "ambiguity": (nearest.values[:, 0] / nearest.values[:, 1]).max().item(),
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "samples.jsonl", "a") as f:
            f.write(json.dumps(self.record) + "\n")
        if (trainer.world_size, trainer.global_rank, trainer.global_step) == (self.hold_world, self.hold_rank, self.hold_step):
            (self.folder / "held").write_text(str(os.getpid()))
            deadline = time.monotonic() + self.hold_s
            while not (self.folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def torchrun(cluster: EmulatedCluster, node: int, run_dir: Path, *hold: str) -> list[str]:
    """One node's launch: c10d rendezvous hosted by node 0's agent, short keep-alive and last call
    (a dead node is dropped after 3 s, a round closes 5 s after its first node joined)."""
    host = cluster.nodes[0].address
    conf = f"is_host={int(node == 0)},last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60"
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1", "--max_restarts=3",
        "--rdzv_backend=c10d", f"--rdzv_endpoint={host}:29400", "--rdzv_id=elastic-test", f"--rdzv_conf={conf}",
        f"--local_addr={cluster.nodes[node].address}", "--monitor_interval=0.2",
        "-m", "lightning_fastscale.train", *RUN, f"hydra.run.dir={run_dir}",
        "+callbacks.sample_log._target_=tests.test_faults_elastic_launch.SampleLog",
        f"+callbacks.sample_log.folder={run_dir / 'log'}", *(hold or [f"+callbacks.sample_log.hold_step={LOST_AFTER}"]),
    ]


@pytest.mark.parametrize("trainer", ["default", "cpu", "gpu"])
@pytest.mark.parametrize(("env", "overrides", "expected"), [
    ({}, [], 1),  # no torchrun: one node
    ({"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run"}, [], 2),  # torchrun's nodes in this round
    ({"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run"}, ["trainer.num_nodes=3"], 3),  # the user's value wins
])
def test_num_nodes_follows_torchrun_by_default(monkeypatch, trainer, env, overrides, expected) -> None:
    for key in ("GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_fastscale.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"trainer={trainer}", *overrides])
    assert cfg.trainer.num_nodes == expected


def wait_for(condition, timeout: float, what: str, outputs: dict) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- node {n} ---\n{o[-3000:]}" for n, o in outputs.items())
            raise AssertionError(f"{what} not within {timeout} s\n{tails}")
        time.sleep(0.1)


def skip_without_namespaces() -> None:
    try:
        check_namespace_support()
    except NamespaceUnavailable as err:
        pytest.skip(f"emulated cluster unavailable: {err}")


def start_node(cluster: EmulatedCluster, node: int, run_dir: Path, outputs: dict[int, str], *hold: str):
    """Start ``node``'s torchrun; what it prints is gathered into ``outputs[node]``. The environment
    is the documented command's: a rendezvous store per round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``;
    with torch 2.14's shared one the agent that ran alone never publishes the store of the round a
    node joins), and no ``HYDRA_FULL_ERROR``, so workers end as a user's do: one line and the status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = cluster.start(node, torchrun(cluster, node, run_dir, *hold), env=env, cwd=str(run_dir.parent))

    def drain(stream) -> None:
        for line in stream:
            outputs[node] += line

    for stream in (proc.stdout, proc.stderr):
        threading.Thread(target=drain, args=(stream,), daemon=True).start()
    return proc


@pytest.mark.slow  # about 30 s each: two torchrun agents, three Lightning worker starts
@pytest.mark.timeout(180)
@pytest.mark.parametrize("leave", ["lost", "graceful"])
def test_torchrun_elastic_continues_on_the_remaining_node_with_every_sample_once(tmp_path: Path, leave: str) -> None:
    skip_without_namespaces()
    run_dir = tmp_path / "run"
    outputs: dict[int, str] = {0: "", 1: ""}
    try:
        with EmulatedCluster(2) as cluster:  # every process and namespace removed on exit, also on failure
            procs = [start_node(cluster, n, run_dir, outputs) for n in (0, 1)]
            held = run_dir / "log" / "held"
            wait_for(lambda: held.exists() or any(p.poll() is not None for p in procs), 90, "step 11 on 2 nodes", outputs)
            assert held.exists(), f"a node ended before it left: {[p.returncode for p in procs]}"
            if leave == "lost":
                assert procs[1].pid in cluster.kill_node(1)  # the agent and its worker: nothing runs on
            else:
                procs[1].send_signal(signal.SIGTERM)  # its agent passes it on to its worker
                time.sleep(1.0)
                (run_dir / "log" / "release").touch()
            wait_for(lambda: procs[0].poll() is not None, 120, "node 0 finishing alone", outputs)
            procs[1].wait(timeout=10)
    finally:  # what each node printed, for a failure's diagnosis
        for n, text in outputs.items():
            (tmp_path / f"node{n}.out").write_text(text)
    assert procs[0].returncode == 0, outputs[0][-6000:]

    records = [json.loads(line) for line in (run_dir / "log" / "samples.jsonl").read_text().splitlines()]
    assert max(r["ambiguity"] for r in records) < 0.1  # each image is one training sample, up to rounding
    first = [r for r in records if r["attempt"] == 0]
    later = [r for r in records if r["attempt"] > 0]
    assert {(r["rank"], r["node"], r["world"]) for r in first} == {(0, "0", 2), (1, "1", 2)}
    assert {(r["rank"], r["node"], r["world"]) for r in later} == {(0, "0", 1)}
    resumed_at = min(r["step"] for r in later)
    if leave == "lost":
        # node 0's worker saw its peer vanish: a fault (76, retryable), so its agent restarted it,
        # and the new worker resumed from the last periodic checkpoint, mid-epoch
        assert max(r["step"] for r in first) == LOST_AFTER - 1
        assert resumed_at == RESUMED_AT and RESUMED_AT % STEPS_PER_EPOCH
        assert "error [exit 76: fault, retryable]" in outputs[0] and "exitcode: 76" in outputs[0]
        checkpoint = f"step{RESUMED_AT:07d}.ckpt"
    else:
        # both ranks stopped after the same step, one checkpoint, exit 75 (preempted, retryable):
        # node 0's agent restarted its worker, which lost no step
        assert max(r["step"] for r in first) == resumed_at - 1 and resumed_at % STEPS_PER_EPOCH
        assert resumed_at >= LOST_AFTER
        assert "exitcode: 75" in outputs[0] and "exitcode: 76" not in outputs[0]
        checkpoint = f"preempted-epoch1-step{resumed_at}.ckpt"
    assert f"resume=auto: continuing from {run_dir / 'checkpoints' / checkpoint}" in outputs[0]
    assert "written by 2 processes, this run has 1" in outputs[0]

    def by_step(rs):
        steps: dict[int, list[int]] = {}
        for r in rs:
            steps.setdefault(r["step"], []).extend(r["ids"])
        return {s: sorted(ids) for s, ids in steps.items()}

    kept, resumed = by_step(r for r in first if r["step"] < resumed_at), by_step(later)
    assert sorted(kept) == list(range(resumed_at)) and sorted(resumed) == list(range(resumed_at, EPOCHS * STEPS_PER_EPOCH))
    assert all(len(ids) == GLOBAL_BATCH for ids in [*kept.values(), *resumed.values()])
    lineage = {**kept, **resumed}
    for epoch in range(EPOCHS):
        seen = [i for s in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH) for i in lineage[s]]
        assert sorted(seen) == list(range(SIZE)), f"epoch {epoch}"
    # the lost steps were redone on the same samples: the order does not depend on the world size
    lost = by_step(r for r in first if r["step"] >= resumed_at)
    assert bool(lost) == (leave == "lost") and all(lost[s] == resumed[s] for s in lost)


JOIN_AFTER = 5  # node 1 joins while node 0, alone, holds after step 5 (epoch 0 of 16 steps of 16 samples)


@pytest.mark.slow  # about 30 s: two torchrun agents, three Lightning worker starts
@pytest.mark.timeout(180)
def test_torchrun_elastic_node_join_continues_on_two_nodes_with_the_same_global_batch(tmp_path: Path) -> None:
    """``--nnodes=1:2``: node 0 starts alone (global batch 16 = 16 per device); node 1 joins mid-epoch,
    node 0's agent stops its worker (SIGTERM: a preemption checkpoint), and both nodes' workers resume
    from it as 8 per device x 2 ranks: no step lost or redone, every sample of each epoch once."""
    skip_without_namespaces()
    run_dir = tmp_path / "run"
    outputs: dict[int, str] = {0: "", 1: ""}
    hold = [f"+callbacks.sample_log.hold_step={JOIN_AFTER}", "+callbacks.sample_log.hold_rank=0",
            "+callbacks.sample_log.hold_world=1"]
    try:
        with EmulatedCluster(2) as cluster:  # every process and namespace removed on exit, also on failure
            first = start_node(cluster, 0, run_dir, outputs, *hold)
            held = run_dir / "log" / "held"
            wait_for(lambda: held.exists() or first.poll() is not None, 90, f"step {JOIN_AFTER} on node 0 alone", outputs)
            assert held.exists(), f"node 0 ended before node 1 joined: {first.returncode}"
            second = start_node(cluster, 1, run_dir, outputs, *hold)
            # node 0's agent sees a node waiting and stops its worker with SIGTERM, which is still held
            wait_for(lambda: "closing signal SIGTERM" in outputs[0], 60, "node 0's agent stopping its worker", outputs)
            (run_dir / "log" / "release").touch()
            wait_for(lambda: first.poll() is not None and second.poll() is not None, 120, "both nodes finishing", outputs)
    finally:  # what each node printed, for a failure's diagnosis
        for n, text in outputs.items():
            (tmp_path / f"node{n}.out").write_text(text)
    assert first.returncode == 0 and second.returncode == 0, outputs[0][-6000:] + outputs[1][-3000:]

    records = [json.loads(line) for line in (run_dir / "log" / "samples.jsonl").read_text().splitlines()]
    assert max(r["ambiguity"] for r in records) < 0.1
    before = [r for r in records if r["world"] == 1]
    after = [r for r in records if r["world"] == 2]
    assert {(r["rank"], r["node"], r["attempt"]) for r in before} == {(0, "0", 0)}
    assert {(r["rank"], r["node"]) for r in after} == {(0, "0"), (1, "1")}
    resumed_at = min(r["step"] for r in after)
    # the SIGTERM reached the worker while it held after its 5th step: it stopped there with one
    # preemption checkpoint, and nothing is redone
    assert max(r["step"] for r in before) == resumed_at - 1 and resumed_at == JOIN_AFTER
    assert f"resume=auto: continuing from {run_dir / 'checkpoints'}" in outputs[0]
    assert f"preempted-epoch0-step{resumed_at}.ckpt" in outputs[0]

    def by_step(rs):
        steps: dict[int, list[int]] = {}
        for r in rs:
            steps.setdefault(r["step"], []).extend(r["ids"])
        return {s: sorted(ids) for s, ids in steps.items()}

    batch, steps_per_epoch = GLOBAL_BATCH // 2, SIZE // (GLOBAL_BATCH // 2)
    lineage = {**by_step(before), **by_step(after)}
    assert sorted(lineage) == list(range(EPOCHS * steps_per_epoch))
    assert all(len(ids) == batch for ids in lineage.values())  # the global batch of the first node, kept on two
    assert all(len(r["ids"]) == batch // 2 for r in after)  # as 8 per device on 2 ranks
    for epoch in range(EPOCHS):
        seen = [i for s in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch) for i in lineage[s]]
        assert sorted(seen) == list(range(SIZE)), f"epoch {epoch}"
