"""``LARSFabricPrecision``: the LARS precision plugin for Lightning Fabric loops.

The same step as the Trainer's [`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision]
(Jia et al. 2018: half-precision compute under ``torch.autocast``, fp32 master weights, loss
scaling, LARS of You et al. 2017 in fp32 on the unscaled gradient), through the shared
`LARSStep`, with Fabric's calling convention:
``fabric.backward(loss)`` scales the loss, ``optimizer.step()`` unscales, skips a non-finite
step on every rank, applies LARS and steps, then updates the scaler.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.types import Optimizable
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from .lars_step import LARSStep, agree_across_ranks

PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
_AUTOCAST_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def normalise_precision(precision: str, owner: str) -> str:
    """Lightning's precision string, or ``ValueError`` naming ``owner`` and the choices."""
    precision = _ALIASES.get(str(precision), str(precision))
    if precision not in PRECISIONS:
        raise ValueError(
            f"{owner}(precision={precision!r}) is not supported; use one of {PRECISIONS} "
            "('32' is accepted for '32-true')"
        )
    return precision


def check_device(device: str | None, precision: str, scaler: torch.amp.GradScaler | None, owner: str) -> str:
    """The autocast device type (default ``"cuda"`` when available), checked against the scaler."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"{owner}(device={device!r}) must be 'cuda' or 'cpu'")
    if scaler is not None and precision != "16-mixed":
        raise ValueError(f"{owner}(precision={precision!r}) uses no loss scaler (only '16-mixed' does); drop `scaler`")
    return device


def _to_default_float(t: Tensor) -> Tensor:
    return t.to(torch.get_default_dtype()) if torch.is_floating_point(t) else t


class LARSFabricPrecision(FabricPrecision):
    """Fabric precision plugin: autocast compute, fp32 master weights, loss scaling, LARS.

    ``Fabric(plugins=[LARSFabricPrecision("bf16-mixed")])`` with a plain momentum-SGD
    optimizer and an fp32 module; ``fabric.setup(model, optimizer)`` records which
    parameters LARS adapts (bias and norm parameters are not: the shared rule of
    [`lightning_fastscale.param_groups`][lightning_fastscale.param_groups], plus ``exclude``). Each ``optimizer.step()``
    unscales the gradients, skips the step on every rank if any rank's gradient is
    non-finite (the scaler backs off), else applies LARS and steps (fused into SGD's
    momentum update for ``torch.optim.SGD``), then updates the scaler. The Trainer's
    [`LARSMixedPrecision`][lightning_fastscale.precision.LARSMixedPrecision] hands Fabric's calls to this
    class, so passing that one to Fabric works too.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast + dynamic loss scaling), ``"bf16-mixed"``
            or ``"32-true"`` (no autocast).
        device: autocast/scaler device type, ``"cuda"`` or ``"cpu"`` (default: ``"cuda"``
            when CUDA is available).
        eta, eps, trust_clip, exclude: LARS options, see
            `LARSStep`.
        scaler: a ``torch.amp.GradScaler`` for ``"16-mixed"`` (one is made otherwise).

    Examples:
        >>> import lightning as L
        >>> import torch
        >>> fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LARSFabricPrecision("32-true", "cpu")])
        >>> model = torch.nn.Linear(4, 2)
        >>> model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        >>> fabric.backward(model(torch.randn(3, 4)).sum())
        >>> optimizer.step()
        >>> fabric.strategy.precision.lars.skipped_steps
        0
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str | None = None,
        *,
        eta: float = 1e-3,
        eps: float = 1e-8,
        trust_clip: bool = False,
        exclude: Sequence[str] = (),
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        precision = normalise_precision(precision, type(self).__name__)
        device = check_device(device, precision, scaler, type(self).__name__)
        if scaler is None and precision == "16-mixed":
            scaler = torch.amp.GradScaler(device)
        self._setup(precision, device, scaler, LARSStep(eta=eta, eps=eps, trust_clip=trust_clip, exclude=exclude))

    def _setup(self, precision: str, device: str, scaler: torch.amp.GradScaler | None, lars: LARSStep) -> None:
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler = scaler
        self.lars = lars
        self._unscaled: set[int] = set()

    @classmethod
    def sharing(
        cls, lars: LARSStep, precision: str, device: str, scaler: torch.amp.GradScaler | None
    ) -> LARSFabricPrecision:
        """A plugin over an existing ``LARSStep`` and scaler (the Trainer plugin's, under Fabric)."""
        plugin = cls.__new__(cls)
        plugin._setup(precision, device, scaler, lars)
        return plugin

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Record which parameters LARS adapts; the module stays fp32 (the master weights)."""
        self.lars.classify(module)
        return module

    @override
    def forward_context(self) -> AbstractContextManager:
        """``torch.autocast`` for the mixed modes; nothing for ``"32-true"``."""
        if self.precision == "32-true":
            return nullcontext()
        return torch.autocast(self.device, dtype=_AUTOCAST_DTYPES[self.precision])

    @override
    def convert_output(self, data: Any) -> Any:
        """Floating outputs back to the default dtype, as Fabric's own mixed precision does, so
        a loss computed outside the forward is fp32 (inputs are left alone: autocast casts)."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_to_default_float, dtype=Tensor)

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward of the loss, scaled under ``"16-mixed"``."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale once per step (``fabric.clip_gradients`` calls this before the step does)."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Unscale, skip if non-finite on any rank, else LARS and ``optimizer.step``; scaler update."""
        if isinstance(optimizer, LBFGS):
            raise TypeError("LARSFabricPrecision does not support LBFGS (a closure-driven line search)")
        if not self.lars.classified:
            raise RuntimeError(
                "LARSFabricPrecision: the model was not set up; call fabric.setup(model, optimizer) "
                "(or fabric.setup_module(model)) so the plugin knows which parameters LARS adapts"
            )
        self.unscale_gradients(optimizer)  # type: ignore[arg-type]
        self._unscaled.discard(id(optimizer))
        if not self.lars.is_validated(optimizer):  # type: ignore[arg-type]
            self.lars.validate(optimizer)  # type: ignore[arg-type]
        device = next((p.grad.device for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)
        agree = None if device is None else (lambda flag: agree_across_ranks(flag, device))
        out = self.lars.step(optimizer, agree=agree, **kwargs)  # type: ignore[arg-type]
        if self.scaler is not None:
            self.scaler.update()
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        """Loss-scaler state and the skip counters (put it in ``fabric.save``'s state)."""
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None, **self.lars.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what [`state_dict`][lightning_fastscale.precision.LARSFabricPrecision.state_dict] saved."""
        if self.scaler is not None and state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        self.lars.load_state_dict(state_dict)
