"""Lightning training steps on an emulated 2-node cluster: strategy="ddp" vs "hier_ring" vs "hier_torus".

Builds the emulated cluster (network namespaces, each node's link capped with ``tbf``), then
for each strategy launches ``torchrun --nnodes N --node_rank i`` on every node running a real
model (timm ResNet-18 by default: 11.2M parameters, 45 MB of fp32 gradient) under
``Trainer(strategy=..., num_nodes=N, devices=R, accelerator="cpu")`` on random images.
Prints images/s over the timed steps and the ratio against ``ddp`` measured in the same
cluster. Needs root. Example::

    .venv/bin/python benchmarks/train_step_cluster.py --cap 500
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import results_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PORT = 29500  # free by construction: the emulated nodes are fresh network namespaces


_ALGORITHM_OF = {"hier_ring": "hier", "hier_torus": "torus2d"}


def make_strategy(spec: str):
    """``"ddp"`` / ``"hier_ring"`` as is; ``"hier_ring:pipeline_chunk_mb=4,wire_dtype=fp16"`` builds
    :class:`~lightning_fastscale.strategies.HierarchicalAllReduceStrategy` with those options."""
    name, _, options = spec.partition(":")
    if not options:
        return spec
    if name not in _ALGORITHM_OF:
        raise ValueError(f"strategy options are only supported for {sorted(_ALGORITHM_OF)}, got {spec!r}")
    from lightning_fastscale.strategies import HierarchicalAllReduceStrategy

    kwargs = {}
    for item in options.split(","):
        key, _, value = item.partition("=")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return HierarchicalAllReduceStrategy(algorithm=_ALGORITHM_OF[name], **kwargs)


def _worker(cfg: dict) -> None:
    """One rank: train ``warmup + steps`` steps, time the last ``steps`` (runs under torchrun)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_fastscale.strategies  # noqa: F401  (registers the strategies)
    from lightning_fastscale.models import create_model

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = create_model(cfg["model"], num_classes=10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []

        def on_train_batch_start(self, trainer, *args) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer, *args) -> None:
            self.ends.append(time.perf_counter())

    total = cfg["warmup"] + cfg["steps"]
    g = torch.Generator().manual_seed(0)
    n = cfg["batch"] * total * cfg["world"]
    data = TensorDataset(torch.randn(n, 3, cfg["res"], cfg["res"], generator=g), torch.randint(0, 10, (n,), generator=g))
    timer = StepTimer()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", strategy=make_strategy(cfg["strategy"]), num_nodes=cfg["nodes"], devices=cfg["ranks_per_node"],
        max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer],
    )
    trainer.fit(Classifier(), DataLoader(data, batch_size=cfg["batch"]))
    # Steady state: from the start of the first timed step to the end of the last one; the
    # warm-up covers connection set-up and DDP's bucket rebuild after the first iteration.
    elapsed = timer.ends[-1] - timer.starts[cfg["warmup"]]
    step_times = [e - s for s, e in zip(timer.starts[cfg["warmup"]:], timer.ends[cfg["warmup"]:])]
    if trainer.global_rank == 0:
        Path(cfg["output"]).write_text(json.dumps({
            "elapsed_s": elapsed, "step_times_s": step_times, "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes, "strategy": type(trainer.strategy).__name__,
        }))


def run(strategies: list[str], cap: float | None, nodes: int, ranks_per_node: int, model: str,
        batch: int, res: int, steps: int, warmup: int, timeout: float) -> list[dict]:
    """Measure each strategy back to back on one emulated cluster; return one row per strategy."""
    from lightning_fastscale.emulation import EmulatedCluster

    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="fastscale-trainstep-") as tmp, \
            EmulatedCluster(nodes, bandwidth_mbit=cap) as cluster:
        for strategy in strategies:
            out = Path(tmp) / f"{strategy}.json"
            cfg = dict(strategy=strategy, nodes=nodes, ranks_per_node=ranks_per_node, world=nodes * ranks_per_node,
                       model=model, batch=batch, res=res, steps=steps, warmup=warmup, output=str(out))
            commands = [
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(i),
                 "--nproc_per_node", str(ranks_per_node), "--master_addr", cluster.nodes[0].address,
                 "--master_port", str(PORT), str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
                for i in range(nodes)
            ]
            results = cluster.run(commands, timeout=timeout, env=env)
            if any(r.returncode != 0 for r in results) or not out.exists():
                detail = "\n".join(f"--- node {r.node} rc={r.returncode}\n{(r.stderr or '')[-3000:]}" for r in results)
                raise RuntimeError(f"strategy {strategy} failed on the emulated cluster\n{detail}")
            row = json.loads(out.read_text())
            row.update(strategy_name=strategy, images_per_s=batch * row["world_size"] * steps / row["elapsed_s"],
                       median_step_s=statistics.median(row["step_times_s"]))
            rows.append(row)
    base = next((r["images_per_s"] for r in rows if r["strategy_name"] == "ddp"), None)
    for row in rows:
        row["ratio_vs_ddp"] = None if base is None else row["images_per_s"] / base
    return rows


def main() -> None:
    """Parse arguments, run, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "hier_ring", "hier_torus"],
                        help='names, or name:key=value,... for HierarchicalAllReduceStrategy options, '
                             'e.g. "hier_ring:pipeline_chunk_mb=4,wire_dtype=fp16"')
    parser.add_argument("--cap", type=float, default=500.0, help="per-node link cap, Mbit/s (0 = uncapped)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--model", default="resnet18", help="any lightning_fastscale.models.create_model name")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--res", type=int, default=32, help="image resolution")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per strategy")
    results_file.add_option(parser, "train_step_cluster")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    rows = run(args.strategies, args.cap or None, args.nodes, args.ranks_per_node, args.model,
               args.batch, args.res, args.steps, args.warmup, args.timeout)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; {args.nodes} nodes x {args.ranks_per_node} ranks "
          f"(gloo), link cap {args.cap or 'none'} Mbit/s; {args.model} {args.res}x{args.res}, "
          f"batch {args.batch}/rank, {args.steps} timed steps after {args.warmup}")
    print("| strategy | images/s | median step s | x ddp |")
    print("|---|---|---|---|")
    for r in rows:
        ratio = "-" if r["ratio_vs_ddp"] is None else f"{r['ratio_vs_ddp']:.2f}"
        print(f"| {r['strategy_name']} | {r['images_per_s']:.1f} | {r['median_step_s']:.3f} | {ratio} |")
    results_file.write(args.results, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
