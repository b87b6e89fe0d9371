"""The honest baseline: plain DDP's flat all-reduce, priced as NCCL runs it or measured.

NCCL's ring and tree against the closed forms worked out by hand from the NCCL user guide,
its tuning model and nccl-tests' PERFORMANCE.md; a measured flat all-reduce replacing the
model; ``hier_auto`` installing no hook where plain DDP is within 5 % of the best; the
crossover table of ``fastscale-plan --crossover``; calibration timing the flat all-reduce on
two gloo processes.
"""
import json
import warnings

import pytest
from torch import nn

from lightning_fastscale.planner import (
    CommParams,
    CostModelPlanner,
    FlatMeasurement,
    Topology,
    allreduce_time,
    auto_plan,
    compare_algorithms,
    module_profile,
    nccl_ring_time,
    nccl_tree_time,
)
from lightning_fastscale.planner.baseline import crossover_params, crossover_table
from lightning_fastscale.planner.cli import main
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy
from tests.distributed import run_distributed

# 8 GPUs per node; NVLink-like in the node, one NIC at 10 Gbit/s (8e-10 s/B) per node.
NCCL = CommParams(alpha_intra=5e-6, beta_intra=1e-11, alpha_inter=2e-5, beta_inter=8e-10, gamma=0.0,
                  gamma_inter=0.0, backend="nccl")
S = 100e6  # bytes: 25M fp32 elements


def test_nccl_ring_and_tree_match_the_closed_forms_on_two_nodes():
    topo = Topology(2, 8)  # P = 16 ranks, N = 2 nodes
    # ring: 2(P-1) = 30 steps, 2(N-1) = 2 of them cross a node: 28 alpha_intra + 2 alpha_inter;
    # every link (the NIC too) carries 2(P-1)/P S = 1.875 S
    ring = 28 * 5e-6 + 2 * 2e-5 + 1.875 * S * 8e-10
    # tree: 2((G-1) alpha_intra + log2(N) alpha_inter); on 2 nodes a NIC carries S each way
    tree = 2 * (7 * 5e-6 + 1 * 2e-5) + S * 8e-10
    assert nccl_ring_time(topo, S, NCCL) == pytest.approx(ring, rel=1e-12)
    assert nccl_tree_time(topo, S, NCCL) == pytest.approx(tree, rel=1e-12)
    # plain DDP's flat path on NCCL is the better of the two: here the tree
    assert allreduce_time("flat", S / 4, topo, NCCL) == pytest.approx(tree, rel=1e-12)
    # nccl-tests: busbw = algbw * 2(P-1)/P. The ring's busbw is the NIC's rate (1.25 GB/s);
    # the tree's reaches about twice it on 2 nodes (NVIDIA/nccl 946, nccl-tests 196)
    nic = 1 / 8e-10
    assert S / ring * 1.875 == pytest.approx(nic, rel=2e-3)
    assert S / tree * 1.875 == pytest.approx(1.875 * nic, rel=2e-3)


def test_nccl_ring_and_tree_match_the_closed_forms_on_eight_nodes():
    topo = Topology(8, 8)  # P = 64, N = 8
    ring = (126 - 14) * 5e-6 + 14 * 2e-5 + 2 * 63 / 64 * S * 8e-10
    # from 4 nodes on, the busiest node is inner in one tree (parent + 2 children) and a leaf in
    # the other: 4 links x S/2 = 2 S each way; log2(8) = 3 inter-node hops each way
    tree = 2 * (7 * 5e-6 + 3 * 2e-5) + 2 * S * 8e-10
    assert nccl_ring_time(topo, S, NCCL) == pytest.approx(ring, rel=1e-12)
    assert nccl_tree_time(topo, S, NCCL) == pytest.approx(tree, rel=1e-12)
    assert allreduce_time("flat", S / 4, topo, NCCL) == pytest.approx(ring, rel=1e-12)  # the ring, here
    # three nodes: the tree's inner node is a root with two children (3 links x S/2 = 1.5 S)
    three = 2 * (7 * 5e-6 + 1 * 2e-5) + 1.5 * S * 8e-10
    assert nccl_tree_time(Topology(3, 8), S, NCCL) == pytest.approx(three, rel=1e-12)


def test_gloo_keeps_the_flat_ring():
    topo = Topology(2, 8)
    gloo = CommParams(5e-6, 1e-11, 2e-5, 8e-10, gamma=0.0, gamma_inter=0.0)
    assert gloo.backend == "gloo"
    # 2(P-1) lock-step steps, each as long as the slowest edge (the NIC, S/P bytes per step)
    step = max(2e-5 + S / 16 * 8e-10, 5e-6 + S / 16 * 1e-11)
    assert allreduce_time("flat", S / 4, topo, gloo) == pytest.approx(30 * step, rel=1e-12)
    with pytest.raises(ValueError, match="backend='mpi'"):
        CommParams(5e-6, 1e-11, 2e-5, 8e-10, backend="mpi")


