"""Shared runner of the ImageNet large-batch examples (``imagenet_resnet50.py``,
``imagenet_alexnet_bn.py``): builds the Trainer from a :class:`Recipe` and fits it.

With ``--data-root`` it trains on an ImageNet folder (``train/<class>/*.JPEG``,
``val/<class>/*``); with ``--fast-dev-run`` it runs the same callbacks, precision plugin and
strategy for two tiny epochs on the built-in procedural data, on the CPU. ``--model`` swaps
the network (e.g. ``resnet_small`` for a quicker check of the ResNet-50 recipe).
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, replace
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_fastscale  # noqa: F401  (registers "hier_ring" / "hier_torus")
from lightning_fastscale import ImageClassifier, ImageFolderDataModule, ProceduralDataModule
from lightning_fastscale.callbacks import (
    BatchSizeRamp,
    LabelSmoothing,
    WarmupDecayLR,
    ZeroInitResidualBN,
)
from lightning_fastscale.precision import LARSMixedPrecision
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy


@dataclass(frozen=True)
class Recipe:
    """One large-batch recipe: the model and every hyper-parameter the Trainer needs."""

    model: str
    global_batch: dict[int, int]
    max_per_device_batch: int
    epochs: int
    lr: float
    weight_decay: float
    warmup_epochs: float
    end_lr: float
    reference_batch: int | None
    eta: float
    eps: float
    label_smoothing: float | None
    zero_init_residual: bool
    resolution: int = 224
    model_kwargs: dict[str, Any] = field(default_factory=dict)


def fast_dev_run(recipe: Recipe) -> Recipe:
    """The same recipe at a size that runs in seconds: a 2-step ramp (8 -> 16 per process,
    accumulating 2 x 8 in the second epoch) over two epochs of 32 px images."""
    return replace(
        recipe, global_batch={0: 8, 1: 16}, max_per_device_batch=8, epochs=2, warmup_epochs=1.0,
        reference_batch=8 if recipe.reference_batch else None, resolution=32,
    )


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-root", help="ImageNet folder with train/ and val/")
    parser.add_argument("--fast-dev-run", action="store_true",
                        help="two tiny epochs on the built-in data, CPU (a smoke test of the recipe)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1, help="processes (GPUs) per node")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="group local processes as emulated nodes (default: one node per machine)")
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--model", help="another model name for the same recipe (create_model)")
    args = parser.parse_args()
    if not args.fast_dev_run and not args.data_root:
        parser.error("give --data-root /path/to/imagenet, or --fast-dev-run for the built-in data")
    return args


def run(recipe: Recipe, args: argparse.Namespace) -> pl.Trainer:
    """Fit ``recipe`` as ``args`` ask; print the final metrics on rank 0."""
    world = args.num_nodes * args.devices
    if args.model:
        recipe = replace(recipe, model=args.model, model_kwargs={})
    if args.fast_dev_run:
        recipe = fast_dev_run(recipe)
        schedule = {epoch: batch * world for epoch, batch in recipe.global_batch.items()}
        first = recipe.global_batch[0]
        datamodule: pl.LightningDataModule = ProceduralDataModule(
            train_size=2 * schedule[max(schedule)], val_size=32, resolution=recipe.resolution,
            batch_size=first,
        )
    else:
        schedule = recipe.global_batch
        datamodule = ImageFolderDataModule(
            args.data_root, resolution=recipe.resolution, num_workers=args.num_workers,
            batch_size=min(recipe.max_per_device_batch, schedule[0] // world),
        )
    on_gpu = torch.cuda.is_available() and not args.fast_dev_run
    callbacks: list[pl.Callback] = [
        BatchSizeRamp(schedule, max_per_device_batch=recipe.max_per_device_batch),
        WarmupDecayLR(warmup_epochs=recipe.warmup_epochs, decay="poly", power=2.0,
                      end_lr=recipe.end_lr, reference_batch=recipe.reference_batch),
    ]
    if recipe.label_smoothing:
        callbacks.append(LabelSmoothing(recipe.label_smoothing))
    if recipe.zero_init_residual:
        callbacks.append(ZeroInitResidualBN())
    trainer = pl.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        num_nodes=args.num_nodes,
        devices=args.devices,
        strategy=HierarchicalAllReduceStrategy(algorithm="hier", ranks_per_node=args.ranks_per_node),
        # fp16 compute on the GPU as Jia et al.; fp32 compute on the CPU, where bf16 autocast of
        # the large fully connected layers is several times slower than fp32
        plugins=[LARSMixedPrecision("16-mixed" if on_gpu else "32-true", eta=recipe.eta, eps=recipe.eps)],
        callbacks=callbacks,
        max_epochs=recipe.epochs,
        limit_train_batches=2 if args.fast_dev_run else None,
        limit_val_batches=2 if args.fast_dev_run else None,
        logger=not args.fast_dev_run,
        enable_checkpointing=not args.fast_dev_run,
        enable_progress_bar=not args.fast_dev_run,
    )
    optimizer = functools.partial(
        torch.optim.SGD, lr=recipe.lr, momentum=0.9, nesterov=False, weight_decay=recipe.weight_decay,
    )
    module = ImageClassifier(
        recipe.model, num_classes=datamodule.num_classes, optimizer=optimizer,
        model_kwargs=recipe.model_kwargs, no_weight_decay_on_bias_norm=True,
    )
    trainer.fit(module, datamodule=datamodule)
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in sorted(trainer.callback_metrics.items())}
        print("final " + " ".join(f"{k}={v:.6g}" for k, v in metrics.items()))
    return trainer
