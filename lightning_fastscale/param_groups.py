"""The one rule that decides which parameters are "bias/BN-like".

Jia et al. 2018 (Tencent, "Highly Scalable Deep Learning Training System with
Mixed-Precision: Training ImageNet in Four Minutes") removed weight decay from the bias and
the batch-norm beta/gamma (+1.3% top-1 for AlexNet at batch 64K); the MLPerf LARS reference
likewise gives these parameters neither weight decay nor LARS adaptation. Every component of
this package that needs the distinction (``NoWeightDecayOnBiasNorm``, ``LARSMixedPrecision``, the
``LARS`` optimizer) asks [`is_excluded`][lightning_fastscale.param_groups.is_excluded]; none re-implements it.

The rule: a parameter is excluded when it has ``ndim <= 1`` (biases, norm-layer affine
parameters, scalars such as layer-scale gammas), when it belongs to a normalisation layer
(BatchNorm/GroupNorm/LayerNorm/InstanceNorm/LocalResponseNorm, whatever its shape), or when
its qualified name matches one of the user's extra glob patterns.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

NORM_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)


def _norm_parameter_ids(module: nn.Module) -> set[int]:
    ids: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, NORM_LAYER_TYPES) or type(sub).__name__.lower().endswith("norm"):
            ids.update(id(p) for p in sub.parameters(recurse=False))
    return ids


def is_excluded(
    name: str,
    param: nn.Parameter,
    *,
    in_norm_layer: bool = False,
    extra_patterns: Sequence[str] = (),
) -> bool:
    """Whether ``param`` (qualified ``name``) gets no weight decay and no LARS adaptation.

    Args:
        name: the parameter's qualified name, as ``named_parameters()`` gives it.
        param: the parameter itself.
        in_norm_layer: whether it belongs to a normalisation layer.
        extra_patterns: glob patterns on the name (``fnmatch``) that also exclude.
    """
    if param.ndim <= 1 or in_norm_layer:
        return True
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in extra_patterns)


def split_parameters(
    module: nn.Module, extra_patterns: Sequence[str] = ()
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """Split ``module``'s trainable parameters into (adapted, excluded) by the shared rule.

    Order within each list follows ``module.named_parameters()``, so the split is
    deterministic and a checkpoint's optimizer state lines up on resume.
    """
    norm_ids = _norm_parameter_ids(module)
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
