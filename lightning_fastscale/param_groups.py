"""The one rule that decides which parameters are "bias/BN-like".

More in ``docs/methods/no_weight_decay_bias_norm.md`` ("In code").
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

DECAY_GROUP = "decay"
NO_DECAY_GROUP = "no_decay"

NORM_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)


def is_excluded(
    name: str,
    param: nn.Parameter,
    *,
    in_norm_layer: bool = False,
    extra_patterns: Sequence[str] = (),
) -> bool:
    """Whether ``param`` (qualified ``name``) gets no weight decay and no LARS adaptation: 0-D/1-D, norm or pattern."""
    return param.ndim <= 1 or in_norm_layer or any(fnmatch.fnmatchcase(name, p) for p in extra_patterns)


def split_parameters(
    module: nn.Module, extra_patterns: Sequence[str] = ()
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """Split ``module``'s trainable parameters into (adapted, excluded), in ``named_parameters()`` order."""
    norm_ids = {id(p) for sub in module.modules()
                if isinstance(sub, NORM_LAYER_TYPES) or type(sub).__name__.lower().endswith("norm")
                for p in sub.parameters(recurse=False)}
    adapted: list[tuple[str, nn.Parameter]] = []
    excluded: list[tuple[str, nn.Parameter]] = []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        target = excluded if is_excluded(
            name, param, in_norm_layer=id(param) in norm_ids, extra_patterns=extra_patterns
        ) else adapted
        target.append((name, param))
    return adapted, excluded


def validate_patterns(patterns: Iterable[str]) -> list[str]:
    """Check user glob patterns are non-empty strings; return them as a list."""
    out = list(patterns)
    for p in out:
        if not isinstance(p, str) or not p:
            raise ValueError(
                f"exclusion pattern {p!r} is not a non-empty string; give glob patterns on "
                "parameter names such as '*.bias' or 'head.*'"
            )
    return out


def param_groups_without_decay(
    module: nn.Module,
    weight_decay: float | None = None,
    extra_patterns: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Optimizer groups ``decay`` and ``no_decay`` (weight decay 0 on bias/norm), as Jia et al. 2018 and timm.

    ``weight_decay``: of the first group (``None``: the optimizer's own); an empty group is omitted.

    Examples:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8, 2))
        >>> [(g["name"], len(g["params"]), g.get("weight_decay")) for g in param_groups_without_decay(model, 5e-5)]
        [('decay', 2, 5e-05), ('no_decay', 4, 0.0)]

        In a LightningModule: ``torch.optim.SGD(param_groups_without_decay(self), lr=0.1,
        weight_decay=5e-5)`` in ``configure_optimizers``.
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
