"""lightning_fastscale: the large-batch, many-GPU ImageNet-in-minutes techniques for Lightning.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hier_ring")``
works; see DESIGN.md for what lives where.
"""
from .data import ImageFolderDataModule, ProceduralDataModule, ProceduralShapes
from .models import create_model, register_model
from .module import ImageClassifier
from .param_groups import is_excluded, split_parameters

__version__ = "0.1.0"

__all__ = [
    "ImageClassifier",
    "ImageFolderDataModule",
    "ProceduralDataModule",
    "ProceduralShapes",
    "create_model",
    "is_excluded",
    "register_model",
    "split_parameters",
]
