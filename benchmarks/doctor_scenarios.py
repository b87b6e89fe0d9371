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

``--stability N`` instead runs the doctor (no ``--verify``) N times on each job of `STABLE`
(an input-bound and a compute-bound one, both with real compute and a real input wait), with
the torch thread count a user gets; ``--neighbour`` keeps one core busy with a spinning process
(started before and killed after, by its pid) during those runs. Each (job, condition) is stored
in ``--out`` (merged into the JSON there) with how many runs gave the right verdict, "too close
to call" or the wrong one, and the spread of the measured times; ``--table`` prints them::

    python benchmarks/doctor_scenarios.py --stability 5 --jobs input --neighbour
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file

REPO = Path(__file__).resolve().parents[1]
DOCTOR = [sys.executable, "-m", "lightning_fastscale.diagnostics.doctor_cli"]
MEASURE = [
    f"hydra.searchpath=[file://{REPO}/tests/conf]", "data=injected", "trainer.accelerator=cpu",
    "doctor.warmup_steps=3", "doctor.steps=10", "doctor.compute_steps=3", "doctor.loader_batches=4", "--json",
]
COMMON = [*MEASURE, "doctor.verify_warmup_steps=3", "doctor.verify_steps=10", "doctor.verify_rounds=2", "--verify"]
SCENARIOS = {
    "input": ["model=linear", "data.resolution=8", "data.sample_delay_s=0.004"],
    "straggler": ["model=linear", "data.resolution=8", "trainer.devices=2", "strategy=ddp", "data.slow_rank=1",
                  "data.rank_delay_s=0.15"],
    "compute": ["model=resnet_small", "data.batch_size=32"],
    "communication": ["model=linear", "data.resolution=96", "data.batch_size=8", "trainer.num_nodes=2",
                      "trainer.devices=1", "strategy=ddp"],
}


# The stability jobs: overrides and the right verdict. Both have real compute (a small ResNet)
# and a real input wait (a sleep per sample at 0 workers), so load on the cores can move one
# against the other; the doctor's own settings are its defaults.
STABLE = {
    "input": (["model=resnet_small", "data.batch_size=32", "data.sample_delay_s=0.003"], "input"),
    "compute": (["model=resnet_small", "data.batch_size=32", "data.sample_delay_s=0.0005"], "compute"),
}
STABLE_MEASURE = [*MEASURE[:3], "--json"]


def _env(threads: bool = True) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if not threads:  # torch's default thread count, as a user's job gets it
        env.pop("OMP_NUM_THREADS")
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


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def stability(job: str, runs: int, neighbour: bool, tmp: Path, timeout: float, doctor: str) -> dict:
    """The doctor ``runs`` times on the job ``STABLE[job]``, with a core-spinning neighbour or not."""
    overrides, right = STABLE[job]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
    records = []
    try:
        for i in range(runs):
            start = time.perf_counter()
            proc = subprocess.run([*DOCTOR, *STABLE_MEASURE, f"hydra.run.dir={tmp / f'{job}-{i}'}", *overrides],
                                  capture_output=True, text=True, env=_env(threads=False), cwd=tmp, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"stability run {job} {i} failed:\n{proc.stderr[-3000:]}")
            doc, m = json.loads(proc.stdout), json.loads(proc.stdout)["measurements"]
            records.append({
                "verdict": "too close to call" if doc["too_close_to_call"] else doc["bottleneck"],
                "step_s": doc["step_s"], "input_s": doc["breakdown"]["input"],
                "compute_in_run_s": doc["breakdown"]["compute"] + doc["breakdown"]["optimizer"],
                "compute_alone_s": m["compute_alone_s"], "threads": m["threads"],
                "compute_alone_one_thread_s": m.get("compute_alone_one_thread_s"),
                "outside_load_noted": bool(doc["notes"]), "wall_s": time.perf_counter() - start,
            })
    finally:
        if spinner is not None:
            os.kill(spinner.pid, 9)
            spinner.wait()
    verdicts = [r["verdict"] for r in records]
    return {
        "job": job, "doctor": doctor, "overrides": overrides, "neighbour": neighbour, "right_verdict": right, "runs": records,
        "right": verdicts.count(right), "too_close": verdicts.count("too close to call"),
        "wrong": sum(v not in (right, "too close to call") for v in verdicts),
        **{f"{k}_spread": _spread([r[k] for r in records]) for k in ("step_s", "input_s", "compute_in_run_s",
                                                                    "compute_alone_s", "wall_s")},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_avg_after": os.getloadavg(),
    }


def stability_table(results: dict) -> str:
    """Markdown rows of ``--out``'s results: verdict counts and the spread (median, min-max) of the times."""
    def ms(runs: list[dict], key: str) -> str:
        values = [r[key] for r in runs if r.get(key) is not None]
        return f"{1e3 * statistics.median(values):.0f} ({1e3 * min(values):.0f}-{1e3 * max(values):.0f})" if values else "-"
    rows = ["| doctor | job | neighbour | right | too close | wrong | step ms | input ms | compute in run ms | "
            "compute alone ms | on 1 thread ms | outside load noted |", "|---|---|---|" + "---:|" * 9]
    for r in results.values():
        noted = sum(x["outside_load_noted"] for x in r["runs"])
        times = " | ".join(ms(r["runs"], k) for k in ("step_s", "input_s", "compute_in_run_s", "compute_alone_s",
                                                      "compute_alone_one_thread_s"))
        rows.append(f"| {r['doctor']} | {r['job']} ({r['right_verdict']}) | "
                    f"{'1 core spinning' if r['neighbour'] else 'none'} | {r['right']}/{len(r['runs'])} | "
                    f"{r['too_close']} | {r['wrong']} | {times} | {noted} |")
    return "\n".join(rows)


def main() -> None:
    """Run the scenarios and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--stability", type=int, default=0, help="runs per job of the stability benchmark")
    parser.add_argument("--jobs", nargs="+", default=list(STABLE), choices=list(STABLE))
    parser.add_argument("--neighbour", action="store_true", help="a process spinning on one core during the runs")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/doctor_stability.json")
    parser.add_argument("--label", default="", help="which doctor was measured (suffix of the stored keys)")
    parser.add_argument("--table", action="store_true", help="print the stability table of --out and exit")
    parser.add_argument("--cap", type=float, default=10.0, help="emulated inter-node link, Mbit/s")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per scenario")
    parser.add_argument("--save", type=Path, default=None, help="folder for each scenario's report and doctor.json")
    results_file.add_option(parser, "doctor_scenarios")
    args = parser.parse_args()
    if args.stability or args.table:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        with tempfile.TemporaryDirectory(prefix="fastscale-doctor-") as tmp:
            for job in args.jobs if args.stability else []:
                key = f"{job}/{'neighbour' if args.neighbour else 'quiet'}" + (f" ({args.label})" if args.label else "")
                results[key] = stability(job, args.stability, args.neighbour, Path(tmp), args.timeout, args.label)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(stability_table(results))
        return
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
