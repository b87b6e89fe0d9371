"""The two implementations of the LARS update: ``LARSMixedPrecision`` around an optimizer
(around torch SGD the ratio folded into SGD's momentum update inside ``optimizer.step()``;
around others the gradients rescaled in place, then ``optimizer.step()``) and the ``LARS``
optimizer (the ratio folded into the momentum update). They must agree, and the plugin's step must be an ordinary
``optimizer.step()`` for others: step hooks and the LR scheduler's call tracking.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_fastscale.callbacks.lr_schedule import WarmupDecayLR
from lightning_fastscale.param_groups import split_parameters
from lightning_fastscale.precision import LARS, LARSMixedPrecision
from lightning_fastscale.precision import lars as lars_module
from tests.test_precision_lars_plugin import Tiny, data, make_net, small_scaler, trainer


class SubSGD(torch.optim.SGD):
    """Plain SGD under another type."""


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(96, 10), nn.Linear(10, 3)
    )


def sgd_groups(model: nn.Module, wd: float) -> list[dict]:
    """Adapted weights with decay; bias/BN without; and one group mixing an adapted weight
    with an excluded bias, with its own lr and decay (so the bias there is decayed, ratio 1)."""
    adapted, excluded = split_parameters(model)
    last = model[5]
    mixed = {id(last.weight), id(last.bias)}
    return [
        {"params": [p for _, p in adapted if id(p) not in mixed]},
        {"params": [p for _, p in excluded if id(p) not in mixed], "weight_decay": 0.0},
        {"params": [last.weight, last.bias], "lr": 0.05, "weight_decay": 3 * wd},
    ]


CONFIGS = [
    dict(momentum=0.9, weight_decay=5e-3),
    dict(momentum=0.9, weight_decay=5e-3, nesterov=True, trust_clip=True),
    dict(momentum=0.8, weight_decay=1e-2, dampening=0.3),
    dict(momentum=0.9, weight_decay=0.0, trust_clip=True),
    dict(momentum=0.0, weight_decay=1e-3),
    # momentum 1 (torch SGD allows it): the multi-tensor form cannot use lerp there
    dict(momentum=1.0, weight_decay=1e-3),
    dict(momentum=1.0, weight_decay=1e-3, nesterov=True),
]


@pytest.fixture(params=["cpu_batches", "whole_list"])
def kernels(request, monkeypatch) -> str:
    """Both ways of calling the kernel: batches of 7 values (the CPU's form) and the whole list."""
    monkeypatch.setattr(lars_module, "_batch_size", lambda device: 7 if request.param == "cpu_batches" else None)
    return request.param


@pytest.mark.parametrize("cfg", CONFIGS)
def test_plugin_step_equals_lars_optimizer(cfg: dict, kernels: str) -> None:
    """Six steps with fresh random gradients (of varied scale; one parameter without a
    gradient in one step): weights and momentum of the plugin around torch SGD and of the
    ``LARS`` optimizer agree to float32 rounding; both leave the gradients as they were."""
    cfg = dict(cfg)
    clip = cfg.pop("trust_clip", False)
    runs = {}
    for kind in ("lars", "plugin"):
        model = net()
        if kind == "lars":
            opt = LARS(sgd_groups(model, cfg["weight_decay"]), lr=0.3, eta=0.02, trust_clip=clip, **cfg)
        else:
            opt = torch.optim.SGD(sgd_groups(model, cfg["weight_decay"]), lr=0.3, **cfg)
            plugin = LARSMixedPrecision("32", "cpu", eta=0.02, trust_clip=clip)
            plugin.classify(model)
        gen = torch.Generator().manual_seed(1)
        params = list(model.parameters())
        untouched = []
        for step in range(6):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** -(i % 4)
            if step == 3:
                params[0].grad = None
            stepped = [p for p in params if p.grad is not None]
            before = [p.grad.clone() for p in stepped]
            opt.step() if kind == "lars" else plugin.lars_step(opt)
            untouched.append(all(torch.equal(p.grad, b) for p, b in zip(stepped, before)))
        momentum = [opt.state[p].get("momentum_buffer") for p in params]
        runs[kind] = ([p.detach().clone() for p in params], momentum, untouched)
    (w_lars, m_lars, untouched_lars), (w_plugin, m_plugin, untouched_plugin) = runs.values()
    assert all(untouched_lars) and all(untouched_plugin)
    start = [p.detach() for p in net().parameters()]
    for a, b, s in zip(w_lars, w_plugin, start):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    for a, b in zip(m_lars, m_plugin):
        assert (a is None) == (b is None) == (cfg["momentum"] == 0)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


class StepHooks(Callback):
    """Registers step pre/post hooks on the optimizer and records what they were given."""

    def __init__(self) -> None:
        self.pre, self.post, self.applied, self.lrs = [], [], [], []

    def on_fit_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        opt.register_step_pre_hook(lambda o, args, kwargs: self.pre.append((o is opt, len(args), dict(kwargs))))
        opt.register_step_post_hook(lambda o, args, kwargs: self.post.append((o is opt, len(args), dict(kwargs))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.applied.append(not trainer.precision_plugin.last_step_skipped)
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("sgd", [torch.optim.SGD, SubSGD])
def test_step_hooks_and_warmup_see_every_step(tmp_path, sgd) -> None:
    """6 steps, the third with an inf gradient: the step hooks fire exactly for the 5 applied
    steps, with the arguments ``SGD.step()`` gives them; ``WarmupDecayLR``
    counts 5 applied and 1 skipped step."""

    class Module(Tiny):
        def configure_optimizers(self):
            return sgd(self.parameters(), lr=self.lr, momentum=0.9)

    hooks, warmup = StepHooks(), WarmupDecayLR(warmup_epochs=2, decay="none")
    plugin = LARSMixedPrecision("16-mixed", "cpu", scaler=small_scaler())
    tr = trainer(plugin, tmp_path, max_epochs=1, callbacks=[hooks, warmup])
    tr.fit(Module(make_net(), inject={2: math.inf}), data())
    assert tr.global_step == 6  # Lightning's own count: every optimizer_step call
    assert hooks.applied == [True, True, False, True, True, True]
    assert hooks.pre == hooks.post == [(True, 1, {})] * 5
    assert warmup._skipped_steps == 1
    assert warmup.progress == pytest.approx(5 / 6)
    # the LR only moves after applied steps: warmup from 0 by (peak / 12) per applied step
    assert hooks.lrs[2] == hooks.lrs[3] and hooks.lrs[3] < hooks.lrs[4]


def test_lr_scheduler_sees_the_step(tmp_path) -> None:
    """A torch LR scheduler stepped by Lightning after each optimizer step: no "scheduler
    before optimizer step" warning, and the schedule moves."""

    class Scheduled(Tiny):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = Scheduled(make_net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = trainer(LARSMixedPrecision("32", "cpu"), tmp_path, max_steps=3)
        tr.fit(module, data())
    messages = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
    assert messages == []
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(module.lr * 0.5**3)



@pytest.mark.parametrize("sgd", [torch.optim.SGD, SubSGD])
def test_step_hooks_see_the_gradients(sgd) -> None:
    """Step hooks added after the plugin validated the optimizer: around plain SGD (the update
    run from a step pre-hook, SGD's own update given no gradients, the ratio folded into the
    momentum update) the hooks and the step's caller see the gradients as given; around a
    subclass, which reads them, the rescaled ones; weights and momentum agree."""
    results = []
    for kind in (torch.optim.SGD, sgd):
        model = net()
        opt = kind(sgd_groups(model, 5e-3), lr=0.3, momentum=0.9, weight_decay=5e-3)
        plugin = LARSMixedPrecision("32", "cpu", eta=0.02)
        plugin.classify(model)
        plugin.validate(opt)
        params = list(model.parameters())
        pre: list[list] = []
        post: list[list] = []
        def record(into: list, params: list = params) -> Callable:
            return lambda o, a, k: into.append([p.grad.clone() for p in params])

        opt.register_step_pre_hook(record(pre))
        opt.register_step_post_hook(record(post))
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            given = [p.grad.clone() for p in params]
            plugin.lars_step(opt)
            assert all(torch.equal(p.grad, g) for p, g in zip(params, post[-1]))
            as_given = kind is torch.optim.SGD
            assert all(torch.equal(a, b) for a, b in zip(pre[-1], given)) == as_given
            assert all(torch.equal(a, b) for a, b in zip(post[-1], given)) == as_given
        results.append(([p.detach().clone() for p in params], [opt.state[p]["momentum_buffer"] for p in params]))
    (w_a, m_a), (w_b, m_b) = results
    for a, b in zip([*w_a, *m_a], [*w_b, *m_b]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
