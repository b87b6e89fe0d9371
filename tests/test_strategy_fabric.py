"""The hierarchical strategies under Lightning Fabric equal plain Fabric DDP (gloo, spawned ranks).

Each rank joins the process group made by ``run_distributed`` and sets ``LOCAL_RANK``, so
``fabric.launch()`` finds the processes already started and launches nothing itself.
"""
from __future__ import annotations

import os

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from torch import nn

from lightning_fastscale.precision import LARSFabricPrecision
from lightning_fastscale.strategies import FabricHierarchicalAllReduceStrategy
from tests.distributed import relative_error as _rel
from tests.distributed import run_distributed
from tests.distributed import same_on_all_ranks as _same_on_all_ranks

STEPS = 4
# fp32 wire: only the summation order differs from DDP's all-reduce; fp16 wire: per-step rounding.
TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "lars_bf16": 1e-5}
LARS_ETA = 0.02


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data, as a sampler gives
    x = torch.randn(STEPS, 8, 8, generator=g)
    y = torch.randint(0, 3, (STEPS, 8), generator=g)
    return list(zip(x, y))


def _train(rank: int, strategy, world_size: int, **fabric_kw) -> tuple[Fabric, nn.Module, torch.Tensor]:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size, **fabric_kw)
    if isinstance(strategy, str):
        # The registered name takes ranks per node from devices (one node); one rank per
        # emulated node makes the inter-node stage, and so the hook, really run.
        fabric.strategy.ranks_per_node = 1
    fabric.launch()
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    for x, y in _batches(rank):
        optimizer.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return fabric, model, flat


def _worker(rank: int, world_size: int) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    out: dict = {}
    def lars() -> dict:
        # The Fabric LARS plugin: bf16 autocast, fp32 master weights, LARS.
        return {"plugins": [LARSFabricPrecision("bf16-mixed", "cpu", eta=LARS_ETA)]}

    _, _, reference = _train(rank, FabricDDPStrategy(), world_size)
    _, _, lars_reference = _train(rank, FabricDDPStrategy(), world_size, **lars())
    runs = {
        ("hier_ring", "fp32"): ("hier_ring", {}),
        ("hier_torus", "fp16"): (FabricHierarchicalAllReduceStrategy(
            algorithm="torus2d", ranks_per_node=1, wire_dtype="fp16"), {}),
        ("hier_ring", "lars_bf16"): ("hier_ring", lars()),
    }
    for key, (strategy, fabric_kw) in runs.items():
        fabric, model, flat = _train(rank, strategy, world_size, **fabric_kw)
        if fabric_kw:
            reference_flat = lars_reference
            out[key + ("moved_from_sgd",)] = _rel(flat, reference)  # LARS changed the steps
        else:
            reference_flat = reference
        state = fabric.strategy.hook_state
        out[key] = {
            "rel": _rel(flat, reference_flat),
            "agree": _same_on_all_ranks(flat),
            "iterations": state.iteration if state is not None else None,
            "comm_hook": model._forward_module._get_ddp_logging_data().get("comm_hook"),
            "nodes": fabric.strategy.topology.num_nodes,
            "summary": fabric.strategy.plan_summary()["strategy/algorithm"],
        }
        fabric.strategy.teardown()
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    out = run_distributed(_worker, 2, timeout=240)[0]
    print({key: value["rel"] if isinstance(value, dict) else value for key, value in out.items()})  # with -s
    return out


@pytest.mark.parametrize("name,wire", [("hier_ring", "fp32"), ("hier_torus", "fp16"), ("hier_ring", "lars_bf16")])
def test_fabric_equals_plain_fabric_ddp(results: dict, name: str, wire: str) -> None:
    r = results[(name, wire)]
    assert r["nodes"] == 2
    assert r["agree"], "ranks ended with different weights"
    assert r["rel"] <= TOLERANCE[wire], r["rel"]
    # The strategy's hook averaged every step, not DDP's built-in all-reduce.
    assert r["iterations"] == STEPS
    assert r["comm_hook"] == {"hier_ring": "hier_hook", "hier_torus": "torus2d_hook"}[name]
    if wire == "lars_bf16":  # the plugin really ran: its steps differ from plain SGD's
        assert results[(name, wire, "moved_from_sgd")] > 100 * TOLERANCE[wire]


def test_fabric_module_examples() -> None:
    import doctest

    from lightning_fastscale.strategies import fabric

    result = doctest.testmod(fabric)
    assert result.attempted > 0 and result.failed == 0


def test_fabric_registry_names() -> None:
    for name, algorithm, start in (("hier_ring", "hier", "popen"), ("hier_torus_spawn", "torus2d", "spawn")):
        fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
        assert isinstance(fabric.strategy, FabricHierarchicalAllReduceStrategy)
        assert (fabric.strategy.algorithm, fabric.strategy._start_method) == (algorithm, start)


def test_fabric_strategy_validates_options_at_construction() -> None:
    with pytest.raises(ValueError, match="wire_dtype='fp8'"):
        FabricHierarchicalAllReduceStrategy(wire_dtype="fp8")
    with pytest.raises(ValueError, match="compression='topk'.*algorithm='flat'"):
        FabricHierarchicalAllReduceStrategy(algorithm="flat", compression="topk")
    with pytest.raises(ValueError, match="topk_momentum=0.9 corrects top-k's error feedback: set compression='topk'"):
        FabricHierarchicalAllReduceStrategy(topk_momentum=0.9)


def test_fabric_refuses_an_optimizer_momentum_beside_topk_momentum() -> None:
    strategy = FabricHierarchicalAllReduceStrategy(compression="topk", topk_momentum=0.9)
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="SGD has momentum=0.9 in param group 0: set the optimizer's momentum to 0"):
        strategy.setup_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"AdamW has betas=\(0.9, 0.999\)"):
        strategy.setup_optimizer(torch.optim.AdamW(params))
    plain = torch.optim.SGD(params, lr=0.1)
    assert strategy.setup_optimizer(plain) is plain
