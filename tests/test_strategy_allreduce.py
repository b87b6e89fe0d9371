"""The all-reduce algorithms sum exactly like a flat all-reduce (2x2, 4x1, 1x4 layouts on gloo)."""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from lightning_fastscale.strategies.allreduce import ALLREDUCE_FUNCTIONS, TopKErrorFeedback, torus2d_allreduce_
from lightning_fastscale.strategies.topology import Topology, build_process_groups
from tests.comm_recording import CommRecorder
from tests.distributed import run_distributed

# fp32: only the summation order differs from the reference. Wire dtypes: relative L2 error of
# the sum of 4 standard normals; fp16 keeps 11 significant bits (2^-11 ~ 4.9e-4 per rounding,
# a few roundings), bf16 keeps 8 (2^-8 ~ 3.9e-3).
WIRE_TOLERANCE = {"fp32": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2}
SIZES = (10007, 3, 1)  # odd: uneven torus shards; 3 and 1: fewer elements than ranks per node
pytestmark = pytest.mark.timeout(600)
# The torus's NCCL path (native reduce-scatter / all-gather on a padded buffer) forced on gloo.
FUNCTIONS = {**ALLREDUCE_FUNCTIONS, "torus2d_native": partial(torus2d_allreduce_, native_scatter_gather=True)}  # one spawn of 4 ranks; slow only when the machine is shared


def _inputs(world_size: int, numel: int) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 * r + numel)) for r in range(world_size)]


def _same_on_all_ranks(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(g, tensor) for g in gathered)


def _algorithms(rank: int, world_size: int, ranks_per_node: int) -> dict:
    groups = build_process_groups(Topology.from_world(world_size, ranks_per_node))
    errors, agree = {}, {}
    with CommRecorder() as recorder:
        for numel in SIZES:
            inputs = _inputs(world_size, numel)
            expected = torch.stack(inputs).double().sum(0)
            for name, fn in FUNCTIONS.items():
                for dtype in WIRE_TOLERANCE:
                    for chunk in (None, 1000):
                        out = fn(inputs[rank].clone(), groups, wire_dtype=dtype, chunk_numel=chunk)
                        assert out.dtype == torch.float32
                        key = (numel, name, dtype, chunk)
                        errors[key] = ((out.double() - expected).norm() / expected.norm()).item()
                        agree[key] = _same_on_all_ranks(out)
    return {"errors": errors, "agree": agree, "calls": dict(recorder.stages), "wire_stage": _wire_stage(rank, groups)}


def _wire_stage(rank: int, groups) -> dict:
    """Max deviation from "fp32 inside each node, fp16 only between nodes" (2 nodes x 2 ranks).

    Casting the whole tensor instead (each rank's input rounded to fp16, sums in fp16) deviates
    from this model by about one fp16 rounding, ~1e-3 relative; the inter-node-only cast
    matches it up to the order of two fp32 additions.
    """
    if groups.topology.num_nodes != 2 or groups.topology.ranks_per_node != 2:
        return {}
    inputs = _inputs(4, 4099)
    node_sums = [inputs[0] + inputs[1], inputs[2] + inputs[3]]
    model = (node_sums[0].half().double() + node_sums[1].half().double()).half().float()
    deviation = {}
    for name in ("hier", "torus2d"):
        for chunk in (None, 1000):
            out = ALLREDUCE_FUNCTIONS[name](inputs[rank].clone(), groups, wire_dtype="fp16", chunk_numel=chunk)
            deviation[(name, chunk)] = ((out - model).abs().max() / model.abs().max()).item()
    return deviation


def _topk(rank: int, world_size: int, algorithm: str, ratio: float) -> dict:
    groups = build_process_groups(Topology.from_world(world_size, 2))
    numel = 1001
    inputs = _inputs(world_size, numel)
    expected = torch.stack(inputs).sum(0)
    topk = TopKErrorFeedback(ratio)
    out = ALLREDUCE_FUNCTIONS[algorithm](inputs[rank].clone(), groups, topk=topk, key=7)
    # Gather every rank's residual into the slots it covers (leaders: all; torus: own shard).
    residual = torch.zeros(numel)
    if algorithm == "hier" and groups.is_leader:
        residual = topk.errors[(7, 0)].clone()
    elif algorithm == "torus2d":
        start = (0, 501)[groups.local_rank]
        residual[start: start + topk.errors[(7, 0)].numel()] = topk.errors[(7, 0)]
    dist.all_reduce(residual)
    return {
        "dropped": (out - expected).abs().max().item(),
        "conservation": (out + residual - expected).abs().max().item(),
        "agree": _same_on_all_ranks(out),
    }


