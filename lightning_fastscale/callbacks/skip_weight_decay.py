"""No weight decay on bias and normalisation parameters.

Jia et al. 2018 (Tencent, "Highly Scalable Deep Learning Training System with Mixed-Precision:
Training ImageNet in Four Minutes") removed weight decay from biases and batch-norm beta/gamma
and report +1.3% top-1 for AlexNet at batch 64K; Goyal et al. 2017 likewise leave BN
parameters undecayed. Which parameters count as "bias/BN-like" is decided by the one shared
rule in [`lightning_fastscale.param_groups`][lightning_fastscale.param_groups], the same rule the LARS plugin uses.

Functional core: [`param_groups_without_decay`][lightning_fastscale.callbacks.param_groups_without_decay] builds the two optimizer groups for any
``nn.Module``. Lightning adapter: [`NoWeightDecayOnBiasNorm`][lightning_fastscale.callbacks.NoWeightDecayOnBiasNorm] makes an unmodified
``configure_optimizers`` that builds its optimizer over ``self.parameters()`` receive those
groups instead.

Why the regrouping happens while ``configure_optimizers`` runs (and not afterwards): a
learning-rate scheduler built in ``configure_optimizers`` records one entry per parameter
group at construction (``base_lrs``), so splitting the groups of a finished optimizer would
leave the new group unscheduled. And the layout must exist before Lightning restores the
optimizer state of a checkpoint (``restore_training_state`` runs after ``on_fit_start``),
so a resumed run loads its momentum buffers into the same two groups it saved.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from ..param_groups import split_parameters, validate_patterns

DECAY_GROUP = "decay"
NO_DECAY_GROUP = "no_decay"
_INNER = "__configure_optimizers_without_regrouping__"
_UNSET = object()


def param_groups_without_decay(
    module: nn.Module,
    weight_decay: float | None = None,
    extra_patterns: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Optimizer parameter groups where bias/normalisation parameters get no weight decay.

    Args:
        module: the model whose trainable parameters are grouped (frozen ones are left out).
        weight_decay: weight decay of the first group; ``None`` leaves it unset so that the
            optimizer's own ``weight_decay`` argument applies.
        extra_patterns: glob patterns on qualified parameter names (``fnmatch``, e.g.
            ``"head.*"``) that also go to the no-decay group.

    Returns:
        ``[{"name": "decay", "params": [...]}, {"name": "no_decay", "params": [...],
        "weight_decay": 0.0}]`` in ``named_parameters()`` order, ready for any
        ``torch.optim`` optimizer; an empty group is omitted. The split is the shared rule
        of [`lightning_fastscale.param_groups.split_parameters`][lightning_fastscale.param_groups.split_parameters] (Jia et al. 2018).
    """
    decayed, excluded = split_parameters(module, validate_patterns(extra_patterns))
    groups: list[dict[str, Any]] = []
    if decayed:
        group: dict[str, Any] = {"name": DECAY_GROUP, "params": [p for _, p in decayed]}
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
        groups.append(group)
    if excluded:
        groups.append({"name": NO_DECAY_GROUP, "params": [p for _, p in excluded], "weight_decay": 0.0})
    return groups


