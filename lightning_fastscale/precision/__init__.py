"""Precision: half-precision compute with fp32 master weights, loss scaling and LARS.

[`LARS`][lightning_fastscale.precision.LARS] is the optimizer (You et al. 2017);
[`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision] (Trainer) and
[`LARSFabricPrecision`][lightning_fastscale.precision.LARSFabricPrecision] (Fabric) are the
precision plugins of Jia et al. 2018 that apply LARS to a plain optimizer, in fp32, on the
unscaled gradients, and skip non-finite steps.
"""
from .lars import LARS, lars_rescale_
from .lars_fabric import LARSFabricPrecision
from .lars_mixed_precision import LARSMixedPrecision

__all__ = ["LARS", "LARSFabricPrecision", "LARSMixedPrecision", "lars_rescale_"]
