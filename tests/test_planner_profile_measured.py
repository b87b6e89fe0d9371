"""measure_backward_profile: real gradient-ready order, sizes, state left alone; planner use."""
import pytest
import torch
from torch import nn

from lightning_fastscale.planner import CommParams, CostModelPlanner, Topology
from lightning_fastscale.planner.profile import measure_backward_profile, profile_module
from tests.distributed import run_distributed


class RegisteredOutOfOrder(nn.Module):
    """``head`` is registered first but runs last, so backward readies its gradients first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 10)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_measured_profile_follows_the_real_gradient_order():
    torch.manual_seed(0)
    model = RegisteredOutOfOrder()
    x = torch.randn(64, 32)
    measured = measure_backward_profile(model, x, reps=2)
    names = list(measured.names)
    # every head gradient before every body gradient: the order backward really produced them
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert max(names.index(n) for n in ("head.weight", "head.bias")) < min(
        names.index(n) for n in names if n.startswith("body."))
    # the FLOP estimate assumes reverse registration order, which puts head last here
    assert list(profile_module(model, x, 1.0).names)[-2:] in (["head.bias", "head.weight"], ["head.weight", "head.bias"])
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    assert list(measured.grad_bytes) == [sizes[n] for n in names]
    assert all(t >= 0 for t in measured.backward_s) and measured.backward_total_s > 0 and measured.forward_s > 0


def test_measuring_leaves_gradients_and_batch_norm_statistics_alone():
    torch.manual_seed(0)
    model = RegisteredOutOfOrder()
    model(torch.randn(8, 32)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    measure_backward_profile(model, torch.randn(16, 32), loss_fn=lambda out: out.pow(2).mean(), reps=1)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    with pytest.raises(ValueError, match="reps"):
        measure_backward_profile(model, torch.randn(4, 32), reps=0)


SLOW_NIC = CommParams(alpha_intra=5e-6, beta_intra=1e-11, alpha_inter=2e-5, beta_inter=8e-9, gamma=0.0)


def test_planner_needs_an_input_to_measure_on():
    planner = CostModelPlanner(SLOW_NIC, measure_backward=True)
    with pytest.raises(ValueError, match=r"measure_backward=True\) needs example_input"):
        planner.plan(RegisteredOutOfOrder(), Topology(2, 2))


def _plan_measured(rank, world_size):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = RegisteredOutOfOrder()
    # a different input size per rank: the ranks' own timings differ, the plan must not
    planner = CostModelPlanner(SLOW_NIC, measure_backward=True, example_input=torch.randn(32 * (rank + 1), 32))
    summary = planner.plan(model, Topology(2, world_size // 2)).summary()
    dist.barrier()
    return summary


@pytest.mark.slow  # 4 ranks timing backward: about 20 s
def test_measured_plan_is_rank_0s_on_every_rank():
    # predicted_finish_s adds the measured backward time, so ranks that planned from their own
    # timings would disagree in it
    results = run_distributed(_plan_measured, 4, timeout=300)  # about 60 s on the loaded 2-core machine
    assert all(summary == results[0] for summary in results)
    assert results[0]["algorithm"] in ("flat", "hier", "torus2d")
    assert all(t > 0 for t in results[0]["predicted_finish_s"].values())
