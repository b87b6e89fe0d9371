"""Faults table: each fault, what happened, seconds to exit, and whether anything was lost.

Every row is a real ``fastscale-train`` run on 2 CPU processes (gloo) with the large-batch
recipe (batch-size ramp, warmup + poly LR, progressive resizing, label smoothing), started as
a user would (Lightning's own launcher, or ``torchrun``), against an uninterrupted run of the
same job measured in the same invocation:

- SIGTERM to one rank (a spot notice reaching one node), with ``PreemptionCheckpoint``;
- SIGTERM to ``torchrun`` (its shutdown forwards SIGTERM to every worker);
- the same SIGTERM with Lightning alone (``callbacks.preemption=null``), the baseline;
- a truncated checkpoint (the newest file cut in half) under ``resume=auto``;
- a rank killed / hung and an overflow storm, when the fault scenarios of
  ``lightning_fastscale.emulation.faults`` and a non-finite-step guard are present (otherwise
  the row says it was not run).

"Seconds to exit" runs from the signal (written by the test callback that sends it) to the
exit of the launched process. "Steps redone" is counted from a per-step log: steps run by the
interrupted and the resumed run together, minus the uninterrupted run's steps.

    flock /tmp/cpu.lock nice -n 5 python benchmarks/faults.py [--out DIR]

Results and the machine are in benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RUN = [
    "data.train_size=256", "data.val_size=32", "data.batch_size=32", "data.resolution=16",
    "model.kwargs.widths=[8,8,8]", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false", "trainer.log_every_n_steps=1", "callbacks=large_batch",
    "callbacks.throughput=null", "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.batch_size_ramp.lr_milestones=[1]",
    "callbacks.progressive_resizing.size_increment=2", "trainer.devices=2",
    "trainer.accelerator=cpu", "strategy=ddp", "logger=csv",
]
SIGNAL_STEP = 9  # epoch 1 (after the ramp doubled the batch), its second of four steps
TOTAL_STEPS = 12


@dataclass
class Row:
    fault: str
    happened: str
    seconds_to_exit: str
    lost: str


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_API_KEY", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, *extra: str, torchrun: bool = False) -> subprocess.Popen:
    steps = [f"+callbacks.step_log._target_=tests.faults_helpers.StepLog", f"+callbacks.step_log.folder={run_dir}/steps"]
    train = ["-m", "lightning_fastscale.train", *RUN, f"hydra.run.dir={run_dir}", *steps, *extra]
    if torchrun:
        launcher = ["-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}"]
        cmd = [sys.executable, *launcher, *train]
    else:
        cmd = [sys.executable, *train]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=run_dir.parent, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str, float]:
    """(exit code or None if killed at the time-out, output, wall time of the exit)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.time()
    except subprocess.TimeoutExpired:
        ended = time.time()
        os.killpg(proc.pid, signal.SIGKILL)  # this run's process group only
        out, _ = proc.communicate()
        return None, out, ended


def steps_run(run_dir: Path) -> int:
    log = run_dir / "steps" / "rank0.steps"
    return len(log.read_text().split()) if log.is_file() else 0


