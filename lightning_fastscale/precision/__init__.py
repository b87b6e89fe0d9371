"""Precision: half-precision compute with fp32 master weights, loss scaling and LARS.

[`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision] is the Lightning precision plugin (Jia et al. 2018), built as
`LARSAutocastPrecision` (16/bf16 autocast) or `LARSFP32Precision` (fp32);
[`LARSFabricPrecision`][lightning_fastscale.precision.LARSFabricPrecision] is its Fabric counterpart; both share `LARSStep`.
`lars` holds the LARS math (You et al. 2017) as functions over tensor lists and as a
plain torch optimizer, [`LARS`][lightning_fastscale.precision.LARS].
"""
from .lars import LARS, foreach_norms, lars_rescale_, lars_sgd_, trust_ratios
from .lars_fabric import LARSFabricPrecision
from .lars_mixed_precision import LARSAutocastPrecision, LARSFP32Precision, LARSMixedPrecision
from .lars_step import LARSStep

__all__ = [
    "LARS",
    "LARSAutocastPrecision",
    "LARSFP32Precision",
    "LARSFabricPrecision",
    "LARSMixedPrecision",
    "LARSStep",
    "foreach_norms",
    "lars_rescale_",
    "lars_sgd_",
    "trust_ratios",
]
