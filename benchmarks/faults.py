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

``--only-storage`` runs the rows of a smaller 1-process job (8 steps, default callbacks and
cosine schedule), with the run folder on its own 4 MiB tmpfs (root only) and ``TMPDIR`` on
another filesystem: a rank killed while it writes a checkpoint, the disk full during a write,
the newest checkpoint truncated, two runs started together on one folder, and
``optimizer.lr=1e6`` under fp32 (divergence).

"Seconds to exit" runs from the signal (written by the test callback that sends it) to the
exit of the launched process. "Steps redone" is counted from a per-step log: steps run by the
interrupted and the resumed run together, minus the uninterrupted run's steps.

    flock /tmp/cpu.lock nice -n 5 python benchmarks/faults.py [--out DIR] [--only-preemption | --only-comm | --only-storage]

Results and the machine are in benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import results_file  # noqa: E402
from benchmarks.fault_helpers import RECIPE_RUN  # noqa: E402  (the job the fault tests run)
from lightning_fastscale.emulation.faults import free_port  # noqa: E402

RUN = RECIPE_RUN
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


def launch(run_dir: Path, *extra: str, torchrun: bool = False, run: list[str] | None = None,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    steps = ["+callbacks.step_log._target_=benchmarks.fault_helpers.StepLog", f"+callbacks.step_log.folder={run_dir}/steps"]
    train = ["-m", "lightning_fastscale.train", *(RUN if run is None else run), f"hydra.run.dir={run_dir}", *steps, *extra]
    if torchrun:
        launcher = ["-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
        cmd = [sys.executable, *launcher, *train]
    else:
        cmd = [sys.executable, *train]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=run_dir.parent, env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
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


def preempt(root: Path, name: str, folder: str, reference: Path, *, torchrun: bool, with_callback: bool) -> Row:
    run_dir = root / folder
    stamp = root / f"{folder}.signal"
    sender = [
        "+callbacks.preempt_test._target_=benchmarks.fault_helpers.SignalAtStep",
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
    from lightning_fastscale.faults import checkpoint_reading

    before = steps_run(run_dir)
    newest = checkpoint_reading.newest_checkpoint([run_dir / "checkpoints"])
    try:
        saved_step = checkpoint_reading.read_checkpoint(newest)["global_step"] if newest else 0
        intact = "intact"
    except checkpoint_reading.CheckpointError:
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


def truncated(root: Path, source: Path, run: list[str] | None = None) -> Row:
    run_dir = root / f"truncated-{source.name}"  # one folder per job: the full run truncates two
    shutil.copytree(source / "checkpoints", run_dir / "checkpoints")
    newest = max((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    start = time.time()
    code, out, ended = wait(launch(run_dir, "resume=auto", run=run), timeout=300)
    named = f"skipping {newest}" in out
    resumed = next((line.split("continuing from ", 1)[1].strip() for line in out.splitlines() if "continuing from" in line), None)
    happened = f"exit {code}; {'a warning names the file' if named else 'the file is NOT named'}" + (
        " and says truncated" if "truncated" in out else "") + (
        f"; continued from {Path(resumed).name}" if resumed else "; did not resume")
    job = "2-process recipe run" if run is None else "1-process job"
    return Row(f"newest checkpoint truncated to half, `resume=auto` ({job})", happened, f"{ended - start:.1f} (from start)",
               f"{steps_run(run_dir)} steps run after the resume; the truncated file is left as it was "
               f"({newest.stat().st_size} bytes)")


def comm_rows(root: Path) -> list[Row]:
    """A rank killed / hung mid-backward under hier_ring (4 ranks as 2x2), via the strategy's scenarios."""
    try:
        from lightning_fastscale.emulation.faults import run_fault_scenario
    except ImportError:
        return [not_run("rank killed / rank hung", "lightning_fastscale.emulation.faults is not on this branch")]
    rows = []
    for fault in ("kill", "hang"):
        (root / f"comm-{fault}").mkdir(parents=True, exist_ok=True)
        outcome = run_fault_scenario(strategy="hier_ring", fault=fault, timeout_s=5.0, workdir=root / f"comm-{fault}")
        causes = {text.splitlines()[0][:90] for text in outcome.rank_errors.values() if text}
        happened = (f"all ranks exited, codes {sorted(outcome.exit_codes.values())}" if outcome.exited
                    else "NOT all ranks exited within the bound") + (f"; error: {sorted(causes)[0]}" if causes else "")
        seconds = f"{outcome.seconds_to_exit:.1f}" if outcome.seconds_to_exit is not None else "-"
        rows.append(Row(f"rank {outcome.fault_rank} {'killed' if fault == 'kill' else 'hung'} mid-backward, hier_ring 2x2, time-out 5 s", happened,
                        seconds, "no checkpoint is written; resume from the last one"))
    return rows


# the storage rows' job: 1 process, default callbacks and cosine schedule, 64 samples / 16 = 4 steps per epoch
SMALL_RUN = [
    "data.train_size=64", "data.val_size=16", "data.batch_size=16", "data.resolution=16",
    "model.model_kwargs.widths=[8,8,8]", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1", "trainer.accelerator=cpu", "logger=csv",
]


def _checkpoint_state(folder: Path, tmpdir: Path) -> str:
    """Which checkpoint files are whole, partial leftovers beside them, and leaks into TMPDIR."""
    from lightning_fastscale.faults import checkpoint_reading
    from lightning_fastscale.faults.atomic_checkpoint_io import partial_files

    whole, broken = [], []
    for path in sorted(folder.glob("*.ckpt")):
        try:
            whole.append(f"{path.name} (step {checkpoint_reading.read_checkpoint(path)['global_step']})")
        except checkpoint_reading.CheckpointError:
            broken.append(path.name)
    leaked = [p for p in tmpdir.rglob("*") if p.is_file() and p.stat().st_size > 10_000]
    return (f"whole: {', '.join(whole) or 'none'}; truncated under a final name: {', '.join(broken) or 'none'}; "
            f"temporary files beside them: {len(partial_files([folder]))}; checkpoint-sized files in TMPDIR: {len(leaked)}")


def _resume_text(code: int | None, out: str) -> str:
    resumed = next((line.split("continuing from ", 1)[1].strip() for line in out.splitlines() if "continuing from" in line), None)
    return f"`resume=auto`: exit {code}" + (f", continued from {Path(resumed).name}" if resumed else ", did not resume")


def storage_rows(root: Path) -> list[Row]:
    """Checkpoint writes cut short, a shared run folder, divergence: the 1-process job."""
    rows: list[Row] = []
    tmpdir = root / "tmpdir"
    tmpdir.mkdir(parents=True, exist_ok=True)
    env = {"TMPDIR": str(tmpdir)}
    for name, fault in (("rank killed (SIGXFSZ) while writing the epoch-1 checkpoint", "kill"),
                        ("disk full while writing the epoch-1 checkpoint", "fill")):
        mount = root / f"fs-{fault}"
        mount.mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
        if mounted.returncode != 0:
            rows.append(not_run(name, f"cannot mount a tmpfs ({mounted.stderr.strip()}); needs root"))
            continue
        try:
            run_dir, filler = mount / "run", mount / "filler"
            extra = (["+callbacks.kill._target_=benchmarks.fault_helpers.KillDuringSave", "+callbacks.kill.step=8"]
                     if fault == "kill" else
                     ["+callbacks.fill._target_=benchmarks.fault_helpers.FillDiskAtStep", "+callbacks.fill.step=8",
                      f"+callbacks.fill.path={filler}"])
            start = time.time()
            code, out, ended = wait(launch(run_dir, *extra, run=SMALL_RUN, env=env), timeout=300)
            happened = f"exit {code}; {_checkpoint_state(run_dir / 'checkpoints', tmpdir)}"
            filler.unlink(missing_ok=True)
            rcode, rout, _ = wait(launch(run_dir, "resume=auto", run=SMALL_RUN, env=env), timeout=300)
            from lightning_fastscale.faults import checkpoint_reading

            final = checkpoint_reading.read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"]
            rows.append(Row(f"{name}, run folder on a 4 MiB tmpfs", happened, f"{ended - start:.1f} (from start)",
                            f"{_resume_text(rcode, rout)}, ended at step {final} of 8; "
                            f"{steps_run(run_dir) - 8} steps redone"))
        finally:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    source = root / "small"
    code, out, _ = wait(launch(source, run=SMALL_RUN), timeout=300)
    rows.append(truncated(root, source, run=SMALL_RUN) if code == 0 else not_run("truncated checkpoint", f"the reference run failed (exit {code})"))

    shared = root / "shared"
    procs = [launch(shared, f"seed={seed}", run=SMALL_RUN) for seed in (1, 2)]
    results = [wait(proc, timeout=300) for proc in procs]
    codes = [r[0] for r in results]
    refused = next((line.strip() for r in results for line in r[1].splitlines() if "is in use by" in line), "no refusal")
    rows.append(Row("two runs started together on one `hydra.run.dir`", f"exit codes {sorted(codes, key=str)}; {refused}",
                    "-", "nothing: the refused run wrote nothing into the folder"))

    start = time.time()
    code, out, ended = wait(launch(root / "diverged", "optimizer.lr=1e6", run=SMALL_RUN), timeout=300)
    stop = next((line.split("NonFiniteGuard: ", 1)[1][:60] for line in out.splitlines() if "NonFiniteGuard: " in line), "no stop")
    state = _checkpoint_state(root / "diverged" / "checkpoints", tmpdir).split(";")[0]
    rows.append(Row("`optimizer.lr=1e6` under fp32 (diverges)", f"exit {code}; stopped at: {stop}...; "
                    f"final accuracy printed: {'yes' if 'final val/top1' in out else 'no'}; checkpoints {state}",
                    f"{ended - start:.1f} (from start)", "the run, as it should: nothing after the divergence is kept"))
    return rows


def not_run(fault: str, why: str) -> Row:
    return Row(fault, f"not run: {why}", "-", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--only-preemption", action="store_true",
                        help="only the 2-process rows: SIGTERM to a rank / torchrun / Lightning alone, truncated checkpoint")
    parser.add_argument("--only-comm", action="store_true", help="only the rank killed / hung rows")
    parser.add_argument("--only-storage", action="store_true",
                        help="only the 1-process rows: kill during save, disk full, truncated, shared folder, divergence")
    results_file.add_option(parser, "faults")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="faults-"))
    started = time.time()
    if args.only_comm:
        print_table(comm_rows(root), started, root, args.results)
        return
    if args.only_storage:
        print_table(storage_rows(root), started, root, args.results)
        return
    if args.only_preemption:
        print_table(preemption_rows(root), started, root, args.results)
        return
    print_table(preemption_rows(root) + comm_rows(root) + storage_rows(root), started, root, args.results)


def preemption_rows(root: Path) -> list[Row]:
    """The uninterrupted 2-process recipe run, then SIGTERM to one rank / torchrun / Lightning alone, and a truncated checkpoint."""
    code, out, _ = wait(launch(root / "uninterrupted"), timeout=300)
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {code}):\n{out[-3000:]}")
    reference = root / "uninterrupted" / "checkpoints" / "last.ckpt"
    return [
        preempt(root, "SIGTERM to rank 1 only (`PreemptionCheckpoint`)", "rank1", reference, torchrun=False,
                with_callback=True),
        preempt(root, "SIGTERM to `torchrun` (`PreemptionCheckpoint`)", "torchrun", reference, torchrun=True,
                with_callback=True),
        preempt(root, "SIGTERM to rank 1 only, Lightning alone (`callbacks.preemption=null`)", "lightning", reference,
                torchrun=False, with_callback=False),
        truncated(root, root / "rank1"),
    ]


def print_table(rows: list[Row], started: float, root: Path, results: str) -> None:
    table = ["| fault | what happened | seconds to exit | lost |", "|---|---|---|---|"]
    table += [f"| {row.fault} | {row.happened} | {row.seconds_to_exit} | {row.lost} |" for row in rows]
    print("\n".join(table) + f"\n\n{len(rows)} rows in {time.time() - started:.0f} s; runs in {root}")
    results_file.write(results, [vars(row) for row in rows], [table])


if __name__ == "__main__":
    main()
