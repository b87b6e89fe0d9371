"""Precision: half-precision compute with fp32 master weights, loss scaling and LARS.

:class:`LARSMixedPrecision` is the Lightning precision plugin (Jia et al. 2018);
:mod:`.lars` holds the LARS math (You et al. 2017) as functions over tensor lists and as a
plain torch optimizer, :class:`LARS`.
"""
from .lars import LARS, foreach_norms, lars_rescale_, lars_sgd_, trust_ratios
from .lars_mixed_precision import LARSMixedPrecision

__all__ = ["LARS", "LARSMixedPrecision", "foreach_norms", "lars_rescale_", "lars_sgd_", "trust_ratios"]
