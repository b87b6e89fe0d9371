"""The Hydra configs of ``fastscale-train`` (``pkg://lightning_fastscale.conf``) and their resolver.

Importing the package (``import lightning_fastscale`` does) registers ``autocast_device``, which
the precision group uses, so the configs resolve wherever they are composed.
"""
from __future__ import annotations

import torch
from omegaconf import OmegaConf


def autocast_device(accelerator: str) -> str:
    """``torch.autocast``'s device type for the Trainer's ``accelerator``, as Lightning picks it.

    The precision group's resolver (``${autocast_device:${trainer.accelerator}}``): a precision
    plugin is built before the Trainer, so it is told the device type the Trainer will run on.
    ``"auto"`` is CUDA when a GPU is visible, else Apple's MPS when present, else the CPU.
    """
    if accelerator in ("cpu", "mps"):
        return accelerator
    if accelerator == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    return "cuda"


OmegaConf.register_new_resolver("autocast_device", autocast_device, replace=True)
