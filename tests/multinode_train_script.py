"""A tiny Lightning training run launched by torchrun on emulated nodes (used by the multi-node test).

Every rank writes ``<out>/rank<R>.json`` with what the Trainer and the strategy saw (node rank,
world size, topology); rank 0 also writes the final weights to ``<out>/weights.pt``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyClassifier(pl.LightningModule):
    """Two-layer MLP; no batch norm, so DDP's averaged gradient equals the global-batch one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _strategy_report(strategy, recorder) -> dict:
    """What a hierarchical strategy detected and did (``None``/empty for plain DDP)."""
    topology = getattr(strategy, "topology", None)
    return {
        "topology_num_nodes": getattr(topology, "num_nodes", None),
        "topology_ranks_per_node": getattr(topology, "ranks_per_node", None),
        "hook_calls": recorder.hook_calls,
        "collective_calls": dict(recorder.stages),
    }


def main() -> None:
    """Train for ``--steps`` steps with the given strategy and report."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.strategy.startswith("hier"):
        import lightning_fastscale.strategies  # noqa: F401  (registers "hier_ring"/"hier_torus")

    pl.seed_everything(0, verbose=False)
    model = TinyClassifier()
    trainer = pl.Trainer(
        accelerator="cpu", strategy=args.strategy, num_nodes=args.num_nodes, devices=args.devices,
        max_steps=args.steps, default_root_dir=str(Path(args.out).parent),  # Lightning's logger and checkpoint there
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file by path
    from tests.comm_recording import CommRecorder

    with CommRecorder() as recorder:
        trainer.fit(model, DataLoader(_dataset(), batch_size=4, shuffle=False))
    out = Path(args.out)
    report = {
        "global_rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "num_nodes": trainer.num_nodes,
        "world_size": trainer.world_size,
        "emulated_node": os.environ.get("FASTSCALE_EMULATED_NODE"),
        "strategy": type(trainer.strategy).__name__,
        **_strategy_report(trainer.strategy, recorder),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
