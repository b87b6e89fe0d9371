"""Label smoothing on the training loss only, optionally annealed (Szegedy et al. 2016; Mikami et al. 2018).

Method card: ``docs/methods/label_smoothing.md``.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override

from lightning_fastscale._validation import positive_int


def smooth_targets(targets: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """The smoothed target distribution ``(1 - eps) * onehot(y) + eps / K`` (Szegedy et al. 2016).

    Shape ``targets.shape + (K,)``; cross-entropy against it equals ``nn.CrossEntropyLoss(label_smoothing=eps)``.
    """
    _check_smoothing("smoothing", smoothing)
    onehot = nn.functional.one_hot(targets.long(), num_classes).to(torch.get_default_dtype())
    return onehot * (1.0 - smoothing) + smoothing / num_classes


def smoothing_at_epoch(
    epoch: int, smoothing: float, final_smoothing: float | None = None, anneal_epochs: int = 0
) -> float:
    """Smoothing factor for ``epoch``: linear from ``smoothing`` to ``final_smoothing`` (if given) at ``anneal_epochs``."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    if final_smoothing is None or epoch >= anneal_epochs:
        return smoothing if final_smoothing is None else final_smoothing
    return smoothing + (final_smoothing - smoothing) * epoch / anneal_epochs


def _check_smoothing(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"LabelSmoothing: {name}={value} is outside [0, 1]; 0.1 is the usual value")


def find_cross_entropy(pl_module: nn.Module, attribute: str | None = None) -> tuple[str, nn.CrossEntropyLoss]:
    """``(name, loss)``: the ``nn.CrossEntropyLoss`` at dotted path ``attribute``, else the module's only one."""
    owner = type(pl_module).__name__
    if attribute is not None:
        try:
            found = pl_module.get_submodule(attribute)
        except AttributeError:
            raise ValueError(
                f"LabelSmoothing(attribute={attribute!r}): {owner} has no submodule {attribute!r}; "
                f"set attribute to the name of its nn.CrossEntropyLoss (e.g. self.criterion)"
            ) from None
        if not isinstance(found, nn.CrossEntropyLoss):
            raise ValueError(
                f"LabelSmoothing(attribute={attribute!r}): {owner}.{attribute} is a "
                f"{type(found).__name__}, not an nn.CrossEntropyLoss; point attribute at the "
                "cross-entropy loss module"
            )
        return attribute, found
    candidates = [(n, m) for n, m in pl_module.named_modules() if isinstance(m, nn.CrossEntropyLoss)]
    if not candidates:
        raise ValueError(
            f"LabelSmoothing: {owner} holds no nn.CrossEntropyLoss attribute to act on (a "
            "functional F.cross_entropy call cannot be reached from a callback); assign the loss "
            "in __init__, e.g. self.criterion = nn.CrossEntropyLoss(), and call it in training_step"
        )
    if len(candidates) > 1:
        raise ValueError(
            f"LabelSmoothing: {owner} holds several nn.CrossEntropyLoss modules "
            f"({', '.join(n for n, _ in candidates)}); choose one with attribute=..."
        )
    return candidates[0]


class LabelSmoothing(pl.Callback):
    """Smooth the labels of the training loss (Szegedy et al. 2016; Mikami et al. 2018).

    Sets ``label_smoothing`` of the module's ``nn.CrossEntropyLoss`` (or the one named by
    ``attribute``) for training epochs, 0 during validation and after the fit; optionally annealed
    to ``final_smoothing`` over ``anneal_epochs``.

    Examples:
        >>> smoothing = LabelSmoothing(0.1)
        >>> smooth_targets(torch.tensor([2]), num_classes=4, smoothing=0.1)
        tensor([[0.0250, 0.0250, 0.9250, 0.0250]])
        >>> smoothing_at_epoch(5, 0.2, final_smoothing=0.0, anneal_epochs=10)
        0.1
    """

    def __init__(
        self,
        smoothing: float = 0.1,
        final_smoothing: float | None = None,
        anneal_epochs: int = 0,
        attribute: str | None = None,
    ) -> None:
        _check_smoothing("smoothing", smoothing)
        if final_smoothing is not None:
            _check_smoothing("final_smoothing", final_smoothing)
            hint = f"final_smoothing={final_smoothing} needs anneal_epochs >= 1, the epochs to anneal over"
            positive_int("LabelSmoothing.anneal_epochs", anneal_epochs, hint=hint)
        self.smoothing = smoothing
        self.final_smoothing = final_smoothing
        self.anneal_epochs = anneal_epochs
        self.attribute = attribute
        self._criterion: nn.CrossEntropyLoss | None = None
        self._criterion_name = ""
        self._outside_validation = 0.0
        self._calls = 0
        self._verified = False
        self._hook: Any = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        name, criterion = find_cross_entropy(pl_module, self.attribute)
        if criterion.label_smoothing != 0.0:
            raise ValueError(
                f"LabelSmoothing: {type(pl_module).__name__}.{name} already has "
                f"label_smoothing={criterion.label_smoothing}, which would also smooth the "
                "validation loss; construct it with label_smoothing=0 and let the callback "
                "apply the smoothing, or remove the callback"
            )
        self._criterion = criterion
        self._criterion_name = name
        self._calls = 0
        self._verified = False
        self._hook = criterion.register_forward_hook(self._count_call)

    def _count_call(self, module: nn.Module, args: Any, output: Any) -> None:
        self._calls += 1

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """Refuse a first training loss that did not come from the smoothed criterion (e.g. ``F.cross_entropy``)."""
        if self._verified or self._criterion is None:
            return
        if self._calls == 0:
            raise RuntimeError(
                f"LabelSmoothing acts on {type(pl_module).__name__}.{self._criterion_name}, but "
                f"training_step computed its loss without calling it (e.g. F.cross_entropy), so no "
                f"label would be smoothed; compute the training loss with self.{self._criterion_name}"
                "(logits, targets), or remove the LabelSmoothing callback"
            )
        self._verified = True

    def _apply(self, trainer: pl.Trainer) -> float:
        value = smoothing_at_epoch(trainer.current_epoch, self.smoothing, self.final_smoothing, self.anneal_epochs)
        assert self._criterion is not None, "setup(stage='fit') runs before any training epoch"
        self._criterion.label_smoothing = value
        return value

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a run resumed in the middle of an epoch gets no on_train_epoch_start from Lightning
        self._apply(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = self._apply(trainer)
        pl_module.log("label_smoothing", value, on_step=False, on_epoch=True)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._criterion is not None:
            self._outside_validation = self._criterion.label_smoothing
            self._criterion.label_smoothing = 0.0

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._criterion is not None:
            self._criterion.label_smoothing = self._outside_validation

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._criterion is not None:
            self._criterion.label_smoothing = 0.0
            self._criterion = None
