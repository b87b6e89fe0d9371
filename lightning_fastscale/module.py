"""``ImageClassifier``: an ordinary LightningModule for image classification.

Nothing in it is specific to large batches: the techniques of this package attach from the
outside (strategy, precision plugin, callbacks), which is the point. It is what
``fastscale-train`` trains, and a template for users' own modules.
"""
from __future__ import annotations

import inspect

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from .models import create_model



def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum 0.9, lr 0.1, weight decay 5e-4 (He et al. 2016)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def batch_size_of(batch: Any) -> int:
    """Samples in an ``(inputs, targets)`` batch; for Lightning's ``ThroughputMonitor``."""
    return len(batch[0])


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Cosine decay to zero over the run (Loshchilov & Hutter 2017), stepped per iteration."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))


class ImageClassifier(pl.LightningModule):
    """Classify images with a model chosen by name, cross-entropy loss and top-1/top-5 metrics.

    ``val/top1`` and ``val/top5`` are the fraction of correctly classified samples (micro
    accuracy, as reported by He et al. 2016 and every ImageNet leaderboard);
    ``val/per_class_top1`` is the mean of the per-class recalls (macro accuracy).

    Args:
        model: a model name for :func:`lightning_fastscale.models.create_model` (this
            package's models, timm, torchvision) or an ``nn.Module``.
        num_classes: number of classes.
        optimizer: a factory ``params -> Optimizer`` (a Hydra ``_partial_``, or a class path
            in LightningCLI: both factories use Lightning's own callable types so that
            jsonargparse can build them); SGD with Nesterov momentum when omitted.
        scheduler: a factory ``optimizer -> LRScheduler`` or None. It may also accept a
            ``total_steps`` keyword, which receives the Trainer's estimated optimizer steps.
        scheduler_interval: ``"step"`` or ``"epoch"``: when the scheduler steps.
        model_kwargs: extra arguments for the model factory.

    The loss is the ``criterion`` attribute (an ``nn.CrossEntropyLoss``) so that callbacks such
    as ``LabelSmoothing`` can act on it.
    """

    def __init__(
        self,
        model: str | nn.Module = "resnet_small",
        num_classes: int = 10,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: str = "step",
        model_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])
        self.model = (
            create_model(model, num_classes, **(model_kwargs or {})) if isinstance(model, str) else model
        )
        self.criterion = nn.CrossEntropyLoss()
        self.optimizer_factory = optimizer or default_optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        # top-1/top-5 as papers and leaderboards report them: the fraction of correct samples
        # (micro). torchmetrics' default ("macro", the mean of per-class recalls) differs
        # whenever classes are unbalanced; it is kept as its own metric, val/per_class_top1.
        self.train_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.val_per_class_top1 = MulticlassAccuracy(num_classes, top_k=1, average="macro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        self.train_top1(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1", self.train_top1, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        # Validation loss is always plain cross-entropy, whatever a callback did to training.
        loss = nn.functional.cross_entropy(logits, y)
        self.val_top1(logits, y)
        self.val_top5(logits, y)
        self.val_per_class_top1(logits, y)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log("val/top5", self.val_top5)
        self.log("val/per_class_top1", self.val_per_class_top1)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        if "total_steps" in inspect.signature(self.scheduler_factory).parameters:
            scheduler = self.scheduler_factory(optimizer, total_steps=self._total_scheduler_steps())
        else:
            scheduler = self.scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval},
        }

    def _total_scheduler_steps(self) -> int:
        if self.scheduler_interval == "epoch":
            return int(self.trainer.max_epochs or 1)
        return int(self.trainer.estimated_stepping_batches)
