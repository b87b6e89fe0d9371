"""Training-step throughput: ``strategy="ddp"`` against ``"hier_ring"`` / ``"hier_torus"``.

Single node, no emulation: N local CPU processes on gloo train a real model with Lightning;
each strategy runs in the same processes, in interleaved rounds (order rotated each round) so
that drifting machine load hits all of them alike. Reports images/s (median over
rounds) and the ratio to ddp measured in the same run: ratio of the medians, and the median of
the per-round paired ratios. On one node the hierarchical strategy
reduces to one all-reduce over the node, so the ratio measures the cost of the hook machinery
(target: within 5% of ddp). ``--ranks-per-node`` groups the local ranks into emulated nodes
(without any bandwidth cap) to measure the two-level path's overhead on a fast link.

Example::

    python benchmarks/train_step.py --devices 4 --steps 30 --warmup 5 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastscale.models import create_model
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy
from lightning_fastscale.strategies.options import WIRE_DTYPES


class _Classifier(pl.LightningModule):
    def __init__(self, model: str, num_classes: int) -> None:
        super().__init__()
        self.model = create_model(model, num_classes=num_classes)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class _StepTimer(pl.Callback):
    """Wall time from the start of step ``warmup`` to the end of the last step, ranks aligned."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            dist.barrier()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == trainer.max_steps:
            dist.barrier()
            self.end = time.perf_counter()


def make_strategy(name: str, ranks_per_node: int | None, wire_dtype: str = "fp32") -> Any:
    """``ddp`` -> Lightning's DDPStrategy; ``hier_ring``/``hier_torus`` -> ours with that algorithm."""
    if name == "ddp":
        return DDPStrategy()
    algorithm = {"hier_ring": "hier", "hier_torus": "torus2d"}[name]
    return HierarchicalAllReduceStrategy(algorithm=algorithm, ranks_per_node=ranks_per_node, wire_dtype=wire_dtype)


def images_per_second(strategy: Any, args: argparse.Namespace, world_size: int) -> float:
    """Throughput of one Lightning run in the current (already initialised) process group."""
    n = args.batch_size * (args.steps + 1)
    data = TensorDataset(torch.randn(n, 3, args.resolution, args.resolution), torch.randint(0, 10, (n,)))
    timer = _StepTimer(args.warmup)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        use_distributed_sampler=False,
    )
    trainer.fit(_Classifier(args.model, 10), DataLoader(data, batch_size=args.batch_size))
    return (args.steps - args.warmup) * args.batch_size * world_size / (timer.end - timer.start)


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results: dict[str, list[float]] = {name: [] for name in args.strategies}
    for round_ in range(args.rounds):
        # Rotate the order each round so no strategy always runs first (warm caches, load drift).
        shift = round_ % len(args.strategies)
        for name in args.strategies[shift:] + args.strategies[:shift]:
            results[name].append(images_per_second(make_strategy(name, args.ranks_per_node, args.wire_dtype),
                                                   args, world_size))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: all devices form one node")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "hier_ring", "hier_torus"])
    parser.add_argument("--wire-dtype", default="fp32", choices=list(WIRE_DTYPES))
    parser.add_argument("--model", default="resnet_small")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be smaller than --steps")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(args.devices, port, args, queue), nprocs=args.devices, start_method="spawn")
    results = queue.get()
    base = statistics.median(results["ddp"]) if "ddp" in results else None
    print(f"\n{args.devices} ranks on one machine ({os.cpu_count()} CPUs), ranks_per_node="
          f"{args.ranks_per_node or args.devices}, model={args.model} {args.resolution}px, "
          f"batch {args.batch_size}/rank, steps {args.warmup}..{args.steps}, {args.rounds} interleaved rounds, "
          f"wire_dtype={args.wire_dtype}")
    # Paired ratio: each round's run against the same round's ddp run, then the median; less
    # sensitive to load drift between rounds than the ratio of the medians.
    print(f"{'strategy':<12} {'images/s median':>16} {'vs ddp (medians)':>17} {'vs ddp (paired)':>16}  rounds")
    for name, values in results.items():
        ratio = f"{statistics.median(values) / base:.3f}" if base else "-"
        paired = (f"{statistics.median(v / d for v, d in zip(values, results['ddp'])):.3f}"
                  if "ddp" in results else "-")
        rounds = " ".join(f"{v:.0f}" for v in values)
        print(f"{name:<12} {statistics.median(values):>16.1f} {ratio:>17} {paired:>16}  {rounds}")


if __name__ == "__main__":
    import results_file

    results_file.run(main, "train_step")
