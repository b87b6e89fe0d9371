"""The Hydra configs of ``fastscale-train`` (``pkg://lightning_fastscale.conf``) and their resolvers.

Importing the package (``import lightning_fastscale`` does) registers ``autocast_device``, which
the precision group uses, and ``sweep_run_name`` / ``sweep_group``, which name the W&B runs of a
sweep, so the configs resolve wherever they are composed.
"""
from __future__ import annotations

from typing import Any

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


def _multirun() -> Any:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get() if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN else None


def sweep_run_name(default: str) -> str:
    """In a multirun, the job's overrides (``optimizer.lr=0.05,seed=1``); otherwise ``default``."""
    hydra = _multirun()
    return (hydra.job.override_dirname or default) if hydra is not None else default


def sweep_group() -> str | None:
    """In a multirun, the sweep's folder (every job of a sweep in one W&B group); otherwise ``None``."""
    hydra = _multirun()
    return str(hydra.sweep.dir) if hydra is not None else None


OmegaConf.register_new_resolver("autocast_device", autocast_device, replace=True)
OmegaConf.register_new_resolver("sweep_run_name", sweep_run_name, replace=True)
OmegaConf.register_new_resolver("sweep_group", sweep_group, replace=True)
