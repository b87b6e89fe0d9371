"""strategy=hier_auto: the cost-model planner supplies the algorithm and the DDP bucket caps,
priced for the strategy's own wire dtype, top-k ratio and chunk size."""
import pytest
from torch import nn

from lightning_fastscale.planner import CommParams, CostModelPlanner
from lightning_fastscale.strategies import CommPlan, CommSetting, HierarchicalAllReduceStrategy, PlanRequest, Topology
from lightning_fastscale.strategies.planning import resolve_comm_plan

TWO_BY_FOUR = Topology(num_nodes=2, ranks_per_node=4)
# In-node links 100x faster than the node link unless said otherwise; 1 ms messages across nodes.
FAST_NODE = dict(alpha_intra=1e-6, beta_intra=1e-12, alpha_inter=1e-5, beta_inter=1e-10, gamma=0.0)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.Linear(1024, 10))


def _strategy(params: CommParams, **kw) -> HierarchicalAllReduceStrategy:
    planner = CostModelPlanner(params, backward_time_s=0.001)
    return HierarchicalAllReduceStrategy(algorithm="auto", planner=planner, **kw)


@pytest.mark.parametrize("params,expected", [
    # Same speed in and across nodes: every two-level stage only adds latency -> one flat all-reduce.
    (CommParams(1e-6, 1e-10, 1e-6, 1e-10), "flat"),
    # Slow node link that one flow fills, concurrent flows cost 8x each: only the leaders should cross.
    (CommParams(**FAST_NODE, beta_inter_shared=8e-10), "hier"),
    # One flow reaches a quarter of the link (per-flow limit): four concurrent shards fill it.
    (CommParams(**FAST_NODE, beta_flow=4e-10), "torus2d"),
])
def test_planner_picks_the_algorithm_the_cluster_calls_for(params: CommParams, expected: str) -> None:
    model = _model()
    algorithm, caps = _strategy(params).resolve_comm_plan(model, TWO_BY_FOUR)
    assert algorithm == expected
    model_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert caps and sum(caps) == pytest.approx(model_mb, rel=0.01)  # the buckets hold every gradient once


def test_strategy_hands_its_own_settings_to_the_planner() -> None:
    params = CommParams(**FAST_NODE)
    model = _model()
    strategy = _strategy(params, wire_dtype="fp16", compression="topk", topk_ratio=0.05, pipeline_chunk_mb=1.0)
    request = strategy.plan_request(model, TWO_BY_FOUR)
    told_setting = CommSetting(None, "fp16", 0.05, 1.0)
    assert (request.module, request.topology, request.setting) == (model, TWO_BY_FOUR, told_setting)
    algorithm, caps = strategy.resolve_comm_plan(model, TWO_BY_FOUR)
    told = strategy.planner.plan(model, TWO_BY_FOUR, told_setting)
    assert (algorithm, caps) == (told.algorithm, told.plan.ddp_bucket_cap_mb_list())
    fp32 = strategy.planner.plan(model, TWO_BY_FOUR, CommSetting(None, "fp32", None, 1.0))
    assert told.plan.finish_s < fp32.plan.finish_s  # fp16 + top-k really was priced: fewer bytes cross


def test_explicit_settings_win_over_the_planner() -> None:
    params = CommParams(**FAST_NODE, beta_flow=4e-10)
    assert _strategy(params, bucket_cap_mb=5).resolve_comm_plan(_model(), TWO_BY_FOUR) == ("torus2d", None)
    planner = CostModelPlanner(params, backward_time_s=0.001)
    fixed = HierarchicalAllReduceStrategy(algorithm="hier", planner=planner, fusion_plan=[1.0, 8.0])
    assert fixed.resolve_comm_plan(_model(), TWO_BY_FOUR) == ("hier", [1.0, 8.0])
    # a fixed algorithm still gets buckets planned for that algorithm
    algorithm, caps = HierarchicalAllReduceStrategy(algorithm="hier", planner=planner).resolve_comm_plan(
        _model(), TWO_BY_FOUR)
    assert algorithm == "hier"
    assert caps == planner.plan(_model(), TWO_BY_FOUR, CommSetting(("hier",))).plan.ddp_bucket_cap_mb_list()


class _Recorder:
    """A planner of its own: any object with plan_comm plugs in."""

    def __init__(self, answer: CommPlan) -> None:
        self.answer, self.requests = answer, []

    def plan_comm(self, request: PlanRequest) -> CommPlan:
        self.requests.append(request)
        return self.answer


def test_any_comm_planner_plugs_in_and_is_asked_once() -> None:
    model = _model()
    planner = _Recorder(CommPlan("torus2d", (2.0, 30.0)))
    strategy = HierarchicalAllReduceStrategy(algorithm="auto", planner=planner, wire_dtype="bf16")
    assert strategy.resolve_comm_plan(model, TWO_BY_FOUR) == ("torus2d", [2.0, 30.0])
    assert [(r.setting.wire_dtype, r.setting.algorithms) for r in planner.requests] == [("bf16", None)]
    plain = HierarchicalAllReduceStrategy(algorithm="auto", planner=_Recorder(CommPlan("flat", None, "cheap enough")))
    assert plain.resolve_comm_plan(model, TWO_BY_FOUR) == ("flat", None) and plain.plain_ddp_reason == "cheap enough"
    # without a planner, "auto" is hier across nodes and flat in one, with DDP's buckets
    auto = HierarchicalAllReduceStrategy(algorithm="auto")
    assert auto.resolve_comm_plan(model, TWO_BY_FOUR) == ("hier", None)
    assert auto.resolve_comm_plan(model, Topology(1, 4)) == ("flat", None)
    with pytest.raises(TypeError, match="plan_comm"):
        HierarchicalAllReduceStrategy(algorithm="auto", planner=lambda module, topology: "hier")
    with pytest.raises(ValueError, match="choose one of"):
        CommPlan("ring")


def test_resolution_alone_overlays_the_explicit_settings_on_the_plan() -> None:
    request = PlanRequest(nn.Linear(2, 2), TWO_BY_FOUR)
    planner = _Recorder(CommPlan("torus2d", (2.0, 30.0), plain_ddp_reason="cheap"))
    assert resolve_comm_plan(request, planner, algorithm="auto") == CommPlan("torus2d", (2.0, 30.0), "cheap")
    assert resolve_comm_plan(request, planner, algorithm="hier") == CommPlan("hier", (2.0, 30.0))
    assert resolve_comm_plan(request, planner, algorithm="auto", fusion_plan=[1.0]) == CommPlan("torus2d", (1.0,), "cheap")
    assert resolve_comm_plan(request, planner, algorithm="auto", uniform_cap=True).fusion_plan is None
    # A user hook takes the place of the plain path, so plain DDP is never chosen for it.
    assert resolve_comm_plan(request, planner, algorithm="auto", user_hook=True).plain_ddp_reason is None
    assert len(planner.requests) == 5  # asked once per resolution
    assert resolve_comm_plan(request, None, algorithm="torus2d") == CommPlan("torus2d")