class NoWeightDecayOnBiasNorm(pl.Callback):
    """Give bias and normalisation parameters zero weight decay (Jia et al. 2018).

    Works on an ordinary LightningModule whose ``configure_optimizers`` builds its optimizer
    over ``self.parameters()`` (as ``torch.optim.SGD(self.parameters(), ...)`` does): while
    ``configure_optimizers`` runs, ``self.parameters()`` yields the groups of
    [`param_groups_without_decay`][lightning_fastscale.callbacks.param_groups_without_decay] instead, so the optimizer (and any scheduler built on
    it) sees two groups from the start, the first with the optimizer's own weight decay and
    the second with none. Checkpoints therefore hold optimizer state in that layout and
    resume into it. Nothing else in ``configure_optimizers`` may use ``self.parameters()``
    as a parameter iterator while this callback is active.

    At ``on_fit_start`` (before a checkpoint's optimizer state is restored) the callback checks
    that every excluded parameter really is in a group with ``weight_decay == 0`` and raises
    otherwise, e.g. when ``configure_optimizers`` used ``self.model.parameters()``: build such
    optimizers with [`param_groups_without_decay`][lightning_fastscale.callbacks.param_groups_without_decay] directly and drop the callback.

    Args:
        extra_patterns: glob patterns on qualified parameter names (as the LightningModule's
            ``named_parameters()`` gives them, e.g. ``"model.head.*"``) that also get no
            weight decay.

    Examples:
        Without a Trainer, the groups the callback hands to ``configure_optimizers``:

        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8, 2))
        >>> [(g["name"], len(g["params"]), g.get("weight_decay")) for g in param_groups_without_decay(model, 5e-5)]
        [('decay', 2, 5e-05), ('no_decay', 4, 0.0)]

        In training: ``Trainer(callbacks=[NoWeightDecayOnBiasNorm()])`` on a module whose
        ``configure_optimizers`` builds its optimizer over ``self.parameters()``.
    """

    def __init__(self, extra_patterns: Sequence[str] = ()) -> None:
        self.extra_patterns = validate_patterns(extra_patterns)
        self._saved: Any = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _, excluded = split_parameters(pl_module, self.extra_patterns)
        if not excluded:
            raise ValueError(
                f"NoWeightDecayOnBiasNorm: {type(pl_module).__name__} has no trainable bias or "
                "normalisation parameters (and none matches extra_patterns="
                f"{self.extra_patterns}), so there is nothing to exclude from weight decay; "
                "remove the callback or add patterns"
            )
        # A user may have set configure_optimizers on the instance; teardown puts back exactly
        # what was there. A wrapper left by an interrupted fit is unwrapped, not wrapped twice.
        saved = pl_module.__dict__.get("configure_optimizers", _UNSET)
        self._saved = getattr(saved, _INNER, saved)
        original = getattr(pl_module.configure_optimizers, _INNER, pl_module.configure_optimizers)
        extra = self.extra_patterns

        @functools.wraps(original)
        def configure_optimizers() -> Any:
            groups = param_groups_without_decay(pl_module, None, extra)

            def grouped_parameters(recurse: bool = True) -> Iterator[Any]:
                return iter(groups)

            pl_module.parameters = grouped_parameters  # type: ignore[method-assign]
            try:
                return original()
            finally:
                del pl_module.parameters

        setattr(configure_optimizers, _INNER, original)
        pl_module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        names = {id(p): n for n, p in pl_module.named_parameters()}
        decay_of: dict[int, float] = {}
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    decay_of[id(p)] = float(group.get("weight_decay", 0.0))
        excluded_ids = {id(p) for _, p in split_parameters(pl_module, self.extra_patterns)[1]}
        wrong = sorted(names[i] for i in excluded_ids if decay_of.get(i, 0.0) != 0.0)
        if wrong:
            raise RuntimeError(
                f"NoWeightDecayOnBiasNorm: {len(wrong)} bias/normalisation parameters still have "
                f"weight decay (e.g. {wrong[:3]}): configure_optimizers did not build its optimizer "
                "from self.parameters(). Build the groups with "
                "lightning_fastscale.callbacks.param_groups_without_decay(...) in "
                "configure_optimizers and remove this callback"
            )
        rank_zero_info(
            f"NoWeightDecayOnBiasNorm: weight decay 0 on {len(excluded_ids)} bias/normalisation "
            f"parameters of {len(names)}"
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore(pl_module)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore(pl_module)

    def _restore(self, pl_module: pl.LightningModule) -> None:
        if self._saved is None:
            return
        if self._saved is _UNSET:
            pl_module.__dict__.pop("configure_optimizers", None)
        else:
            pl_module.configure_optimizers = self._saved  # type: ignore[method-assign]
        self._saved = None
