"""``ImageClassifier``: an ordinary LightningModule for image classification; the large-batch
techniques attach from the outside (strategy, precision plugin, callbacks).
"""
from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from .models import create_model
from .param_groups import param_groups_without_decay, split_parameters, validate_patterns


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum 0.9, lr 0.1, weight decay 5e-4 (He et al. 2016)."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def batch_size_of(batch: Any) -> int:
    """Samples in an ``(inputs, targets)`` batch; for Lightning's ``ThroughputMonitor``."""
    return len(batch[0])


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Cosine decay to zero over the run (Loshchilov & Hutter 2017), stepped per iteration."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class ImageClassifier(pl.LightningModule):
    """Classify images with a model chosen by name, cross-entropy loss and top-1/top-5 metrics.

    ``val/top1``, ``val/top5``: micro accuracy (He et al. 2016); ``val/per_class_top1``: macro.
    The loss is the ``criterion`` attribute, for callbacks such as ``LabelSmoothing``.

    Args:
        model: a model name for `create_model` or an ``nn.Module``.
        optimizer: a factory ``params -> Optimizer``; SGD with Nesterov momentum when omitted.
        scheduler: a factory ``optimizer -> LRScheduler`` (optionally taking ``total_steps``) or None.
        pretrained: ``False`` (random), ``True`` (the library's weights) or a local weights file.
        channels_last, compile, compile_mode, no_weight_decay_on_bias_norm, no_weight_decay_patterns: the
            ``model.*`` options of ``docs/hydra.md``.

    Examples:
        >>> import torch
        >>> from lightning_fastscale import ImageClassifier
        >>> module = ImageClassifier("resnet_small", num_classes=10, channels_last=True)
        >>> module(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])

        Trained as any LightningModule, e.g. ``pl.Trainer(max_epochs=1).fit(module,
        datamodule=ProceduralDataModule())``; ``fastscale-train`` builds it from the ``model``
        config group.
    """

    def __init__(
        self,
        model: str | nn.Module = "resnet_small",
        num_classes: int = 10,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: str = "step",
        model_kwargs: dict[str, Any] | None = None,
        pretrained: bool | str = False,
        channels_last: bool = False,
        compile: bool = False,
        compile_mode: str | None = None,
        no_weight_decay_on_bias_norm: bool = False,
        no_weight_decay_patterns: Sequence[str] = (),
    ) -> None:
        super().__init__()
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval={scheduler_interval!r} is not 'step' or 'epoch'")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode={compile_mode!r} is not one of {list(COMPILE_MODES)}")
        if compile_mode is not None and not compile:
            raise ValueError(f"compile_mode={compile_mode!r} has no effect without compile=True")
        if not isinstance(model, str) and pretrained is not False:
            raise ValueError(
                f"pretrained={pretrained!r} applies to a model given by name; load weights into your nn.Module yourself"
            )
        self.save_hyperparameters(ignore=["model", "optimizer", "scheduler"])
        self.model = (
            create_model(model, num_classes, pretrained=pretrained, **(model_kwargs or {}))
            if isinstance(model, str)
            else model
        )
        self.channels_last = channels_last
        self.compile_network = compile  # not ``self.compile``: that is nn.Module's method
        self.compile_mode = compile_mode
        if channels_last:
            self.model.to(memory_format=torch.channels_last)
        self._flops_per_sample: dict[tuple[int, ...], int] = {}
        self._last_batch_shape: tuple[int, ...] | None = None
        self.no_weight_decay_patterns = validate_patterns(no_weight_decay_patterns)
        if self.no_weight_decay_patterns and not no_weight_decay_on_bias_norm:
            raise ValueError(
                f"no_weight_decay_patterns={self.no_weight_decay_patterns} has no effect without "
                "no_weight_decay_on_bias_norm=True"
            )
        if no_weight_decay_on_bias_norm and not split_parameters(self, self.no_weight_decay_patterns)[1]:
            raise ValueError(
                f"no_weight_decay_on_bias_norm=True: {type(self.model).__name__} has no trainable bias or "
                "normalisation parameters (and none matches no_weight_decay_patterns), so nothing would "
                "be left without weight decay; set no_weight_decay_on_bias_norm=False or add patterns"
            )
        self.no_weight_decay_on_bias_norm = no_weight_decay_on_bias_norm
        self.criterion = nn.CrossEntropyLoss()
        self.optimizer_factory = optimizer or default_optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        # micro, as papers report top-1/top-5; torchmetrics' default (macro) is val/per_class_top1
        self.train_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.val_per_class_top1 = MulticlassAccuracy(num_classes, top_k=1, average="macro")

    @override
    def configure_model(self) -> None:
        if self.compile_network and self.model._compiled_call_impl is None:
            self.model.compile(mode=self.compile_mode)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.model(x)

    @property
    def flops_per_batch(self) -> int | None:
        """FLOPs of one batch of the last seen shape (forward + backward in training), for ``ThroughputMonitor``."""
        if self._last_batch_shape is None:
            return None
        batch, *sample = self._last_batch_shape
        key = (self.training, *sample)
        if key not in self._flops_per_sample:
            self._flops_per_sample[key] = self._count_flops(tuple(sample), self.training)
        return batch * self._flops_per_sample[key]

    def _count_flops(self, sample_shape: tuple[int, ...], training: bool) -> int:
        # hooks may run under inference mode; a meta-device copy leaves the real network untouched
        with torch.inference_mode(False), torch.enable_grad():
            network = copy.deepcopy(self.model).to("meta")
            network._compiled_call_impl = None  # the copy shares the compiled callable of the original
            network.train(training)
            # two samples: training BatchNorm refuses one value per channel (AlexNet-BN at 64 px)
            x = torch.empty(2, *sample_shape, device="meta")
            flops = measure_flops(network, lambda: network(x), loss_fn=torch.Tensor.sum if training else None)
            return flops // 2

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self._last_batch_shape = tuple(x.shape)
        logits = self(x)
        loss = self.criterion(logits, y)
        self.train_top1(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1", self.train_top1, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self._last_batch_shape = tuple(x.shape)
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

    @override
    def setup(self, stage: str) -> None:
        """Take ``example_input_array`` (for the model summary and the planner) from the datamodule's batch and resolution."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.example_input_array is None and datamodule is not None:
            batch = getattr(datamodule, "train_batch_size", None)
            side = getattr(datamodule, "train_resolution", None)
            if isinstance(batch, int) and isinstance(side, int):
                self.example_input_array = torch.zeros(batch, 3, side, side)

    @override
    def configure_optimizers(self) -> Any:
        """The optimizer over the module's parameters (two weight-decay groups when asked), and its scheduler."""
        optimizer = self.optimizer_factory(self._optimizer_parameters())
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

    def _optimizer_parameters(self) -> Any:
        if not self.no_weight_decay_on_bias_norm:
            return self.parameters()
        groups = param_groups_without_decay(self, None, self.no_weight_decay_patterns)
        excluded = sum(len(g["params"]) for g in groups if g["name"] == "no_decay")
        rank_zero_info(
            f"ImageClassifier: weight decay 0 on {excluded} bias/normalisation parameters of "
            f"{sum(len(g['params']) for g in groups)}"
        )
        return groups

    def _total_scheduler_steps(self) -> int:
        if self.scheduler_interval == "epoch":
            return int(self.trainer.max_epochs or 1)
        steps = self.trainer.estimated_stepping_batches
        if math.isinf(steps):
            raise ValueError(
                "the scheduler spreads the learning rate over the run, but Trainer(max_epochs=-1, "
                "max_steps=-1) trains without end: set max_epochs or max_steps, or drop the scheduler"
            )
        return int(steps)