def test_a_flat_measurement_replaces_the_model_where_it_applies():
    topo = Topology(2, 8)
    measured = FlatMeasurement(2, 8, "nccl", (4e6, 100e6), (0.01, 0.2))
    params = CommParams(5e-6, 1e-11, 2e-5, 8e-10, gamma_inter=0.0, backend="nccl", flat_measured=measured)
    assert allreduce_time("flat", 25e6, topo, params) == pytest.approx(0.2)  # exactly the measured point
    assert allreduce_time("flat", 13e6, topo, params) == pytest.approx(0.105)  # 52 MB: half-way between
    # other topologies and wire dtypes are still priced by the NCCL model
    model = CommParams(5e-6, 1e-11, 2e-5, 8e-10, gamma_inter=0.0, backend="nccl")
    assert allreduce_time("flat", 25e6, Topology(4, 8), params) == allreduce_time("flat", 25e6, Topology(4, 8), model)
    assert allreduce_time("flat", 25e6, topo, params, "fp16") == allreduce_time("flat", 25e6, topo, model, "fp16")
    assert allreduce_time("hier", 25e6, topo, params) == allreduce_time("hier", 25e6, topo, model)
    detail = compare_algorithms(25e6, topo, params)
    assert detail["baseline"]["source"] == "measured" and detail["baseline"]["seconds"] == pytest.approx(0.2)
    assert detail["baseline"]["model_s"] == pytest.approx(min(nccl_ring_time(topo, S, params),
                                                              nccl_tree_time(topo, S, params)))
    json.dumps(detail)  # plain data (JSON) for reports


def _profile():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    return model, module_profile(model, backward_time_s=1e-3)


def test_the_planner_picks_against_the_measured_flat_time():
    _, profile = _profile()
    topo = Topology(2, 4)
    # gloo model: the flat ring sends 2(P-1)/P = 1.75x what hier sends across a slow NIC -> hier
    slow_nic = CommParams(1e-6, 1e-12, 1e-5, 1e-9, gamma_inter=0.0)
    modelled = auto_plan(profile, topo, slow_nic, plain_ddp_tolerance=0.05)
    assert modelled.algorithm in ("hier", "torus2d") and not modelled.plain_ddp
    # the flat all-reduce measured fast on this cluster (the backend does better than a flat ring):
    # against that measurement plain DDP wins, no hook
    nbytes = sum(profile.grad_bytes)
    fast = FlatMeasurement(2, 4, "gloo", (nbytes / 8, nbytes), (1e-5, 1e-4))
    measured = auto_plan(profile, topo, CommParams(1e-6, 1e-12, 1e-5, 1e-9, gamma_inter=0.0, flat_measured=fast),
                         plain_ddp_tolerance=0.05)
    assert measured.plain_ddp and measured.algorithm == "flat" and "measured" in measured.reason
    assert measured.plan == measured.baseline
    # a slow measurement on a cluster whose NCCL model would keep plain DDP: hier wins
    nccl = CommParams(1e-6, 1e-12, 1e-5, 1e-9, gamma_inter=0.0, backend="nccl")
    assert auto_plan(profile, topo, nccl, plain_ddp_tolerance=0.05).plain_ddp
    slow = FlatMeasurement(2, 4, "nccl", (nbytes / 8, nbytes), (1e-3, 1e-2))
    picked = auto_plan(profile, topo, CommParams(1e-6, 1e-12, 1e-5, 1e-9, gamma_inter=0.0, backend="nccl",
                                                 flat_measured=slow), plain_ddp_tolerance=0.05)
    assert picked.algorithm in ("hier", "torus2d") and not picked.plain_ddp


def test_plain_ddp_only_within_the_tolerance():
    _, profile = _profile()
    topo = Topology(2, 4)
    nccl = CommParams(1e-6, 1e-12, 1e-5, 1e-9, gamma_inter=0.0, backend="nccl")
    plan = auto_plan(profile, topo, nccl, plain_ddp_tolerance=0.05)
    best = min(p.finish_s for p in plan.candidates.values())
    assert plan.plain_ddp and plan.baseline.finish_s <= 1.05 * best
    # with no tolerance the best algorithm is taken, whatever plain DDP does
    strict = auto_plan(profile, topo, nccl, plain_ddp_tolerance=None)
    assert strict.baseline is None and strict.plan.finish_s == best
    with pytest.raises(ValueError, match="plain_ddp_tolerance"):
        auto_plan(profile, topo, nccl, plain_ddp_tolerance=-0.1)


