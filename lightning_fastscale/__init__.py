"""lightning_fastscale: the large-batch, many-GPU ImageNet-in-minutes techniques for Lightning.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hier_ring")``
works. Each technique lives in its own module, citing its paper; the user guide is in
``docs/`` and the measured numbers in ``benchmarks/README.md``.
"""
from . import strategies  # noqa: F401  (registers "hier_ring", "hier_torus" and _spawn variants)
from .callbacks import (
    BatchSizeRamp,
    LabelSmoothing,
    NoWeightDecayOnBiasNorm,
    ProgressiveResizing,
    WarmupDecayLR,
    ZeroInitResidualBN,
)
from .data import ImageFolderDataModule, ProceduralDataModule, ProceduralShapes
from .models import create_model, register_model
from .module import ImageClassifier
from .param_groups import is_excluded, split_parameters
from .precision import LARS, LARSMixedPrecision
from .strategies import HierarchicalAllReduceStrategy

__version__ = "0.1.0"

__all__ = [
    "BatchSizeRamp",
    "HierarchicalAllReduceStrategy",
    "ImageClassifier",
    "ImageFolderDataModule",
    "LARS",
    "LARSMixedPrecision",
    "LabelSmoothing",
    "NoWeightDecayOnBiasNorm",
    "ProceduralDataModule",
    "ProceduralShapes",
    "ProgressiveResizing",
    "WarmupDecayLR",
    "ZeroInitResidualBN",
    "create_model",
    "is_excluded",
    "register_model",
    "split_parameters",
]
