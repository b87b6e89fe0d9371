"""The strategy seam: auto_plan picks the algorithm with the earliest predicted finish."""
import pytest
import torch
from torch import nn

from lightning_fastscale.planner import (
    CommParams,
    CommSetting,
    CostModelPlanner,
    Topology,
    auto_plan,
    choose_algorithm,
    load_cluster,
    module_profile,
)
from lightning_fastscale.planner.fusion import MB
from lightning_fastscale.strategies.options import DEFAULT_PIPELINE_CHUNK_MB
from lightning_fastscale.strategies.planning import PlanRequest

SLOW_NIC = CommParams(alpha_intra=5e-6, beta_intra=1e-11, alpha_inter=2e-5, beta_inter=8e-9, gamma=0.0)
FLAT = CommParams(alpha_intra=1e-6, beta_intra=1e-9, alpha_inter=1e-6, beta_inter=1e-9, gamma=0.0)


def net():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def test_module_profile_from_time_and_from_flops():
    model = net()
    prof = module_profile(model, backward_time_s=0.01)
    assert prof.names[0] == "4.bias" and sum(prof.grad_bytes) == 4 * sum(p.numel() for p in model.parameters())
    assert prof.backward_total_s == pytest.approx(0.01)
    flops = module_profile(model, example_input=torch.randn(8, 256), sustained_tflops=1e-3)
    # backward = 2 x forward matmul FLOPs: 2 * 2 * 8 * (256*512 + 512*512 + 512*10) / 1e9 s
    assert flops.backward_total_s == pytest.approx(4 * 8 * (256 * 512 + 512 * 512 + 512 * 10) / 1e9)
    with pytest.raises(ValueError, match="backward_time_s"):
        module_profile(model)


def test_auto_plan_choices():
    prof = module_profile(net(), backward_time_s=0.01)
    slow = auto_plan(prof, Topology(4, 8), SLOW_NIC)
    assert slow.algorithm in ("hier", "torus2d")
    assert slow.plan.finish_s == min(p.finish_s for p in slow.candidates.values())
    assert sum(slow.ddp_kwargs["bucket_cap_mb_list"]) * MB == pytest.approx(sum(prof.grad_bytes))
    assert auto_plan(prof, Topology(4, 8), FLAT).algorithm == "flat"
    assert auto_plan(prof, Topology(1, 8), SLOW_NIC).algorithm == "flat"
    assert set(slow.summary()) == {"algorithm", "plan", "ddp_kwargs", "predicted_finish_s", "plain_ddp", "reason",
                                   "plain_ddp_finish_s"}


def test_choose_algorithm_from_a_cluster():
    # The cluster runs NCCL: its flat all-reduce is the better of NCCL's ring and tree. On 2 nodes
    # the tree moves as few bytes across the NIC as any two-level algorithm, so flat wins on
    # latency; on 4 nodes the torus moves 2(N-1)/N = 1.5x the gradient per NIC against NCCL's 2x
    # (tree) or 2(P-1)/P (ring), so it wins.
    cluster = load_cluster("tencent_cloud_25g_vpc")
    half = CommSetting(wire_dtype="fp16", pipeline_chunk_mb=None)
    assert choose_algorithm(cluster, 100e6, cluster.topology(2), half) == "flat"
    assert choose_algorithm(cluster, 100e6, cluster.topology(4), half) == "torus2d"


