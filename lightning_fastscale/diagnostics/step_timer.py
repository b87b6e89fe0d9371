"""Per-rank timing of optimizer steps, split into the parts of `PHASES`.

[`StepTimer`][lightning_fastscale.diagnostics.step_timer.StepTimer] takes time stamps ("marks")
at a step's boundaries and a post-accumulate-grad hook marks the last gradient, so the time
from it to the end of backward is the exposed all-reduce; on CUDA the parts are CUDA event
intervals read every N steps, never per step. Why and how: ``docs/step_breakdown.md``.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_fastscale.diagnostics.step_breakdown import PHASES

MARKS: tuple[str, ...] = ("batch_start", "before_backward", "last_grad", "after_backward", "before_optimizer", "end")


@dataclass
class StepTimes:
    """One finished optimizer step of one rank: ``seconds`` per part, samples and images."""

    step: int
    seconds: dict[str, float]
    samples: float = 0.0
    images: float | None = None

    @property
    def total_s(self) -> float:
        """The step time: the sum of the parts."""
        return sum(self.seconds.values())


@dataclass
class _Pending:
    step: int
    events: dict[str, Any]
    origin_event: Any
    input_s: float
    samples: float
    images: float | None
    batches: list[dict[str, float]] = field(default_factory=list)


def _split(times: dict[str, float], origin: float, input_s: float, out: dict[str, float]) -> None:
    """Add the parts of one batch (mark -> time stamp) into ``out``."""
    prev = origin
    for mark in MARKS:
        if mark not in times:
            continue
        dt = max(0.0, times[mark] - prev)
        if mark == "batch_start":
            inp = min(dt, input_s)
            out["input"] += inp
            out["rest"] += dt - inp
        elif mark in ("before_backward", "last_grad"):
            out["compute"] += dt
        elif mark == "after_backward":
            # without a gradient mark (no parameter got a gradient) backward is compute
            out["communication" if "last_grad" in times else "compute"] += dt
        elif mark == "before_optimizer":
            out["rest"] += dt
        else:  # end
            out["optimizer" if "before_optimizer" in times else "rest"] += dt
        prev = times[mark]


class StepTimer:
    """Marks step boundaries on one rank and yields [`StepTimes`][lightning_fastscale.diagnostics.step_timer.StepTimes] per optimizer step.

    `attach` the parameters once; per step `mark` each boundary (`MARKS`), `add_input` the host's
    fetch / copy seconds and `end_batch`; `reset_origin` after anything that is not training.
    `drain` returns the finished steps.

    Example:
        >>> timer = StepTimer(torch.device("cpu"))
        >>> timer.reset_origin()
        >>> for mark in ("batch_start", "before_backward", "after_backward", "end"):
        ...     timer.mark(mark)
        >>> timer.end_batch(samples=8)
        >>> (step,) = timer.drain()
        >>> step.samples, sorted(step.seconds) == sorted(PHASES)
        (8.0, True)
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self._handles: list[Any] = []
        self._pending: list[_Pending] = []
        self.steps = 0  # optimizer steps finished so far
        self._last_param: nn.Parameter | None = None
        self._grad_t = 0.0
        self._grad_index = -1
        self._grad_event: Any = None
        self._open: _Pending | None = None
        self._params: list[nn.Parameter] = []
        self.reset_origin()

    def attach(self, parameters: Iterable[nn.Parameter]) -> None:
        """Put a post-accumulate-grad hook on every parameter that requires a gradient."""
        self.detach()
        params = [p for p in parameters if p.requires_grad]
        # gradients usually arrive in reverse module order: guess the first parameter is last
        self._last_param = params[0] if params else None
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_hook(i)) for i, p in enumerate(params)]
        self._params = params

    def detach(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _grad_hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._grad_t = time.perf_counter()
            self._grad_index = index
            if self.cuda and param is self._last_param:
                self._grad_event = self._event()
        return hook

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def reset_origin(self) -> None:
        """Start timing from now: time before this point is not part of any step."""
        self._start(time.perf_counter(), self._event() if self.cuda else None)

    def _start(self, origin_t: float, origin_event: Any) -> None:
        self._origin_t, self._origin_event = origin_t, origin_event
        self._input_s = 0.0
        self._grad_index = -1
        self._times: dict[str, float] = {}
        self._events: dict[str, Any] = {}
        self._grad_t = 0.0
        self._grad_event = None

    def mark(self, name: str) -> None:
        """Time stamp (and on CUDA an event) for the boundary ``name`` of `MARKS`."""
        if name not in MARKS:
            raise ValueError(f"unknown step mark {name!r}; expected one of {MARKS}")
        if name == "after_backward" and self._grad_t > self._times.get("batch_start", self._origin_t):
            self._times["last_grad"] = self._grad_t
            if self._grad_event is not None:
                self._events["last_grad"] = self._grad_event
        self._times[name] = time.perf_counter()
        if self.cuda:
            self._events[name] = self._event()

    def add_input(self, seconds: float) -> None:
        """Host seconds spent fetching or copying the coming batch (counted as ``input``)."""
        self._input_s += seconds

    def end_batch(self, samples: float = 0.0, images: float | None = None, optimizer_stepped: bool = True,
                  step: int | None = None) -> None:
        """Close the batch; the step ends with the batch whose optimizer stepped (``step``: its number to report)."""
        if "end" not in self._times:
            self.mark("end")
        batch = {"origin": self._origin_t, "input_s": self._input_s, **self._times}
        if self._open is None:
            self._open = _Pending(self.steps, {}, self._origin_event, 0.0, 0.0, None)
        pending = self._open
        pending.batches.append(batch)
        pending.events = dict(self._events)  # CUDA: the step's GPU interval is origin -> last end
        pending.input_s += self._input_s
        pending.samples += samples
        if images is not None:
            pending.images = (pending.images or 0.0) + images
        end_t, end_event = self._times["end"], self._events.get("end")
        if self._grad_index >= 0 and self._params:
            self._last_param = self._params[self._grad_index]  # the last gradient of this step
            if optimizer_stepped and len(self._handles) > 1:  # keep one hook: one per parameter costs every backward
                self.detach()
                hook = self._grad_hook(self._grad_index)
                self._handles.append(self._last_param.register_post_accumulate_grad_hook(hook))
        self._start(end_t, end_event)  # the next batch starts where this one ended
        if optimizer_stepped:
            if step is not None:
                pending.step = step
            self._pending.append(pending)
            self._open = None
            self.steps += 1

    def _finish(self, p: _Pending) -> StepTimes:
        seconds = dict.fromkeys(PHASES, 0.0)
        for batch in p.batches:
            times = {k: v for k, v in batch.items() if k in MARKS}
            _split(times, batch["origin"], batch["input_s"], seconds)
        if self.cuda and len(p.batches) == 1 and p.origin_event is not None:
            # parts from the events (GPU timeline); ``input`` capped by the host's fetch time
            seconds = dict.fromkeys(PHASES, 0.0)
            _split({k: p.origin_event.elapsed_time(e) / 1e3 for k, e in p.events.items() if k in MARKS}, 0.0,
                   p.input_s, seconds)
        return StepTimes(p.step, seconds, p.samples, p.images)

    def drain(self, block: bool = False) -> list[StepTimes]:
        """Finished steps since the last call, in order (CUDA: ``block`` waits for the events)."""
        out = []
        while self._pending:
            p = self._pending[0]
            if self.cuda:
                end = p.events.get("end")
                if end is not None and not end.query():
                    if not block:
                        break
                    end.synchronize()
            out.append(self._finish(self._pending.pop(0)))
        return out