def _worker(rank: int, world_size: int) -> dict:
    # One spawn for every check: starting processes dominates the cost on a loaded 2-core box.
    # Results stay small: run_distributed passes them through a pipe read only after the join.
    results: dict = {"layouts": {ranks_per_node: _algorithms(rank, world_size, ranks_per_node) for ranks_per_node in (2, 1, 4)}}
    for algorithm in ("hier", "torus2d"):
        for ratio in (0.05, 1.0):
            results[(algorithm, ratio)] = _topk(rank, world_size, algorithm, ratio)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 4, timeout=500)


@pytest.mark.parametrize("ranks_per_node", [2, 1, 4])
def test_algorithms_equal_flat_sum(results: list[dict], ranks_per_node: int) -> None:
    ours = results[0]["layouts"][ranks_per_node]
    assert len(ours["errors"]) == len(SIZES) * len(FUNCTIONS) * len(WIRE_TOLERANCE) * 2
    for key, err in ours["errors"].items():
        assert err <= WIRE_TOLERANCE[key[2]], (key, err)
    assert all(ours["agree"].values()), [k for k, ok in ours["agree"].items() if not ok]
    calls = ours["calls"]
    if ranks_per_node == 2:  # rank 0 is a leader: it used every stage
        assert {"in-node reduce", "inter-node all-reduce", "in-node broadcast", "flat all-reduce",
                "in-node reduce-scatter", "in-node all-gather"} <= set(calls)
        deviations = [r["layouts"][2]["wire_stage"] for r in results]
        assert all(len(d) == 4 for d in deviations)
        for deviation in deviations:  # fp16 only on the inter-node stage, on every rank
            assert max(deviation.values()) < 1e-6, deviation
    elif ranks_per_node == 4:  # one node: no inter-node traffic at all
        assert "inter-node all-reduce" not in calls and calls["in-node all-reduce"] > 0


@pytest.mark.parametrize("algorithm", ["hier", "torus2d"])
def test_topk_conserves_gradient(results: list[dict], algorithm: str) -> None:
    """What was sent plus what every rank kept back is exactly the true sum (error feedback)."""
    sparse, full = results[0][(algorithm, 0.05)], results[0][(algorithm, 1.0)]
    assert sparse["dropped"] > 1e-2, "top-k at 5% must drop something"
    assert sparse["conservation"] < 1e-5
    assert sparse["agree"] and full["agree"]
    assert full["dropped"] < 1e-5


@pytest.mark.parametrize("ratio", [0.25, 1.0])
def test_topk_momentum_is_momentum_correction(ratio: float) -> None:
    """Lin et al. 2018 (Deep Gradient Compression), momentum correction with factor masking,
    written out: u = m u + g, v = v + u, send v's top-k, clear the sent entries of v and u."""
    m, n = 0.9, 8
    g = torch.Generator().manual_seed(3)
    topk = TopKErrorFeedback(ratio, momentum=m)
    u, v = torch.zeros(n), torch.zeros(n)
    for step in range(6):
        grad = torch.randn(n, generator=g)
        indices, values = topk.select("b", grad, torch.float32)
        u = m * u + grad
        v = v + u
        mask = torch.zeros(n, dtype=torch.bool)
        mask[v.abs().topk(max(1, round(ratio * n))).indices] = True
        sent = torch.zeros(n)
        sent[indices.long()] = values
        torch.testing.assert_close(sent, torch.where(mask, v, 0.0), rtol=0, atol=1e-6)
        v, u = torch.where(mask, 0.0, v), torch.where(mask, 0.0, u)
        torch.testing.assert_close(topk.errors["b"], v, rtol=0, atol=1e-6)
        torch.testing.assert_close(topk.velocities["b"], u, rtol=0, atol=1e-6)
        if ratio == 1.0:  # everything sent and cleared each step: the gradient itself, no momentum left
            torch.testing.assert_close(sent, grad, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="topk_momentum must be in"):
        TopKErrorFeedback(0.1, momentum=1.0)


def test_topk_residual_reset_on_shape_change() -> None:
    topk = TopKErrorFeedback(0.5)
    topk.select(0, torch.tensor([1.0, -3.0, 0.5, 2.0]), torch.float32)
    torch.testing.assert_close(topk.errors[0], torch.tensor([1.0, 0.0, 0.5, 0.0]))
    idx, val = topk.select(0, torch.tensor([0.0, 0.0, 0.0, 0.1]), torch.float32)
    assert sorted(idx.tolist()) == [0, 2] and topk.resets == 0  # old residuals 1.0, 0.5 beat the new 0.1
    topk.select(0, torch.ones(6), torch.float32)  # DDP rebuilt the bucket: new size
    assert topk.resets == 1 and topk.errors[0].shape == (6,)
    with pytest.raises(ValueError, match="topk_ratio"):
        TopKErrorFeedback(0.0)
