"""The LARS step (You et al. 2017) shared by the Trainer and Fabric plugins (Jia et al. 2018)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from ..param_groups import is_excluded, split_parameters, validate_patterns
from .lars import LARS, check_lars_options, foreach_norms, lars_update_

log = logging.getLogger(__name__)

_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")


class LARSStepMixin:
    """The LARS step for a Lightning precision plugin; put it before Lightning's ``MixedPrecision``
    (Trainer's or Fabric's) in the bases. ``"32-true"`` sets up no autocast and no scaler.

    Attributes:
        skipped_steps: steps skipped for non-finite gradients, in total (saved in checkpoints).
        consecutive_skipped_steps: steps skipped in a row up to now (0 after an applied step).
        last_step_skipped: whether the most recent step was skipped.
    """

    precision: str
    scaler: torch.amp.GradScaler | None

    def __init__(
        self, precision: str = "bf16-mixed", device: str | None = None, *, eta: float = 1e-3, eps: float = 1e-8,
        trust_clip: bool = False, exclude: Sequence[str] = (), scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        name = type(self).__name__
        precision = "32-true" if str(precision) == "32" else str(precision)  # as Trainer(precision=32)
        if precision not in _PRECISIONS:
            raise ValueError(f"{name}(precision={precision!r}) is not supported; use one of {_PRECISIONS} ('32' is '32-true')")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"{name}(device={device!r}) must be 'cuda' or 'cpu'")
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"{name}(precision={precision!r}) uses no loss scaler (only '16-mixed' does); drop `scaler`")
        check_lars_options(eta, eps)
        if precision == "32-true":
            self.precision, self.device, self.scaler = precision, device, None
            self._desired_input_dtype = torch.float32  # the compute dtype Lightning's throughput utilities read
        else:
            super().__init__(precision, device, scaler)  # type: ignore[call-arg]
        self.eta, self.eps, self.trust_clip, self.exclude = eta, eps, trust_clip, validate_patterns(exclude)
        self.skipped_steps = self.consecutive_skipped_steps = 0
        self.last_step_skipped = False
        self._excluded: set[int] | None = None  # ids of the set-up module's parameters LARS leaves alone
        self._validated: set[int] = set()
        self._hidden: dict[int, list[tuple[Tensor, Tensor]]] = {}  # gradients held while SGD's step runs
        self._unscaled: set[int] = set()  # optimizers Fabric's clip_gradients unscaled ahead of the step

    @override
    def forward_context(self) -> AbstractContextManager:
        """Lightning's autocast in the mixed modes; none for ``"32-true"``."""
        return nullcontext() if self.precision == "32-true" else super().forward_context()  # type: ignore[misc]

    def classify(self, module: nn.Module) -> None:
        """Record which of ``module``'s parameters LARS adapts (the bias/norm rule plus ``exclude``)."""
        self._excluded = {id(p) for _, p in split_parameters(module, self.exclude)[1]}

    def _adapts(self, p: Tensor) -> bool:
        return id(p) not in self._excluded and not is_excluded("", p)  # type: ignore[operator]

    def validate(self, optimizer: Optimizer) -> None:
        """Refuse what LARS cannot serve; warn about decayed bias/norm parameters."""
        name = type(self).__name__
        if isinstance(optimizer, LBFGS):
            raise TypeError(f"{name} does not support LBFGS (a closure-driven line search)")
        if isinstance(optimizer, LARS):
            raise ValueError(f"{name} would apply LARS a second time on top of the LARS optimizer; use a plain "
                             "optimizer (torch.optim.SGD), or LARS with Lightning's own precision")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if params and not any(self._adapts(p) for p in params):
            raise ValueError(f"{name}(exclude={self.exclude!r}): the bias/norm rule plus these patterns exclude all "
                             f"{len(params)} parameters, so LARS would do nothing; narrow `exclude`")
        low = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
        if low:
            raise ValueError(f"{name} keeps fp32 master weights, but the model has {low} parameters (e.g. after "
                             "`.half()`); keep the module in fp32: autocast does the half-precision compute")
        for group in optimizer.param_groups:
            if group.get("weight_decay") and (isinstance(optimizer, torch.optim.AdamW)
                                              or group.get("decoupled_weight_decay")):
                raise ValueError(f"{name} folds weight decay into the gradient (L2, as LARS defines it), which would "
                                 f"change {type(optimizer).__name__}'s decoupled decay; use SGD, or weight_decay=0")
        decayed = sum(1 for g in optimizer.param_groups if g.get("weight_decay") for p in g["params"]
                      if not self._adapts(p))
        if decayed:
            rank_zero_warn(f"{name}: {decayed} parameters that LARS excludes (bias/norm) are in groups with weight "
                           "decay, so they are still decayed (Jia et al. 2018 decay neither); build the groups "
                           "with lightning_fastscale.param_groups")
        if type(optimizer) is torch.optim.SGD:  # registered now, so before any post-hook the user adds later
            optimizer.register_step_post_hook(self._restore_grads)
        self._validated.add(id(optimizer))

    def lars_step(self, optimizer: Optimizer, agree: Callable[[bool], bool] | None = None, **kwargs: Any) -> Any:
        """On unscaled gradients: skip if non-finite on any rank (``agree``), else ``g <- r * (g + wd * w)``
        and ``optimizer.step(**kwargs)`` with weight decay 0; ``None`` for a skipped step.

        Around a plain ``torch.optim.SGD`` it runs in one pass from a step pre-hook (method card).
        """
        if self._excluded is None:
            raise RuntimeError(f"{type(self).__name__}: no module set up; call classify(module), or in Fabric "
                               "fabric.setup(model, optimizer) (or fabric.setup_module), before the first step")
        if id(optimizer) not in self._validated:
            self.validate(optimizer)
        groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                groups.append((group, params, foreach_norms([p.grad for p in params])))
        nonfinite = bool(groups) and not bool(torch.cat([n for *_, n in groups]).isfinite().all())
        self.last_step_skipped = agree(nonfinite) if agree is not None else nonfinite
        if self.last_step_skipped:
            self.skipped_steps += 1
            self.consecutive_skipped_steps += 1
            log.info("LARS: non-finite gradient on %s, step skipped (%d in a row, %d in total)",
                     "this rank" if nonfinite else "another rank", self.consecutive_skipped_steps, self.skipped_steps)
            return None
        self.consecutive_skipped_steps = 0
        # a subclass may change the update; closure, maximize, differentiable and fused modes are SGD's own
        one_pass = type(optimizer) is torch.optim.SGD and "closure" not in kwargs and not any(
            g["maximize"] or g["differentiable"] or g.get("fused") or any(p.grad.is_sparse for p in ps)
            for g, ps, _ in groups)
        decays = [group.get("weight_decay", 0.0) for group, _, _ in groups]

        def rescale(*_: Any) -> None:
            for (group, params, g_norms), wd in zip(groups, decays):
                adapt = [self._adapts(p) for p in params]
                bufs = None  # only rescale, unless SGD's update runs here too
                if one_pass:  # (without momentum, SGD keeps no state: reading optimizer.state would add some)
                    bufs = [optimizer.state[p].get("momentum_buffer") if group["momentum"] else None for p in params]
                if bufs is None and not wd and not any(adapt):
                    continue  # every ratio 1 and no decay: nothing to rescale
                lars_update_(params, [p.grad for p in params], bufs, lr=float(group["lr"]), weight_decay=wd,
                             eta=self.eta, eps=self.eps, trust_clip=self.trust_clip, adapt=adapt, g_norms=g_norms,
                             momentum=group.get("momentum", 0.0), dampening=group.get("dampening", 0.0),
                             nesterov=group.get("nesterov", False))
                for p, buf in zip(params, bufs or ()):  # SGD's own update then finds no gradients
                    if buf is not None:
                        optimizer.state[p]["momentum_buffer"] = buf
                    self._hidden.setdefault(id(optimizer), []).append((p, p.grad))
                    p.grad = None

        if not one_pass:
            rescale()
        handle = optimizer.register_step_pre_hook(rescale) if one_pass else None
        try:
            for (group, _, _), wd in zip(groups, decays):
                if wd:
                    group["weight_decay"] = 0.0
            return optimizer.step(**kwargs)
        finally:
            for (group, _, _), wd in zip(groups, decays):
                if wd:
                    group["weight_decay"] = wd
            if handle is not None:
                handle.remove()
            self._restore_grads(optimizer)

    def update_scaler(self) -> None:
        """``scaler.update()`` on the skip decision every rank agreed on, not on this rank's own inf check.

        A step skipped for another rank's non-finite gradient backs off here too (scale times the backoff
        factor, growth count 0, as `torch.amp.GradScaler` does on an overflow), so the loss scale and
        its growth count stay equal on every rank.
        """
        if self.scaler is None:
            return
        state = self.scaler.state_dict() if self.last_step_skipped else None
        self.scaler.update()  # also clears this step's per-optimizer inf checks
        if state:
            self.scaler.load_state_dict({**state, "scale": state["scale"] * state["backoff_factor"],
                                         "_growth_tracker": 0})

    def _restore_grads(self, optimizer: Optimizer, *_: Any) -> None:
        """Give back the gradients held during SGD's step (a step post-hook)."""
        for p, g in self._hidden.pop(id(optimizer), ()):
            p.grad = g

    @override
    def state_dict(self) -> dict[str, Any]:
        """Loss-scaler state and the skip counters."""
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "skipped_steps": self.skipped_steps, "consecutive_skipped_steps": self.consecutive_skipped_steps,
                "last_step_skipped": self.last_step_skipped}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` saved."""
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = state_dict["skipped_steps"]
        self.consecutive_skipped_steps = state_dict["consecutive_skipped_steps"]
        self.last_step_skipped = state_dict["last_step_skipped"]
