"""Gradient profile of a model: gradient sizes in backward order and estimated backward time.

More in ``docs/planner.md`` ("Workload profiles").
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class GradientProfile:
    """Per-gradient ``names``, ``grad_bytes`` and ``backward_s`` in backward order, and one step's forward time."""

    names: tuple[str, ...]
    grad_bytes: tuple[int, ...]
    backward_s: tuple[float, ...]
    forward_s: float

    @property
    def numel(self) -> int:
        """Gradient elements (fp32: ``total_bytes / 4``)."""
        return sum(self.grad_bytes) // 4

    @property
    def backward_total_s(self) -> float:
        """Backward compute time of one step."""
        return float(sum(self.backward_s))


class _BertEncoder(nn.Module):
    """A BERT-shaped encoder (Devlin et al. 2019): only its parameter shapes and FLOPs matter."""

    def __init__(self, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.word = nn.Embedding(30522, hidden)
        self.position = nn.Embedding(512, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.norm(self.word(tokens) + self.position(positions) + self.token_type(torch.zeros_like(tokens)))
        return self.pooler(self.encoder(x)[:, 0])


_BUILTIN = {"bert_large": (24, 1024, 16), "bert_base": (12, 768, 12)}


def build_model(name: str) -> tuple[nn.Module, bool]:
    """Build ``name`` (BERT shape, package factory, torchvision, timm) on the meta device; and whether it takes tokens."""
    with torch.device("meta"):
        if name in _BUILTIN:
            return _BertEncoder(*_BUILTIN[name]), True
        errors = []
        try:
            from lightning_fastscale.models import create_model

            return create_model(name, num_classes=1000), False
        except Exception as err:  # the factory may not know the name; try the next source
            errors.append(f"lightning_fastscale.models: {err}")
        import torchvision

        try:
            return torchvision.models.get_model(name, weights=None), False
        except Exception as err:
            errors.append(f"torchvision: {err}")
        try:
            import timm

            return timm.create_model(name, pretrained=False), False
        except Exception as err:
            errors.append(f"timm: {err}")
    raise ValueError(f"model {name!r} not found ({'; '.join(errors)}); built-in: {sorted(_BUILTIN)}")


def _own_flops(model: nn.Module, counts: dict[str, dict]) -> dict[str, float]:
    """FLOPs of each module without its children's (taken off the nearest counted ancestor)."""
    total = {}
    root = type(model).__name__
    for key, ops in counts.items():
        if key == root or key.startswith(root + "."):
            total[key[len(root) + 1:]] = float(sum(ops.values()))
    own = dict(total)
    for name, flops in total.items():
        if not name:
            continue
        parent = name
        while parent:
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
            if parent in total:
                own[parent] -= flops
                break
    return {name: max(0.0, flops) for name, flops in own.items()}


def profile_model(name: str, batch: int, input_size: int, sustained_tflops: float) -> GradientProfile:
    """Gradient profile of model ``name`` for a per-rank ``batch`` at ``input_size`` (pixels, or tokens)."""
    if batch < 1 or input_size < 1:
        raise ValueError(f"batch={batch} and input_size={input_size} must be >= 1")
    model, tokens = build_model(name)
    with torch.device("meta"):
        if tokens:
            x = torch.zeros(batch, input_size, dtype=torch.long)
        else:
            x = torch.empty(batch, 3, input_size, input_size)
    return profile_module(model, x, sustained_tflops)


def profile_module(module: nn.Module, example_input: torch.Tensor, sustained_tflops: float) -> GradientProfile:
    """Gradient profile of ``module`` from the FLOPs of one forward pass (meta device or real, no autograd)."""
    if sustained_tflops <= 0:
        raise ValueError(f"sustained_tflops={sustained_tflops} must be > 0")
    first = next(module.parameters(), None)
    if first is not None:  # a strategy's module may already sit on its GPU
        example_input = example_input.to(first.device)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        module(example_input)
    own = _own_flops(module, counter.get_flop_counts())
    flops_per_s = sustained_tflops * 1e12
    # Backward walks modules in reverse; a module's gradients are ready after its backward.
    params = [(f"{m}.{p}" if m else p, m, tensor)
              for m, sub in module.named_modules()
              for p, tensor in sub.named_parameters(recurse=False) if tensor.requires_grad]
    names, sizes, times, pending, charged = [], [], [], 0.0, set()
    for full, module_name, tensor in reversed(params):
        if module_name not in charged:
            charged.add(module_name)
            pending += 2.0 * own.get(module_name, 0.0) / flops_per_s
        names.append(full)
        sizes.append(tensor.numel() * tensor.element_size())
        times.append(pending)
        pending = 0.0
    forward_s = sum(own.values()) / flops_per_s
    return GradientProfile(tuple(names), tuple(sizes), tuple(times), forward_s)


def measure_backward_profile(
    module: nn.Module,
    example_input: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    reps: int = 3,
) -> GradientProfile:
    """Gradient profile of ``module`` timed on its own device: the median time each gradient becomes ready.

    ``loss_fn`` maps the output to a scalar (default: its sum); gradients and buffers are put back.
    """
    if reps < 1:
        raise ValueError(f"reps={reps} must be >= 1")
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("measure_backward_profile: the module has no trainable parameters")
    device = params[0][1].device
    example_input = example_input.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    saved_grads = [p.grad for _, p in params]
    saved_buffers = [b.detach().clone() for b in module.buffers()]
    stamps: list[tuple[str, float]] = []

    def stamper(name: str) -> Callable[[torch.Tensor], None]:
        def stamp(_: torch.Tensor) -> None:
            sync()
            stamps.append((name, time.perf_counter()))
        return stamp

    handles = [p.register_post_accumulate_grad_hook(stamper(n)) for n, p in params]
    runs: list[tuple[float, list[tuple[str, float]]]] = []
    try:
        for _ in range(reps + 1):
            for _, p in params:
                p.grad = None
            stamps.clear()
            sync()
            start = time.perf_counter()
            output = module(example_input)
            loss = loss_fn(output) if loss_fn is not None else output.float().sum()
            sync()
            begin = time.perf_counter()
            loss.backward()
            runs.append((begin - start, [(name, t - prev) for (name, t), prev
                                         in zip(stamps, [begin] + [t for _, t in stamps[:-1]])]))
    finally:
        for handle in handles:
            handle.remove()
        for (_, p), grad in zip(params, saved_grads):
            p.grad = grad
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved_buffers):
                buffer.copy_(value)
    timed = runs[1:]
    order = [name for name, _ in timed[0][1]]
    if any([name for name, _ in run] != order for _, run in timed):
        raise RuntimeError("measure_backward_profile: gradients became ready in a different order between passes")
    sizes = {n: p.numel() * p.element_size() for n, p in params}
    backward = [statistics.median(run[i][1] for _, run in timed) for i in range(len(order))]
    forward_s = statistics.median(f for f, _ in timed)
    return GradientProfile(tuple(order), tuple(sizes[n] for n in order), tuple(backward), forward_s)