def same_weights(a: Path, b: Path) -> bool:
    import torch

    sa = torch.load(a, map_location="cpu", weights_only=True)["state_dict"]
    sb = torch.load(b, map_location="cpu", weights_only=True)["state_dict"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def preempt(root: Path, name: str, reference: Path, *, torchrun: bool, with_callback: bool) -> Row:
    run_dir = root / name
    stamp = root / f"{name}.signal"
    sender = [
        "+callbacks.preempt_test._target_=tests.faults_helpers.SignalAtStep",
        f"+callbacks.preempt_test.step={SIGNAL_STEP}", f"+callbacks.preempt_test.stamp={stamp}",
        # torchrun: rank 0 signals the agent; otherwise rank 1 signals itself (one node's notice)
        f"+callbacks.preempt_test.rank={0 if torchrun else 1}",
        f"+callbacks.preempt_test.target={'parent' if torchrun else 'self'}",
    ]
    extra = sender + ([] if with_callback else ["callbacks.preemption=null"])
    code, out, ended = wait(launch(run_dir, *extra, torchrun=torchrun), timeout=300 if with_callback else 150)
    seconds = f"{ended - float(stamp.read_text()):.1f}" if stamp.is_file() else "-"
    if code is None:
        return Row(name, "still running at the time-out; killed", seconds, "everything since the last checkpoint")
    from lightning_fastscale import checkpointing

    before = steps_run(run_dir)
    newest = checkpointing.newest_checkpoint([run_dir / "checkpoints"])
    try:
        saved_step = checkpointing.read_checkpoint(newest)["global_step"] if newest else 0
        intact = "intact"
    except checkpointing.CheckpointError:
        saved_step, intact = 0, "UNREADABLE"
    happened = f"exit {code}, newest checkpoint {newest.name if newest else 'none'} ({intact}, step {saved_step})"
    if not with_callback:
        lost = f"{before - saved_step} steps done after the newest checkpoint would be redone"
        return Row(name, happened, seconds, lost)
    rcode, rout, _ = wait(launch(run_dir, "resume=auto"), timeout=300)
    if rcode != 0:
        return Row(name, happened + f"; resume=auto FAILED (exit {rcode})", seconds, rout[-300:])
    redone = steps_run(run_dir) - TOTAL_STEPS
    equal = same_weights(reference, run_dir / "checkpoints" / "last.ckpt")
    lost = f"{redone} steps redone; final weights {'bitwise equal to' if equal else 'DIFFER from'} the uninterrupted run"
    return Row(name, happened + "; resume=auto finished", seconds, lost)


def truncated(root: Path, source: Path) -> Row:
    run_dir = root / "truncated"
    shutil.copytree(source / "checkpoints", run_dir / "checkpoints")
    newest = max((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    start = time.time()
    code, out, ended = wait(launch(run_dir, "resume=auto"), timeout=300)
    named = str(newest) in out
    happened = f"exit {code}, error {'names the file' if named else 'does NOT name the file'}" + (
        " and says truncated" if "truncated" in out else "")
    return Row("truncated newest checkpoint, resume=auto", happened, f"{ended - start:.1f} (from start)",
               f"{steps_run(run_dir)} steps run; the file is left as it was ({newest.stat().st_size} bytes)")


def not_run(fault: str, why: str) -> Row:
    return Row(fault, f"not run: {why}", "-", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="faults-"))
    started = time.time()
    code, out, _ = wait(launch(root / "uninterrupted"), timeout=300)
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {code}):\n{out[-3000:]}")
    reference = root / "uninterrupted" / "checkpoints" / "last.ckpt"
    rows = [
        preempt(root, "SIGTERM to rank 1 (PreemptionCheckpoint)", reference, torchrun=False, with_callback=True),
        preempt(root, "SIGTERM to torchrun (PreemptionCheckpoint)", reference, torchrun=True, with_callback=True),
        preempt(root, "SIGTERM to rank 1, Lightning alone", reference, torchrun=False, with_callback=False),
    ]
    rows.append(truncated(root, root / "SIGTERM to rank 1 (PreemptionCheckpoint)"))
    try:
        import lightning_fastscale.emulation.faults  # noqa: F401
        rows.append(not_run("rank killed / rank hung", "lightning_fastscale.emulation.faults exists but is not wired into this table yet"))
    except ImportError:
        rows.append(not_run("rank killed / rank hung", "lightning_fastscale.emulation.faults is not on this branch"))
    rows.append(not_run("overflow storm", "no non-finite-step guard on this branch"))
    print("| fault | what happened | seconds to exit | lost |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row.fault} | {row.happened} | {row.seconds_to_exit} | {row.lost} |")
    print(f"\n{len(rows)} rows in {time.time() - started:.0f} s; runs in {root}")


if __name__ == "__main__":
    main()
