"""An ordinary LightningModule trained with ``Trainer(strategy="hier_ring")`` on 4 CPU processes.

The 4 processes are grouped as 2 emulated nodes of 2 ranks (``ranks_per_node=2``), so the
gradients take the hierarchical path: reduce to each node's leader, all-reduce between the two
leaders, broadcast back (Jia et al. 2018). Run::

    python examples/hier_ring_plain_module.py            # strategy="hier_ring", 2x2 ranks
    python examples/hier_ring_plain_module.py --algorithm torus2d --wire-dtype bf16

Nothing here knows about the strategy except the Trainer arguments.
"""
from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_fastscale  # noqa: F401  (registers "hier_ring" / "hier_torus")
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy


class TinyClassifier(pl.LightningModule):
    """A two-layer MLP on a fixed synthetic 4-class problem."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def synthetic_data(n: int = 512, seed: int = 0) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random linear map (learnable, deterministic)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="hier", choices=["hier", "torus2d", "flat"])
    parser.add_argument("--wire-dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--max-epochs", type=int, default=2)
    args = parser.parse_args()

    pl.seed_everything(0)
    if args.algorithm == "hier" and args.wire_dtype == "fp32":
        strategy: str | HierarchicalAllReduceStrategy = "hier_ring"  # the registered name
    else:
        strategy = HierarchicalAllReduceStrategy(algorithm=args.algorithm, wire_dtype=args.wire_dtype)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_epochs=args.max_epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )
    # "hier_ring" defaults to the launcher's ranks per node (4 here: one node); group the four
    # local processes as 2 emulated nodes of 2 so the inter-node stage really runs.
    trainer.strategy.ranks_per_node = 2
    model = TinyClassifier()
    trainer.fit(model, DataLoader(synthetic_data(), batch_size=32))
    if trainer.global_rank == 0:
        strategy = trainer.strategy
        print(
            f"final train_loss={float(trainer.callback_metrics['train_loss']):.4f} "
            f"topology={strategy.topology} algorithm={strategy.resolved_algorithm} "
            f"comm_hook={strategy.comm_hook} comm_hook_calls={strategy.comm_hook_calls}"
        )


if __name__ == "__main__":
    main()
