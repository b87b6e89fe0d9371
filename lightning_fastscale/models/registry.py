"""Model factory modelled on timm's ``create_model``: this package's models, then timm, then torchvision."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from lightning_fastscale._validation import positive_int

from .pretrained import load_pretrained_weights

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


def create_model(name: str, num_classes: int, pretrained: bool | str | Path = False, **kwargs: Any) -> nn.Module:
    """Build model ``name`` with ``num_classes`` outputs (``docs/hydra.md``, "Model options").

    ``pretrained``: ``False`` (random), ``True`` (timm's or torchvision's weights) or a local file.
    """
    positive_int("num_classes", num_classes)
    from_file = not isinstance(pretrained, bool)
    library_weights = pretrained is True
    if name in _OWN_MODELS:
        if library_weights:
            raise ValueError(
                f"pretrained=True: {name!r} is this package's own model and has no published "
                "weights; give a local weights file (pretrained='/path/to/weights.pth') or False"
            )
        model = _OWN_MODELS[name](num_classes=num_classes, **kwargs)
    elif name.startswith("torchvision."):
        model = _torchvision_model(name.removeprefix("torchvision."), num_classes, library_weights, kwargs)
    else:
        import timm

        if timm.is_model(name):
            model = _timm_model(name, num_classes, library_weights, kwargs)
        else:
            import torchvision

            if name not in torchvision.models.list_models():
                raise ValueError(
                    f"unknown model {name!r}: not one of this package's models ({', '.join(own_model_names())}), "
                    "not a timm model (timm.list_models()) and not a torchvision model "
                    "(torchvision.models.list_models()); give one of those names")
            model = _torchvision_model(name, num_classes, library_weights, kwargs)
    return load_pretrained_weights(model, pretrained) if from_file else model


def _fetch_error(name: str, source: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"pretrained=True: could not get the {source} weights of {name!r} ({type(error).__name__}: "
        f"{error}). Without network they must already be in the {source} cache; otherwise download them "
        "once where there is network, or pass a local file (pretrained='/path/to/weights.pth'), "
        "or train from scratch (pretrained=False)"
    )


def _timm_model(name: str, num_classes: int, pretrained: bool, kwargs: dict[str, Any]) -> nn.Module:
    import timm

    kwargs.pop("pretrained", None)
    try:
        return timm.create_model(name, pretrained=pretrained, num_classes=num_classes, **kwargs)
    except (OSError, RuntimeError, ValueError) as error:  # offline hub / missing file / no weights
        if not pretrained:
            raise
        raise _fetch_error(name, "timm (Hugging Face Hub)", error) from error


def _torchvision_model(name: str, num_classes: int, pretrained: bool, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision

    weights = kwargs.pop("weights", None)
    if weights in (None, "None"):
        weights = "DEFAULT" if pretrained else None
    if weights is None:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    available = torchvision.models.get_model_weights(name)
    classes = len(available[str(weights)].meta["categories"])  # "DEFAULT" is an alias of the enum
    if classes != num_classes:
        raise ValueError(
            f"pretrained=True: torchvision's {name} weights have {classes} classes, not {num_classes}; "
            "use the timm model of that name (it re-initialises the head) or a local weights file"
        )
    try:
        return torchvision.models.get_model(name, weights=weights, num_classes=num_classes, **kwargs)
    except (OSError, RuntimeError) as error:  # URLError is an OSError
        raise _fetch_error(name, "torchvision (torch.hub)", error) from error
