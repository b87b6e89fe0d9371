"""Cases of the LARS kernel that the model-level tests do not reach: parameters that are not
contiguous (channels-last convolutions, updated whole, larger than a slice) and ratios outside
the range where the optimizer folds the ratio into the momentum buffer; torch SGD's state layout."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fastscale.precision import LARS, LARSMixedPrecision
from lightning_fastscale.precision import lars as lars_module


@pytest.fixture(autouse=True, params=["cpu_batches", "whole_list"])
def kernels(request, monkeypatch) -> str:
    """Slices of 7 values (the CPU's kernel) and the whole list (the accelerators')."""
    monkeypatch.setattr(lars_module, "_batch_size", lambda device: 7 if request.param == "cpu_batches" else None)
    return request.param


def conv_net(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    return net.to(memory_format=torch.channels_last) if channels_last else net


@pytest.mark.parametrize("kind", ["lars", "plugin"])
@pytest.mark.parametrize("cfg", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True), dict(momentum=0.0)])
def test_channels_last_parameters_take_the_same_steps(kind: str, cfg: dict) -> None:
    """Four steps with the same gradients on a contiguous and a channels-last copy of a model:
    the same weights; the optimizer leaves the channels-last gradients as they were."""
    results = []
    for channels_last in (False, True):
        net = conv_net(channels_last)
        assert channels_last == (not net[0].weight.is_contiguous())
        if kind == "lars":
            opt = LARS.from_module(net, lr=0.3, weight_decay=1e-3, eta=0.02, **cfg)
        else:
            opt = torch.optim.SGD(net.parameters(), lr=0.3, **cfg)
            plugin = LARSMixedPrecision("32-true", "cpu", eta=0.02)
            plugin.classify(net)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in net.parameters():
                g = torch.randn(p.shape, generator=gen)
                p.grad = g.contiguous(memory_format=torch.channels_last) if channels_last and p.ndim == 4 else g
            given = [p.grad.clone() for p in net.parameters()]
            opt.step() if kind == "lars" else plugin.lars_step(opt)
            if kind == "lars":
                assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), given))
        results.append([p.detach().clone() for p in net.parameters()])
    start = list(conv_net(False).parameters())
    for a, b, s in zip(*results, start):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("big", [False, True])
def test_momentum_steps_equal_the_formula_for_any_ratio(big: bool) -> None:
    """Three momentum steps of one weight, against the formula in float64. With weights ~1e17
    and gradients ~1e-15 the ratio exceeds 1e30, beyond the range of the folded update."""
    gen = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 5, generator=gen) * (1e17 if big else 1.0))
    grads = [torch.randn(6, 5, generator=gen) * (1e-15 if big else 1e-2) for _ in range(3)]
    lr, eta, m = 10.0, 0.05, 0.9  # each step moves the weight by about half its norm
    opt = LARS([weight], lr=lr, momentum=m, eta=eta, eps=0.0)
    w, buf, ratios = weight.detach().double().clone(), None, []
    for g in grads:
        ratios.append(eta * float(w.norm()) / float(g.double().norm()))
        buf = ratios[-1] * g.double() if buf is None else m * buf + ratios[-1] * g.double()
        w = w - lr * buf
        weight.grad = g
        opt.step()
    assert (min(ratios) > 1e30) == big and (max(ratios) < 1e3) != big
    torch.testing.assert_close(weight.detach().double(), w, rtol=1e-5, atol=0)


def test_state_layout_is_sgds() -> None:
    """The ``LARS`` optimizer and the plugin's update around torch SGD keep SGD's state layout:
    a momentum buffer per parameter with momentum, no state at all without."""
    for kind in ("lars", "plugin"):
        for momentum in (0.0, 0.9):
            net = conv_net(False)
            if kind == "lars":
                opt = LARS(net.parameters(), lr=0.1, momentum=momentum)
            else:
                opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
                plugin = LARSMixedPrecision("32-true", "cpu")
                plugin.classify(net)
            for p in net.parameters():
                p.grad = torch.ones_like(p)
            opt.step() if kind == "lars" else plugin.lars_step(opt)
            expected = [{"momentum_buffer"}] * len(list(net.parameters())) if momentum else []
            assert [set(s) for s in opt.state.values()] == expected, (kind, momentum)
