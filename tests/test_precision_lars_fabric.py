"""The LARS precision plugins in Lightning Fabric loops, against the Trainer plugin.

Same model, data, optimizer groups and injected inf as the Trainer runs: the Fabric loop
(``fabric.backward``, ``optimizer.step``) must land on the same weights, in one process and
in two gloo processes (plain Fabric DDP).
"""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.nn import functional as F

from lightning_fastscale.precision import LARSFabricPrecision, LARSMixedPrecision
from tests.test_precision_lars_plugin import Tiny, data, make_net, small_scaler, trainer

STEPS, LR, ETA, WD = 4, 0.5, 0.02, 1e-2


def fabric_loop(fabric: L.Fabric, bn: bool, inject: dict, batch: int = 4) -> list[torch.Tensor]:
    """Tiny's model and optimizer groups, trained with Fabric; an inf goes into rank (n-1)'s
    gradient at the steps in ``inject`` (DDP's all-reduce has spread the real ones)."""
    module = Tiny(make_net(bn=bn), lr=LR, wd=WD)
    net, optimizer = fabric.setup(module.net, module.configure_optimizers())
    loader = data(n=8 * STEPS, batch=8)
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        # rank r takes samples r, r+n, ...: the global batch is the same 8 samples as one process
        x, y = x[fabric.global_rank :: fabric.world_size], y[fabric.global_rank :: fabric.world_size]
        fabric.backward(F.cross_entropy(net(x), y))
        if step in inject and fabric.global_rank == fabric.world_size - 1:
            module.net[0].weight.grad[0, 0] = inject[step]
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in module.net.parameters()]


def trainer_run(tmp_path, precision: str, bn: bool, inject: dict) -> tuple[list[torch.Tensor], LARSMixedPrecision]:
    plugin = LARSMixedPrecision(precision, "cpu", eta=ETA, scaler=small_scaler() if precision == "16-mixed" else None)
    module = Tiny(make_net(bn=bn), lr=LR, wd=WD, inject=inject)
    trainer(plugin, tmp_path, max_steps=STEPS).fit(module, data(n=8 * STEPS, batch=8))
    return [p.detach().clone() for p in module.net.parameters()], plugin


def fabric_plugin(precision: str) -> LARSFabricPrecision:
    return LARSFabricPrecision(precision, "cpu", eta=ETA, scaler=small_scaler() if precision == "16-mixed" else None)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_fabric_one_process_equals_trainer(tmp_path, precision) -> None:
    inject = {2: math.inf}
    expected, trainer_plugin = trainer_run(tmp_path, precision, bn=True, inject=inject)
    plugin = fabric_plugin(precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    got = fabric_loop(fabric, bn=True, inject=inject)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert plugin.skipped_steps == trainer_plugin.skipped_steps == 1
    if precision == "16-mixed":
        assert plugin.scaler.get_scale() == trainer_plugin.scaler.get_scale() == 2.0**7


def test_fabric_step_without_setup_names_the_fix() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LARSFabricPrecision("32-true", "cpu")])
    net = make_net()
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.backward(net(torch.randn(4, 4)).sum())
    with pytest.raises(RuntimeError, match="fabric.setup"):
        optimizer.step()


def test_trainer_plugin_in_fabric_names_the_fabric_plugin() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LARSMixedPrecision("32-true", "cpu")])
    with pytest.raises(TypeError, match="LARSFabricPrecision"):
        fabric.setup_module(make_net())


def _two_rank_worker(fabric: L.Fabric, out: str) -> None:
    torch.set_num_threads(1)
    weights = fabric_loop(fabric, bn=False, inject={1: math.inf})
    plugin = fabric.strategy.precision
    if fabric.global_rank == 0:
        torch.save({"weights": weights, "skipped": plugin.skipped_steps}, out)


def test_fabric_ddp_two_processes_equals_trainer_one_process(tmp_path) -> None:
    """2 gloo ranks x batch 4 with plain Fabric DDP == the Trainer plugin with 1 process x batch 8
    (no BN), including the step skipped on both ranks because only rank 1 saw an inf."""
    expected, _ = trainer_run(tmp_path, "32-true", bn=False, inject={1: math.inf})
    out = tmp_path / "weights.pt"
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_fork", plugins=[fabric_plugin("32-true")])
    fabric.launch(_two_rank_worker, str(out))
    result = torch.load(out)
    assert result["skipped"] == 1
    start = [p.detach() for p in make_net(bn=False).parameters()]
    assert not torch.equal(result["weights"][0], start[0])
    for a, b in zip(result["weights"], expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _scaler_worker(fabric: L.Fabric, out: str) -> None:
    torch.set_num_threads(1)
    fabric_loop(fabric, bn=False, inject={1: math.inf})
    plugin = fabric.strategy.precision
    torch.save({**plugin.scaler.state_dict(), "skipped": plugin.skipped_steps}, f"{out}.{fabric.global_rank}")


def test_fabric_every_rank_backs_off_when_one_rank_overflows(tmp_path) -> None:
    """16-mixed on 2 gloo ranks, an inf on rank 1 alone at step 1 of 4 (growth interval 2): both ranks
    skip it and end on the same scale and growth count (backed off at 1, grown back at 3)."""
    out = tmp_path / "scaler"
    plugin = LARSFabricPrecision("16-mixed", "cpu", eta=ETA, scaler=small_scaler(growth_interval=2))
    L.Fabric(accelerator="cpu", devices=2, strategy="ddp_fork", plugins=[plugin]).launch(_scaler_worker, str(out))
    r0, r1 = (torch.load(f"{out}.{rank}") for rank in (0, 1))
    assert r0 == r1
    assert (r0["scale"], r0["_growth_tracker"], r0["skipped"]) == (2.0**8, 0, 1)
