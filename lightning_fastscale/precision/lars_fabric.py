"""``LARSFabricPrecision``: the LARS mixed-precision plugin (Jia et al. 2018) for Lightning Fabric loops."""
from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities.types import Optimizable
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from .lars_step import LARSStepMixin


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is True on any rank of the default process group."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flag
    t = torch.tensor([float(flag)], device=device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


class LARSFabricPrecision(LARSStepMixin, MixedPrecision):
    """Fabric precision plugin with the arguments of `LARSMixedPrecision`; save ``plugin.state_dict()`` yourself.

    Examples:
        >>> import lightning as L
        >>> fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LARSFabricPrecision("32-true", "cpu")])
        >>> model = torch.nn.Linear(4, 2)
        >>> model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        >>> fabric.backward(model(torch.randn(3, 4)).sum())
        >>> optimizer.step()
        >>> fabric.strategy.precision.skipped_steps
        0
    """

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Record which parameters LARS adapts; the module stays fp32 (the master weights)."""
        self.classify(module)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """Inputs unchanged, as under the Trainer (autocast casts them where it computes)."""
        return data

    @override
    def convert_output(self, data: Any) -> Any:
        """Floating outputs to the default dtype in the mixed modes (Fabric's AMP); unchanged in fp32."""
        return data if self.precision == "32-true" else super().convert_output(data)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale once per step (``fabric.clip_gradients`` calls this before the step does)."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Unscale, the LARS step (skip if non-finite on any rank), scaler update."""
        self.unscale_gradients(optimizer)  # type: ignore[arg-type]
        self._unscaled.discard(id(optimizer))
        device = next((p.grad.device for g in optimizer.param_groups for p in g["params"] if p.grad is not None),
                      torch.device("cpu"))
        out = self.lars_step(optimizer, lambda flag: _any_rank(flag, device), **kwargs)  # type: ignore[arg-type]
        self.update_scaler()
        return out
