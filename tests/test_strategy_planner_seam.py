"""strategy=hier_auto: the cost-model planner supplies the algorithm and the DDP bucket caps."""
import pytest
from torch import nn

from lightning_fastscale.planner import CostModelPlanner
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy, Topology


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.Linear(256, 10))


def test_planner_drives_algorithm_and_fusion():
    planner = CostModelPlanner("emulated_local", backward_time_s=0.01)
    strategy = HierarchicalAllReduceStrategy(algorithm="auto", planner=planner)
    model, topology = _model(), Topology(world_size=8, ranks_per_node=4)
    chosen = strategy.algorithm_selector(model, topology)
    plan = planner.plan(model, topology)
    assert chosen == plan.algorithm and chosen in ("ring", "hier", "torus2d")
    caps = strategy.fusion_plan(model, topology)
    assert caps == plan.plan.ddp_bucket_cap_mb_list() and len(caps) >= 1
    model_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert sum(caps) == pytest.approx(model_mb, rel=0.01)  # the buckets hold every gradient once


def test_explicit_fusion_wins_over_planner():
    planner = CostModelPlanner("emulated_local", backward_time_s=0.01)
    strategy = HierarchicalAllReduceStrategy(algorithm="auto", planner=planner, bucket_cap_mb=5)
    assert strategy.fusion_plan is None


def test_planner_settings_must_match_the_wire():
    planner = CostModelPlanner("emulated_local", backward_time_s=0.01, wire_dtype="fp32")
    with pytest.raises(ValueError, match="wire_dtype"):
        HierarchicalAllReduceStrategy(algorithm="auto", comm_dtype="fp16", planner=planner)
    with pytest.raises(ValueError, match="pipeline_chunk_mb"):
        HierarchicalAllReduceStrategy(algorithm="auto", pipeline_chunk_mb=None, planner=planner)
