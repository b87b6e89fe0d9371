"""strategy=hier_auto: the cost-model planner supplies the algorithm and the DDP bucket caps,
priced for the strategy's own wire dtype, top-k ratio and chunk size."""
import pytest
from torch import nn

from lightning_fastscale.planner import CommParams, CostModelPlanner
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy, Topology

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
    assert strategy.planner_settings() == {"wire_dtype": "fp16", "topk_ratio": 0.05, "pipeline_chunk_mb": 1.0}
    algorithm, caps = strategy.resolve_comm_plan(model, TWO_BY_FOUR)
    told = strategy.planner.plan(model, TWO_BY_FOUR, wire_dtype="fp16", topk_ratio=0.05, pipeline_chunk_mb=1.0)
    assert (algorithm, caps) == (told.algorithm, told.plan.ddp_bucket_cap_mb_list())
    fp32 = strategy.planner.plan(model, TWO_BY_FOUR, wire_dtype="fp32", topk_ratio=None, pipeline_chunk_mb=1.0)
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
    assert caps == planner.plan(_model(), TWO_BY_FOUR, algorithms=("hier",)).plan.ddp_bucket_cap_mb_list()
