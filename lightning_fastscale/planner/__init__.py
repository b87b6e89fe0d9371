"""Communication planner: alpha-beta-gamma cost model (Thakur et al. 2005), fusion planning (Jia et al.
2018) and scaling prediction, every algorithm held against the flat all-reduce plain DDP really runs.
"""
from lightning_fastscale.planner.auto import AutoPlan, CostModelPlanner, auto_plan, best_chunk_plan, module_profile
from lightning_fastscale.planner.baseline import (
    PLAIN_DDP_TOLERANCE,
    compare_algorithms,
    crossover_table,
    format_crossover,
)
from lightning_fastscale.planner.bn_span_cost import bn_channels, bn_span_cost
from lightning_fastscale.planner.calibrate import measure_flat_allreduce
from lightning_fastscale.planner.cluster import Cluster, ClusterConfigError, available_clusters, load_cluster
from lightning_fastscale.planner.cost_model import (
    ALGORITHMS,
    BACKENDS,
    CommParams,
    CommSetting,
    FlatMeasurement,
    Topology,
    allreduce_time,
    bandwidth_bound,
    choose_algorithm,
    flat_allreduce_detail,
    nccl_ring_time,
    nccl_tree_time,
    predict_allreduce,
    stage_times,
    wire_bytes_per_element,
)
from lightning_fastscale.planner.fusion import FusionPlan, best_uniform_cap, ddp_buckets, plan_fusion
from lightning_fastscale.planner.profile import GradientProfile, measure_backward_profile, profile_model, profile_module
from lightning_fastscale.planner.scaling import allreduce_cost, predict_step, scaling_curve
from lightning_fastscale.strategies.options import DEFAULT_PIPELINE_CHUNK_MB, PLAIN_DDP

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "DEFAULT_PIPELINE_CHUNK_MB",
    "PLAIN_DDP",
    "PLAIN_DDP_TOLERANCE",
    "AutoPlan",
    "Cluster",
    "ClusterConfigError",
    "CommParams",
    "CommSetting",
    "CostModelPlanner",
    "FlatMeasurement",
    "FusionPlan",
    "GradientProfile",
    "Topology",
    "allreduce_cost",
    "allreduce_time",
    "auto_plan",
    "available_clusters",
    "bandwidth_bound",
    "best_chunk_plan",
    "best_uniform_cap",
    "bn_channels",
    "bn_span_cost",
    "choose_algorithm",
    "compare_algorithms",
    "crossover_table",
    "ddp_buckets",
    "flat_allreduce_detail",
    "format_crossover",
    "load_cluster",
    "measure_backward_profile",
    "measure_flat_allreduce",
    "module_profile",
    "nccl_ring_time",
    "nccl_tree_time",
    "plan_fusion",
    "predict_allreduce",
    "predict_step",
    "profile_model",
    "profile_module",
    "scaling_curve",
    "stage_times",
    "wire_bytes_per_element",
]
