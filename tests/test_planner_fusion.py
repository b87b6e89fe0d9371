"""Fusion planner: exact against brute force, known optima, DDP reproduces the plan."""
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fastscale.planner.cost_model import CommParams, Topology
from lightning_fastscale.planner.fusion import (
    MB,
    best_uniform_cap,
    ddp_buckets,
    ddp_supports_bucket_list,
    plan_fusion,
    simulate,
)
from lightning_fastscale.planner.scaling import allreduce_cost


def affine(alpha, beta):
    return lambda nbytes: alpha + beta * np.asarray(nbytes, dtype=float)


def all_bucketings(n):
    for mask in itertools.product([0, 1], repeat=n - 1):
        yield tuple(i + 1 for i, cut in enumerate(mask) if cut) + (n,)


@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 8
    sizes = rng.integers(1, 100, n) * 1000
    back = rng.uniform(0, 2e-3, n)
    cost = affine(rng.uniform(1e-4, 2e-3), rng.uniform(1e-9, 5e-8))
    brute = min(simulate(ends, sizes, back, cost).finish_s for ends in all_bucketings(n))
    assert plan_fusion(sizes, back, cost).finish_s == pytest.approx(brute, rel=1e-12)
    two = min(simulate(ends, sizes, back, cost).finish_s for ends in all_bucketings(n) if len(ends) <= 2)
    assert plan_fusion(sizes, back, cost, max_buckets=2).finish_s == pytest.approx(two, rel=1e-12)


def test_nonlinear_cost_brute_force():
    # The planner must not rely on an affine cost: a step function of the size.
    sizes = np.array([5, 1, 7, 3, 2, 9, 4]) * 1000
    back = np.array([1, 0, 2, 1, 3, 1, 2]) * 1e-3
    cost = lambda b: 1e-3 * np.ceil(np.asarray(b) / 4000)  # noqa: E731
    brute = min(simulate(e, sizes, back, cost).finish_s for e in all_bucketings(len(sizes)))
    assert plan_fusion(sizes, back, cost).finish_s == pytest.approx(brute)


def test_known_optima():
    sizes = [1000] * 10
    # Everything ready at once and a per-message latency: one bucket is optimal.
    plan = plan_fusion(sizes, [0.0] * 10, affine(1e-3, 1e-9))
    assert plan.ends == (10,)
    assert plan.finish_s == pytest.approx(1e-3 + 1e-9 * 10_000)
    # No latency, slow compute: communication hides except the last gradient's.
    plan = plan_fusion(sizes, [1.0] * 10, affine(0.0, 1e-6))
    assert plan.exposed_s == pytest.approx(1e-6 * 1000)
    assert plan.ends[-1] - plan.ends[-2] == 1
    # Two halves ready at t=5 and t=10, 1 s latency + 5 s per half: sending the first half
    # during the second's compute ends at 11 + 6 = 17, one bucket at 10 + 11 = 21.
    plan = plan_fusion([1, 1], [5.0, 5.0], affine(1.0, 5.0), max_buckets=2)
    assert plan.ends == (1, 2)
    assert plan.finish_s == pytest.approx(17.0)
    assert simulate([2], [1, 1], [5.0, 5.0], affine(1.0, 5.0)).finish_s == pytest.approx(21.0)


def test_fewest_buckets_among_equally_fast_plans():
    # Without latency, sending each early gradient at once ends the first three soonest (at 4),
    # but any split of them ends before the last gradient is ready (13), so every plan whose last
    # bucket is the last gradient finishes at 13 + 1: the planner keeps the one of 2 buckets.
    sizes, back, cost = [1, 1, 1, 1], [1.0, 1.0, 1.0, 10.0], affine(0.0, 1.0)
    plan = plan_fusion(sizes, back, cost)
    assert plan.finish_s == pytest.approx(14.0)
    assert plan.ends == (3, 4)
    fastest = {len(e) for e in all_bucketings(4) if simulate(e, sizes, back, cost).finish_s == 14.0}
    assert fastest == {2, 3, 4}  # the tie the planner had to break


def test_ddp_bucket_assignment_reproduces_plan():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 50, 40) * 4096
    back = rng.uniform(0, 1e-3, 40)
    plan = plan_fusion(sizes, back, affine(5e-4, 2e-9))
    assert plan.num_buckets > 1
    caps = [int(c * MB) for c in plan.ddp_bucket_cap_mb_list()]
    assert ddp_buckets(sizes, caps) == plan.ends
    cap_mb, uniform = best_uniform_cap(sizes, back, affine(5e-4, 2e-9))
    assert uniform.finish_s >= plan.finish_s - 1e-12  # the exact plan is optimal
    assert ddp_buckets(sizes, [int(cap_mb * MB)]) == uniform.ends


def test_bad_inputs():
    with pytest.raises(ValueError, match="backward_s"):
        plan_fusion([1, 2], [0.1], affine(0, 1))
    with pytest.raises(ValueError, match="max_buckets"):
        plan_fusion([1, 2], [0.1, 0.1], affine(0, 1), max_buckets=0)
    with pytest.raises(ValueError, match="bucket ends"):
        simulate([1, 1, 2], [1, 2], [0, 0], affine(0, 1))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

    def forward(self, x):
        return self.layers(x)


def _ddp_buckets_seen(caps_mb):
    """Bucket sizes a one-rank DDP hands its comm hook, after DDP's bucket rebuild."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _run_ddp(caps_mb)
    finally:
        dist.destroy_process_group()


def _run_ddp(caps_mb):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb_list=caps_mb)
    seen = []

    def hook(state, bucket):
        seen.append(sum(t.numel() * t.element_size() for t in bucket.gradients()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, hook)
    for _ in range(3):  # DDP rebuilds its buckets after the first iteration
        seen.clear()
        model(torch.randn(4, 64)).sum().backward()
    return seen


@pytest.mark.skipif(not ddp_supports_bucket_list(), reason="this torch's DDP has no bucket_cap_mb_list")
def test_real_ddp_forms_the_planned_buckets():
    net = _Net()
    params = [p for p in net.parameters()][::-1]
    sizes = [p.numel() * 4 for p in params]
    back = [1e-3 if i % 2 == 0 else 0.0 for i in range(len(sizes))]
    cost = allreduce_cost("hier", Topology(2, 2), CommParams(1e-4, 1e-10, 1e-4, 4e-8, 0.0))
    plan = plan_fusion(sizes, back, cost)
    assert 1 < plan.num_buckets < len(sizes)
    seen = _ddp_buckets_seen(plan.ddp_kwargs()["bucket_cap_mb_list"])
    assert seen == list(plan.bucket_bytes)