class _RecordingDDP:
    """Stands in for DistributedDataParallel: records hook registrations."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.hooks = module, []

    def parameters(self):
        return self.module.parameters()

    def register_comm_hook(self, state, hook) -> None:
        self.hooks.append(hook)


def _wired(params: CommParams) -> tuple[HierarchicalAllReduceStrategy, _RecordingDDP]:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    strategy = HierarchicalAllReduceStrategy(algorithm="auto", planner=CostModelPlanner(params, backward_time_s=1e-3))
    strategy.topology = Topology(2, 4)
    strategy._plan_ddp(model)
    ddp = _RecordingDDP(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy._install_hook(ddp)
    strategy.caught = [str(w.message) for w in caught]
    return strategy, ddp


def test_hier_auto_installs_no_hook_where_the_flat_path_wins():
    # NCCL cluster, 2 nodes: the tree moves as few bytes across the NIC as hier, so plain DDP wins
    strategy, ddp = _wired(CommParams(1e-6, 1e-12, 1e-5, 1e-9, gamma_inter=0.0, backend="nccl"))
    assert strategy.resolved_algorithm == "flat" and strategy.uses_ddp_allreduce
    assert ddp.hooks == [] and strategy.hook_state is None and strategy.caught == []
    assert "within 5% of the best" in strategy.plain_ddp_reason
    assert "plain_ddp_reason=plain DDP (nccl flat all-reduce, modelled)" in strategy.plan_message()
    summary = strategy.plan_summary()
    assert summary["strategy/algorithm"] == "flat" and summary["strategy/comm_hook"].startswith("none")
    # the same links on gloo (a flat ring): a two-level algorithm wins, so the strategy goes on to install its hook
    # (without a process group here it can only say it could not)
    strategy, ddp = _wired(CommParams(1e-6, 1e-12, 1e-5, 1e-9, gamma_inter=0.0))
    assert strategy.resolved_algorithm in ("hier", "torus2d") and not strategy.uses_ddp_allreduce
    assert strategy.plain_ddp_reason is None
    assert any("no communication hook was installed" in m for m in strategy.caught)


def test_crossover_table_and_cli(capsys):
    rows = crossover_table(models={"bert_large": 340_000_000}, nodes=(2, 4), gbit_s=(10,))
    two, four = rows
    assert two["baseline"] == "tree" and two["nccl_ring_s"] / two["nccl_tree_s"] == pytest.approx(1.875, rel=0.01)
    topo, params = Topology(4, 8), crossover_params(10)
    base = min(nccl_ring_time(topo, 1.36e9, params), nccl_tree_time(topo, 1.36e9, params))
    # the better of the strategy's default chunks (2 MiB per node) and unchunked buckets
    hier = min(allreduce_time("hier", 340e6, topo, params, chunk_numel=8 * 2**20 // 4),
               allreduce_time("hier", 340e6, topo, params))
    assert four["hier"] == pytest.approx(base / hier, rel=1e-9)
    # on 4 nodes hier moves 2(N-1)/N = 1.5x the gradient per NIC, NCCL's ring 2(P-1)/P = 1.94x
    assert 1.2 < four["hier"] < 1.94 / 1.5
    assert main(["--crossover"]) == 0
    out = capsys.readouterr().out
    assert "NCCL's flat all-reduce" in out and "| bert_large | 400 | 64 |" in out
    assert out.count("| resnet50 |") == 24 and out.count("| bert_large |") == 24
    assert main(["--crossover", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 48


def _measure_flat(rank, world_size):
    from lightning_fastscale.planner.calibrate import calibrate_process_groups, measure_flat_allreduce
    from lightning_fastscale.strategies.topology import build_process_groups

    measured = measure_flat_allreduce(None, [1 << 16, 1 << 20], Topology(2, 1), reps=1)
    groups = build_process_groups(Topology.from_world(world_size, 1))
    # sizes far apart, so the fit's "time grows with size" check holds on a loaded machine too
    result = calibrate_process_groups(groups, sizes=[1 << 12, 1 << 24], reps=2, flat_sizes=[1 << 18])
    return measured.as_dict(), result.params.as_dict()


@pytest.mark.slow  # two gloo processes timing all-reduces, about 11 s
def test_calibration_times_the_flat_allreduce_on_two_gloo_processes():
    results = run_distributed(_measure_flat, 2, timeout=120)
    assert results[0] == results[1]  # rank 0's measurement on every rank
    measured, params = results[0]
    assert (measured["nodes"], measured["ranks_per_node"], measured["backend"]) == (2, 1, "gloo")
    assert measured["sizes_bytes"] == [1 << 16, 1 << 20] and all(t > 0 for t in measured["seconds"])
    flat = params["flat_measured"]
    assert params["backend"] == "gloo" and flat["sizes_bytes"] == [1 << 18] and flat["seconds"][0] > 0
