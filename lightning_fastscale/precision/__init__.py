"""Precision: the LARS optimizer (You et al. 2017) and the LARS mixed-precision plugins of Jia et al. 2018
(Trainer and Fabric): fp32 master weights, loss scaling, LARS on the unscaled gradients.
"""
from .lars import LARS, lars_rescale_
from .lars_fabric import LARSFabricPrecision
from .lars_mixed_precision import LARSMixedPrecision

__all__ = ["LARS", "LARSFabricPrecision", "LARSMixedPrecision", "lars_rescale_"]
