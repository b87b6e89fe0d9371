"""Model factory: this package's own models by name, then timm, then torchvision.

Modelled on timm's ``create_model``: one call builds any supported architecture with a given
number of classes, so Hydra configs and scripts name models instead of importing them. No
pretrained weights are ever fetched: training from scratch is what the large-batch recipes
(Goyal et al. 2017; Jia et al. 2018) measure, and runs must work offline.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_fastscale._validation import positive_int

_OWN_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering ``factory(num_classes=..., **kwargs) -> nn.Module`` under ``name``."""

    def decorate(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _OWN_MODELS and _OWN_MODELS[name] is not factory:
            raise ValueError(f"model name {name!r} is already registered")
        _OWN_MODELS[name] = factory
        return factory

    return decorate


def own_model_names() -> list[str]:
    """Names of the models this package defines itself."""
    return sorted(_OWN_MODELS)


def create_model(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
    """Build model ``name`` with ``num_classes`` outputs and random initial weights.

    Lookup order: this package's registry, timm (``timm.create_model``), torchvision
    (``torchvision.models.get_model``; a ``torchvision.`` prefix forces it). An unknown name
    raises ``ValueError`` listing where it was looked for.
    """
    positive_int("model.num_classes", num_classes)
    if name in _OWN_MODELS:
        return _OWN_MODELS[name](num_classes=num_classes, **kwargs)
    if name.startswith("torchvision."):
        return _torchvision_model(name.removeprefix("torchvision."), num_classes, kwargs)
    import timm

    if timm.is_model(name):
        if kwargs.pop("pretrained", False):
            raise ValueError("pretrained weights are not supported: runs must work offline")
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
    import torchvision

    if name in torchvision.models.list_models():
        return _torchvision_model(name, num_classes, kwargs)
    raise ValueError(
        f"unknown model {name!r}: not one of this package's models ({', '.join(own_model_names())}), "
        "not a timm model (timm.list_models()) and not a torchvision model "
        "(torchvision.models.list_models()); set model.name to one of those"
    )


def _torchvision_model(name: str, num_classes: int, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision

    if kwargs.get("weights") not in (None, "None"):
        raise ValueError("pretrained weights are not supported: runs must work offline")
    kwargs.pop("weights", None)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
