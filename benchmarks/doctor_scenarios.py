"""``fastscale-doctor --verify`` on four injected bottlenecks: its verdicts and the measured speed-ups.

Each scenario is the doctor's console entry point on the package's Hydra config with
``data=injected`` (``tests/conf/data/injected.yaml``: random in-memory images, optionally slowed):

- ``input``: one rank, a linear classifier, 4 ms of sleep per sample at 0 loader workers;
- ``straggler``: two ranks under Lightning's own launcher, rank 1 sleeps 150 ms per batch;
- ``compute``: one rank, ``resnet_small`` on fast in-memory data;
- ``communication``: two emulated nodes (network namespaces, torchrun on each, needs root)
  joined by a capped link, a linear classifier on 96 px images (1.1 MB of gradient).

Prints one row per scenario: the verdict, the first fix, its predicted speed-up and the one
``--verify`` measured against the baseline run in the same job. Example::

    python benchmarks/doctor_scenarios.py --cap 10
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import results_file

REPO = Path(__file__).resolve().parents[1]
DOCTOR = [sys.executable, "-m", "lightning_fastscale.diagnostics.doctor_cli"]
COMMON = [
    f"hydra.searchpath=[file://{REPO}/tests/conf]", "data=injected", "trainer.accelerator=cpu",
    "doctor.warmup_steps=3", "doctor.steps=10", "doctor.compute_steps=3", "doctor.loader_batches=4",
    "doctor.verify_warmup_steps=3", "doctor.verify_steps=10", "doctor.verify_rounds=2", "--verify", "--json",
]
SCENARIOS = {
    "input": ["model=linear", "data.resolution=8", "data.sample_delay_s=0.004"],
    "straggler": ["model=linear", "data.resolution=8", "trainer.devices=2", "strategy=ddp", "data.slow_rank=1",
                  "data.rank_delay_s=0.15"],
    "compute": ["model=resnet_small", "data.batch_size=32"],
    "communication": ["model=linear", "data.resolution=96", "data.batch_size=8", "trainer.num_nodes=2",
                      "trainer.devices=1", "strategy=ddp"],
}


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _report(stderr: str) -> str:
    """The doctor's console report out of a run's stderr (with --json it goes there)."""
    start = stderr.rfind("fastscale-doctor: ")
    end = stderr.find("\nwritten: ", start)
    return stderr[start:end].rstrip() if start >= 0 else ""


def run_local(name: str, tmp: Path, timeout: float) -> tuple[dict, str]:
    """One scenario in local processes; the doctor's JSON document and report."""
    run_dir = tmp / name
    proc = subprocess.run([*DOCTOR, *COMMON, f"hydra.run.dir={run_dir}", *SCENARIOS[name]], capture_output=True,
                          text=True, env=_env(), cwd=tmp, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"scenario {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), _report(proc.stderr)


def run_cluster(tmp: Path, cap: float, timeout: float) -> tuple[dict, str]:
    """The communication scenario on two emulated nodes; node 0's JSON document and report."""
    from lightning_fastscale.emulation import EmulatedCluster

    with EmulatedCluster(2, bandwidth_mbit=cap) as cluster:
        master = cluster.nodes[0].address
        commands = [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
             "--nproc_per_node", "1", "--master_addr", master, "--master_port", "29500",
             "-m", "lightning_fastscale.diagnostics.doctor_cli", *COMMON,
             f"hydra.run.dir={tmp / f'communication-node{i}'}", *SCENARIOS["communication"]]
            for i in range(2)
        ]
        results = cluster.run(commands, timeout=timeout, env=_env(), cwd=str(tmp))
    for r in results:
        if r.returncode != 0:
            raise RuntimeError(f"communication scenario failed on node {r.node}:\n{(r.stderr or '')[-3000:]}")
    return json.loads((tmp / "communication-node0" / "doctor.json").read_text()), _report(results[0].stderr or "")


def main() -> None:
    """Run the scenarios and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--cap", type=float, default=10.0, help="emulated inter-node link, Mbit/s")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per scenario")
    parser.add_argument("--save", type=Path, default=None, help="folder for each scenario's report and doctor.json")
    results_file.add_option(parser, "doctor_scenarios")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastscale-doctor-") as tmp:
        for name in args.scenarios:
            doc, report = run_cluster(Path(tmp), args.cap, args.timeout) if name == "communication" else \
                run_local(name, Path(tmp), args.timeout)
            rows.append((name, doc))
            if args.save is not None:
                args.save.mkdir(parents=True, exist_ok=True)
                (args.save / f"{name}.txt").write_text(report + "\n")
                (args.save / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs (gloo); emulated link {args.cap:g} Mbit/s; "
          "--verify: 2 rounds of 10 timed steps, baseline and fix interleaved")
    table = ["| injected | verdict | step ms | first fix | predicted | measured |", "|---|---|---:|---|---:|---:|"]
    for name, doc in rows:
        fix = doc["fixes"][0] if doc["fixes"] else None
        what = "-" if fix is None else (" ".join(fix["overrides"]) or
                                        f"(none: rank {doc['straggler_rank']} named)")
        predicted = "-" if fix is None else f"{fix['predicted_speedup']:.2f}x"
        measured = "-" if fix is None or fix["measured_speedup"] is None else f"{fix['measured_speedup']:.2f}x"
        table.append(f"| {name} | {doc['bottleneck']} | {doc['step_s'] * 1e3:.1f} | {what} | {predicted} | {measured} |")
    print("\n".join(table))
    results_file.write(args.results, dict(rows), [table])


if __name__ == "__main__":
    main()
