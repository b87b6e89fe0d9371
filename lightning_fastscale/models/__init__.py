"""Models: a factory over this package's models, timm and torchvision (``create_model``)."""
from . import alexnet_bn, resnet_small  # noqa: F401  (register their models)
from .registry import create_model, own_model_names, register_model

__all__ = ["create_model", "own_model_names", "register_model"]