def test_cost_model_planner_plans_what_it_is_told_to_send():
    model = net()
    topo = Topology.from_world(32, 8)
    profile = module_profile(model, backward_time_s=0.01)
    planner = CostModelPlanner(SLOW_NIC, backward_time_s=0.01)
    # the planner prices buckets as the strategy sends them: pipelined in its chunks, or whole
    for chunk_mb in (DEFAULT_PIPELINE_CHUNK_MB, 0.25, None):
        expected = auto_plan(profile, Topology(4, 8), SLOW_NIC, CommSetting(pipeline_chunk_mb=chunk_mb))
        got = planner.plan(model, topo, CommSetting(pipeline_chunk_mb=chunk_mb))
        assert got.algorithm == expected.algorithm
        assert got.plan.ddp_bucket_cap_mb_list() == expected.plan.ddp_bucket_cap_mb_list()
    # the strategy's question with its defaults (fp32, no top-k, its default chunking) gets the same plan
    default = auto_plan(profile, Topology(4, 8), SLOW_NIC, CommSetting(pipeline_chunk_mb=DEFAULT_PIPELINE_CHUNK_MB),
                        plain_ddp_tolerance=planner.plain_ddp_tolerance)
    answer = planner.plan_comm(PlanRequest(model, topo))
    assert answer.algorithm == default.algorithm
    assert answer.fusion_plan == tuple(default.plan.ddp_bucket_cap_mb_list())
    assert answer.plain_ddp_reason == (default.reason if default.plain_ddp else None)
    with pytest.raises(ValueError, match="pipeline_chunk_mb"):
        planner.plan(model, topo, CommSetting(pipeline_chunk_mb=0))
    # from a shipped cluster, with FLOP-based backward times from an example input
    planner = CostModelPlanner("tencent_cloud_25g_vpc", example_input=torch.randn(4, 256))
    half = planner.plan(model, Topology(2, 8), CommSetting(wire_dtype="fp16"))
    # on 2 NCCL nodes the flat path with a 16-bit wire beats plain DDP's fp32 by more than 5 %: a hook
    assert half.algorithm == "flat" and not half.plain_ddp
    assert half.baseline.finish_s > 1.05 * half.plan.finish_s and "sooner than plain DDP" in half.reason
    with pytest.raises(ValueError, match="backward_time_s"):
        CostModelPlanner(SLOW_NIC).plan(model, topo)
    with pytest.raises(ValueError, match="calibrate=True"):
        CostModelPlanner()
    # one rank sends nothing: calibrate=True plans it without a process group, as a one-device run needs
    alone = CostModelPlanner(calibrate=True, backward_time_s=1e-3).plan(model, Topology(1, 1))
    assert alone.algorithm == "flat" and alone.plan.comm_s == 0.0


def test_best_chunk_follows_latency():
    from lightning_fastscale.planner import best_chunk_plan

    prof = module_profile(nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048)), backward_time_s=1e-3)
    topo = Topology(4, 8)
    # no latency: smaller chunks only overlap the stages better, so the smallest candidate wins
    free = CommParams(alpha_intra=0.0, beta_intra=1e-9, alpha_inter=0.0, beta_inter=8e-9, gamma=0.0)
    chunk, plan, finish = best_chunk_plan(prof, topo, free, CommSetting(("hier", "torus2d")))
    assert chunk == 1.0 and plan.plan.finish_s == pytest.approx(min(finish.values()), rel=1e-9)
    assert finish[1.0] < finish[None]
    # large per-message latency: every chunk pays it, so one piece wins
    slow = CommParams(alpha_intra=1e-2, beta_intra=1e-9, alpha_inter=1e-2, beta_inter=8e-9, gamma=0.0)
    chunk, plan, finish = best_chunk_plan(prof, topo, slow, CommSetting(("hier", "torus2d")))
    assert chunk is None and plan.plan.finish_s == pytest.approx(min(finish.values()), rel=1e-9)


def test_calibration_retries_with_larger_sizes_where_timings_do_not_grow(monkeypatch):
    """On a fast link small messages time as noise; the planner measures 4x larger ones, twice, then gives up."""
    import lightning_fastscale.planner.calibrate as calibrate
    import lightning_fastscale.strategies.topology as topology
    from lightning_fastscale.planner.auto import CALIBRATION_ATTEMPTS

    class Groups:
        def destroy(self) -> None:
            pass

    tried: list[list[int]] = []

    def fit(groups, sizes, wire_dtype, flat_sizes):
        tried.append(list(sizes))
        if min(sizes) < 1 << 20:
            raise ValueError("calibration timings ... do not grow with size: use larger calibration sizes")
        return type("Fit", (), {"params": SLOW_NIC})()

    monkeypatch.setattr(topology, "build_process_groups", lambda topo, timeout=None: Groups())
    monkeypatch.setattr(calibrate, "calibrate_process_groups", fit)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 10))
    planner = CostModelPlanner(calibrate=True, calibration_sizes=[1 << 16, 1 << 18], backward_time_s=1e-3)
    planner.plan(model, Topology(2, 1))
    assert tried == [[1 << 16, 1 << 18], [1 << 18, 1 << 20], [1 << 20, 1 << 22]] and planner.params is SLOW_NIC
    tried.clear()
    with pytest.raises(ValueError, match="do not grow with size"):
        CostModelPlanner(calibrate=True, calibration_sizes=[16, 64], backward_time_s=1e-3).plan(model, Topology(2, 1))
    assert len(tried) == CALIBRATION_ATTEMPTS
