"""Smith et al. 2017 on the built-in dataset: decay the LR, or grow the batch instead.

Two runs from the same initial weights and data order:

* ``decay_lr``: fixed global batch, the LR multiplied by ``factor`` at each milestone
  (torch ``MultiStepLR``, stepped per epoch);
* ``grow_batch``: constant LR, ``BatchSizeRamp`` in Smith's form (the batch divided by
  ``factor`` at each milestone).

Printed: optimizer steps, final validation top-1 and wall time of each run, and the ratios
grow/decay. Smith et al. report the same accuracy with fewer parameter updates; a single seed
on a small problem is noisy, so compare accuracy only roughly. Run on CPU:

    .venv/bin/python benchmarks/smith_batch_ramp.py --epochs 6 --milestones 3 5 \
        --train-size 2000 --val-size 500 --resolution 16
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import lightning.pytorch as pl
import torch

from lightning_fastscale.callbacks import BatchSizeRamp
from lightning_fastscale.data import ProceduralDataModule
from lightning_fastscale.module import ImageClassifier


def run(args: argparse.Namespace, grow_batch: bool) -> dict[str, float]:
    """Train once; return steps, final val top-1 and seconds."""
    pl.seed_everything(args.seed, verbose=False)
    optimizer = partial(torch.optim.SGD, lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = None if grow_batch else partial(
        torch.optim.lr_scheduler.MultiStepLR, milestones=args.milestones, gamma=args.factor
    )
    model = ImageClassifier("resnet_small", args.classes, optimizer=optimizer, scheduler=scheduler,
                            scheduler_interval="epoch")
    data = ProceduralDataModule(num_classes=args.classes, train_size=args.train_size,
                                val_size=args.val_size, resolution=args.resolution,
                                batch_size=args.batch, seed=args.seed)
    callbacks = [BatchSizeRamp(initial_global_batch=args.batch, lr_milestones=args.milestones,
                               lr_decay_factor=args.factor)] if grow_batch else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=args.epochs, logger=False,
                         callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    return {"steps": trainer.global_step, "val_top1": float(trainer.callback_metrics["val/top1"]),
            "seconds": seconds}


def main() -> None:
    """Parse options, run both arms, print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--milestones", type=int, nargs="+", default=[4, 6])
    p.add_argument("--factor", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--val-size", type=int, default=1000)
    p.add_argument("--resolution", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'run':<12}{'steps':>8}{'val top-1':>11}{'seconds':>9}", flush=True)
    results = {}
    for name in ("decay_lr", "grow_batch"):
        r = results[name] = run(args, grow_batch=name == "grow_batch")
        print(f"{name:<12}{r['steps']:>8}{r['val_top1']:>11.4f}{r['seconds']:>9.1f}", flush=True)
    decay, grow = results["decay_lr"], results["grow_batch"]
    print(f"grow/decay: steps {grow['steps'] / decay['steps']:.3f}, "
          f"val top-1 {grow['val_top1'] - decay['val_top1']:+.4f}, "
          f"time {grow['seconds'] / decay['seconds']:.3f}")


if __name__ == "__main__":
    main()
