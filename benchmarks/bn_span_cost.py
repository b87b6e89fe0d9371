"""BN statistics across two emulated nodes: the step time a span adds, against the planner's rule for it.

``fastscale-plan --bn-span`` prices a span wider than one device as two all-reduces of 2C + 1
values per BN layer and step, not overlapped. Here two nodes (one rank each, the link capped as
in the time-to-accuracy regimes) train ResNet-20 (19 BN layers) with ``bn_span`` = the per-device
batch (ghost groups: no communication) and = twice it (one group across both nodes), and the span
layer over each rank alone (its arithmetic and calls without the network). Measured: the median
step time of each (interleaved rounds) and the all-reduce of each layer's 2C + 1 values alone;
the rule's price is the sum over layers of twice the measured all-reduce.

    python benchmarks/bn_span_cost.py            # writes benchmarks/results/bn_span_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import results_file  # noqa: E402

BATCH, SIZE, ROUNDS, STEPS, WARMUP = 16, 32, 5, 10, 3


def worker(out: Path) -> None:
    """One rank: step times per span, interleaved over rounds, and each layer's statistics all-reduce."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_fastscale.callbacks.bn_span import SpanBatchNormLayer, apply_bn_span
    from lightning_fastscale.models import create_model
    from lightning_fastscale.planner.bn_span_cost import bn_channels

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 3, SIZE, SIZE), torch.randint(0, 10, (BATCH,))
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    models = {}
    for arm, span in (("ghost", BATCH), ("own", 2 * BATCH), ("across", 2 * BATCH)):
        model = create_model("resnet20", num_classes=10)
        channels = bn_channels(model)
        apply_bn_span(model, span, BATCH, ranks_per_node=1)
        if arm == "own":  # the span layer's arithmetic and all-reduce calls, over this rank alone
            for layer in model.modules():
                if isinstance(layer, SpanBatchNormLayer):
                    layer.group = own
        models[arm] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    step_s: dict[str, list[float]] = {arm: [] for arm in models}
    for _ in range(ROUNDS):
        for arm, (model, opt) in models.items():
            times = []
            for i in range(WARMUP + STEPS):
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if i >= WARMUP:
                    times.append(time.perf_counter() - start)
            step_s[arm].append(statistics.median(times))
    allreduce_s = {}
    for c in sorted(set(channels)):
        t = torch.zeros(2 * c + 1)
        times = []
        for i in range(WARMUP + 50):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        allreduce_s[c] = statistics.median(times)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"channels": channels, "step_s": step_s, "allreduce_s": allreduce_s}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates-mbit", nargs="+", type=float, default=[250.4, 34.9],
                        help="link caps (the time-to-accuracy benchmark's cloud and record regimes)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bn_span_cost"))
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    results_file.add_option(parser, "bn_span_cost")
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return {}
    from lightning_fastscale.emulation import EmulatedCluster

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args.workdir.mkdir(parents=True, exist_ok=True)
    report, rows = {}, []
    for rate in args.rates_mbit:
        out = args.workdir / f"rate{rate:g}.json"
        out.unlink(missing_ok=True)
        with EmulatedCluster(2, bandwidth_mbit=rate, burst_kb=16) as cluster:
            master = cluster.nodes[0].address
            cluster.run([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
                          "--nproc_per_node", "1", "--master_addr", master, "--master_port", "29500",
                          str(Path(__file__).resolve()), "--worker", str(out)] for i in range(2)],
                        timeout=600, env=env)
        m = json.loads(out.read_text())
        ghost, own, across = (m["step_s"][arm] for arm in ("ghost", "own", "across"))
        added = [a - o for a, o in zip(across, own)]  # the network's share: same arithmetic on both
        rule = sum(2 * m["allreduce_s"][str(c)] for c in m["channels"])
        report[f"{rate:g}"] = {**m, "added_s": added, "rule_s": rule}
        ms = [f"{statistics.median(v) * 1e3:.1f}" for v in (ghost, own, across)]
        rows.append(f"| {rate:g} | {len(m['channels'])} | {' | '.join(ms)} | {statistics.median(added) * 1e3:.1f} "
                    f"({min(added) * 1e3:.1f}-{max(added) * 1e3:.1f}) | {rule * 1e3:.1f} | "
                    f"{statistics.median(added) / rule:.2f} |")
    table = ["| link (Mbit/s) | BN layers | step ms: span 16 (ghost) | span 32, each rank its own group | "
             "span 32 across 2 nodes | added by the network, ms: median (min-max of rounds) | "
             "rule: 2 x measured all-reduce per layer, ms | added / rule |",
             "|---:|---:|---:|---:|---:|---|---:|---:|", *rows]
    print("\n".join(table))
    results_file.write(args.results, report, [table])
    return report


if __name__ == "__main__":
    main()
