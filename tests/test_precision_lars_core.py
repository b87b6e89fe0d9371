"""LARS functional core and the plain ``LARS`` optimizer: formula, timm anchor, bad options."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_fastscale.param_groups import split_parameters
from lightning_fastscale.precision import LARS, lars_rescale_
from lightning_fastscale.precision import lars as lars_module

timm_optim = pytest.importorskip("timm.optim")


@pytest.fixture(autouse=True, params=["cpu_batches", "whole_list"])
def kernels(request, monkeypatch) -> str:
    """Every test here runs with both ways of calling the kernel: cache-sized batches of
    slices (the CPU's; 7 values a batch, so slicing, remainders and batches of several small
    tensors are all exercised by these small layers) and the whole list at once (accelerators')."""
    monkeypatch.setattr(lars_module, "_batch_size", lambda device: 7 if request.param == "cpu_batches" else None)
    return request.param


def textbook(w: torch.Tensor, g: torch.Tensor, *, lr, wd, eta, eps, clip, adapt=True) -> torch.Tensor:
    """You et al. 2017, written out per layer in float64 with Python floats."""
    w, g = w.double(), g.double()
    wn, gn = math.sqrt(float((w * w).sum())), math.sqrt(float((g * g).sum()))
    if not adapt:
        return g + wd * w
    local = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
    if clip:
        local = min(local / lr, 1.0)
    return local * (g + wd * w)


def layers() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Layers whose weight and gradient norms differ by orders of magnitude, plus edge cases."""
    gen = torch.Generator().manual_seed(0)
    shapes_scales = [((16, 8), 1.0, 1e-3), ((4, 3, 3, 3), 1e-2, 1.0), ((32, 32), 30.0, 1e-6), ((8, 4), 0.2, 5.0)]
    ws = [torch.randn(s, generator=gen) * a for s, a, _ in shapes_scales]
    gs = [torch.randn(s, generator=gen) * b for s, _, b in shapes_scales]
    ws.append(torch.zeros(5, 5))  # fresh zero layer: ratio 1
    gs.append(torch.randn(5, 5, generator=gen))
    ws.append(torch.randn(7, generator=gen))  # a bias, not adapted
    gs.append(torch.randn(7, generator=gen))
    return ws, gs


@pytest.mark.parametrize("wd", [0.0, 5e-2])
@pytest.mark.parametrize("clip", [False, True])
def test_rescale_equals_textbook_formula(wd: float, clip: bool) -> None:
    ws, gs = layers()
    adapt = torch.tensor([True, True, True, True, True, False])
    lr, eta, eps = 0.7, 0.02, 1e-8
    expected = [
        textbook(w, g, lr=lr, wd=wd, eta=eta, eps=eps, clip=clip, adapt=bool(a)) for w, g, a in zip(ws, gs, adapt)
    ]
    got = [g.clone() for g in gs]
    lars_rescale_(ws, got, lr=lr, weight_decay=wd, eta=eta, eps=eps, trust_clip=clip, adapt=adapt)
    for e, o in zip(expected, got):
        torch.testing.assert_close(o.double(), e, rtol=2e-6, atol=1e-12)
    # the layers really are scaled differently (the test would be weak if all ratios were 1)
    ratios = [float(o.norm() / (g + wd * w).norm()) for o, g, w in zip(got[:4], gs, ws)]
    assert len({round(math.log10(r), 1) for r in ratios}) >= 3


def test_half_inputs_accumulate_in_fp32() -> None:
    """fp16 squares of 1e-4 underflow; the ratio must come from fp32 norms."""
    w16 = torch.full((64, 64), 0.5, dtype=torch.float16)
    g16 = torch.full((64, 64), 1e-4, dtype=torch.float16)
    expected = textbook(w16, g16, lr=1.0, wd=0.0, eta=1e-3, eps=0.0, clip=False)  # ratio 5
    assert float((g16 * g16).sum()) == 0.0  # what a norm accumulated in fp16 would see
    lars_rescale_([w16], [g16], lr=1.0, eta=1e-3, eps=0.0)
    torch.testing.assert_close(g16.double(), expected, rtol=1e-3, atol=0)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4 * 4, 10), nn.ReLU(), nn.Linear(10, 3)
    )


def run(net: nn.Module, opt: torch.optim.Optimizer, steps: int = 6) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 3, 6, 6, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


@pytest.mark.parametrize(
    "kw",
    [
        dict(momentum=0.9, weight_decay=5e-4),
        dict(momentum=0.9, weight_decay=1e-2, trust_clip=True),
        dict(momentum=0.9, weight_decay=1e-3, nesterov=True),
        dict(momentum=0.8, weight_decay=1e-3, dampening=0.3),
        dict(momentum=0.0, weight_decay=1e-3),
        dict(momentum=0.9, weight_decay=0.0, trust_clip=True),
    ],
)
def test_trajectory_equals_timm_lars(kw: dict) -> None:
    """timm ``Lars(trust_coeff=eta, eps, trust_clip, momentum, dampening, nesterov)`` with
    the adapted parameters in a group with ``always_adapt=True`` and the excluded ones in a
    group with weight decay 0 (timm then leaves them unadapted) is the same optimizer."""
    ours, ref = model(), model()
    lr, eta = 0.5, 0.01
    opt = LARS.from_module(ours, lr=lr, eta=eta, **kw)
    adapted, excluded = split_parameters(ref)
    tkw = {k: v for k, v in kw.items() if k != "weight_decay"}
    timm = timm_optim.Lars(
        [
            {"params": [p for _, p in adapted], "weight_decay": kw["weight_decay"], "always_adapt": True},
            {"params": [p for _, p in excluded], "weight_decay": 0.0},
        ],
        lr=lr, trust_coeff=eta, **tkw,
    )
    start = copy.deepcopy(list(ours.parameters()))
    run(ours, opt)
    run(ref, timm)
    for (name, a), b, s in zip(ours.named_parameters(), ref.parameters(), start):
        assert not torch.equal(a, s), f"{name} did not move"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_optimizer_equals_rescale_then_torch_sgd() -> None:
    """The fused ``LARS.step`` equals the plugin's path: rescale the gradients, then SGD (wd 0)."""
    a, b = model(), model()
    kw = dict(lr=0.3, momentum=0.9, dampening=0.1)
    opt = LARS(a.parameters(), weight_decay=1e-3, eta=5e-3, **kw)
    sgd = torch.optim.SGD(b.parameters(), weight_decay=0.0, **kw)

    class Rescaled(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__(b.parameters(), {})

        def step(self, closure=None):  # noqa: D102
            ps = [p for p in b.parameters()]
            adapt = torch.tensor([p.ndim > 1 for p in ps])
            lars_rescale_(ps, [p.grad for p in ps], lr=0.3, weight_decay=1e-3, eta=5e-3, adapt=adapt)
            sgd.step()

    run(a, opt)
    run(b, Rescaled())
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    # momentum state is where torch SGD keeps it, so checkpoints look familiar
    assert all("momentum_buffer" in opt.state[p] for p in a.parameters())


def test_bare_parameters_exclude_bias_and_keep_grad() -> None:
    net = nn.Linear(4, 3)
    opt = LARS(net.parameters(), lr=1.0, momentum=0.0, eta=1e-3)
    net.weight.grad = torch.ones_like(net.weight)
    net.bias.grad = torch.ones_like(net.bias)
    w0, b0 = net.weight.detach().clone(), net.bias.detach().clone()
    opt.step()
    # bias: plain SGD step of size lr * 1; weight: LARS-scaled step
    torch.testing.assert_close(net.bias, b0 - 1.0)
    expected_w = w0 - textbook(w0, torch.ones_like(w0), lr=1.0, wd=0.0, eta=1e-3, eps=1e-8, clip=False).float()
    torch.testing.assert_close(net.weight, expected_w)
    assert torch.equal(net.weight.grad, torch.ones_like(net.weight))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eta=-1e-3), "eta"),
        (dict(eta=0.0), "eta"),
        (dict(eps=-1.0), "eps"),
        (dict(weight_decay=-1e-4), "weight_decay"),
        (dict(nesterov=True, momentum=0.0), "nesterov"),
    ],
)
def test_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LARS(nn.Linear(2, 2).parameters(), lr=0.1, **kwargs)


def test_exclusion_of_everything_is_an_error() -> None:
    with pytest.raises(ValueError, match="excludes every parameter"):
        LARS.from_module(nn.Linear(3, 3), lr=0.1, exclude=["*"])
