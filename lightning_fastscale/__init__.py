"""lightning_fastscale: the large-batch, many-GPU ImageNet-in-minutes techniques for Lightning.

The recipes of Goyal et al. 2017 (linear scaling, warmup, zero-init residual BN), You et al.
2017 (LARS), Jia et al. 2018 (mixed precision with LARS, no weight decay on bias/BN,
hierarchical all-reduce, two-segment fusion), Mikami et al. 2018 (batch-size control, label
smoothing, 2D-torus all-reduce), fast.ai 2018 (progressive resizing) and Tencent Cloud 2020
(half-precision wire, top-k compression), one technique per module:

* `strategies`: ``HierarchicalAllReduceStrategy`` (a DDP strategy);
* `precision`: ``LARSMixedPrecision`` and the ``LARS`` optimizer;
* `callbacks`: the recipe callbacks;
* `faults`: checkpoints, exact resume, preemption and the non-finite guard;
* [`planner`][lightning_fastscale.planner]: the communication cost model behind ``fastscale-plan``;
* `data`, `models`: built-in data and models.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="hier_ring")``
works. The user guide is in ``docs/``, the measured numbers in ``benchmarks/README.md``.

Examples:
    >>> import lightning_fastscale
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> [name for name in ("hier_ring", "hier_torus") if name in StrategyRegistry]
    ['hier_ring', 'hier_torus']
"""
from . import conf, strategies  # noqa: F401  (registers the configs' resolver; "hier_ring", "hier_torus" and _spawn variants)
from .callbacks import (
    BatchSizeRamp,
    LabelSmoothing,
    ProgressiveResizing,
    TimeToAccuracy,
    WarmupDecayLR,
    ZeroInitResidualBN,
)
from .data import ImageFolderDataModule, ProceduralDataModule, ProceduralShapes
from .diagnostics.doctor_probe import diagnose
from .models import create_model, register_model
from .module import ImageClassifier
from .param_groups import is_excluded, param_groups_without_decay, split_parameters
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
    "ProceduralDataModule",
    "ProceduralShapes",
    "ProgressiveResizing",
    "TimeToAccuracy",
    "WarmupDecayLR",
    "ZeroInitResidualBN",
    "create_model",
    "diagnose",
    "is_excluded",
    "param_groups_without_decay",
    "register_model",
    "split_parameters",
]
