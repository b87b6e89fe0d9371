"""The planner prices a BN span: two all-reduces of 2C + 1 statistics per BN layer and step (what
``SpanBatchNormLayer`` really sends), on NCCL's ring or tree across nodes, and prices a span across nodes
against the widest span inside a node in ``fastscale-plan``."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchvision

from lightning_fastscale.callbacks.bn_span import SpanBatchNormLayer
from lightning_fastscale.planner.bn_span_cost import bn_channels, bn_span_cost
from lightning_fastscale.planner.cli import main
from lightning_fastscale.planner.cluster import load_cluster
from lightning_fastscale.planner.cost_model import nccl_ring_time, nccl_tree_time, ring_allreduce_time
from lightning_fastscale.strategies.topology import Topology


def test_a_span_layer_sends_two_allreduces_of_2c_plus_1_values_per_step(tmp_path, monkeypatch) -> None:
    sizes: list[int] = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **kw: (sizes.append(tensor.numel()),
                                                                      all_reduce(tensor, *a, **kw))[1])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = SpanBatchNormLayer(6, group=dist.group.WORLD)
        layer(torch.randn(4, 6, 3, 3, requires_grad=True)).square().sum().backward()
    finally:
        dist.destroy_process_group()
    assert sizes == [2 * 6 + 1, 2 * 6 + 1]  # the statistics forward, their gradient backward


def test_cost_is_the_closed_form_inside_a_node_and_across_nodes() -> None:
    params = load_cluster("tencent_p40_100g").comm_params()  # NCCL, 8 ranks per node
    channels = bn_channels(torchvision.models.resnet18())
    assert len(channels) == 20 and channels[:2] == [64, 64]
    topology = Topology(4, 8)
    inside = bn_span_cost(128, 32, topology, params, channels)  # 4 ranks of one node
    expected = sum(2 * ring_allreduce_time(4, (2 * c + 1) * 4, params.alpha_intra, params.beta_intra, params.gamma)
                   for c in channels)
    assert (inside["ranks_per_group"], inside["group_nodes"]) == (4, 1)
    assert inside["sync_s"] == pytest.approx(expected, rel=1e-12)
    across = bn_span_cost(512, 32, topology, params, channels)  # 16 ranks: 2 nodes of 8
    group = Topology(2, 8)
    expected = sum(2 * min(nccl_ring_time(group, (2 * c + 1) * 4, params), nccl_tree_time(group, (2 * c + 1) * 4, params))
                   for c in channels)
    assert (across["ranks_per_group"], across["group_nodes"], across["allreduces_per_step"]) == (16, 2, 40)
    assert across["sync_s"] == pytest.approx(expected, rel=1e-12) and across["sync_s"] > inside["sync_s"]
    assert across["widest_span_in_node"] == 256 and "widest_span_in_node_sync_s" not in inside
    assert across["widest_span_in_node_sync_s"] == pytest.approx(bn_span_cost(256, 32, topology, params, channels)["sync_s"])
    ghost = bn_span_cost(16, 32, topology, params, channels)
    assert (ghost["ranks_per_group"], ghost["sync_s"], ghost["allreduces_per_step"]) == (1, 0.0, 0)
    with pytest.raises(ValueError, match=r"use bn_span=64 or 128"):
        bn_span_cost(100, 32, topology, params, channels)


def test_fastscale_plan_prices_a_span_across_nodes_against_one_inside_a_node(capsys) -> None:
    args = ["resnet18", "tencent_p40_100g", "--per-gpu-batch", "32", "--gpus", "32", "--max-gpus", "32"]
    assert main([*args, "--bn-span", "512", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    step, bn = report["step"], report["bn_span"]
    assert bn["group_nodes"] == 2 and step["bn_sync_s"] == bn["sync_s"] > 0
    assert step["step_s"] == pytest.approx(step["compute_s"] + step["exposed_comm_s"] + bn["sync_s"])
    assert main([*args, "--bn-span", "512"]) == 0
    text = capsys.readouterr().out
    assert "BN span 512: groups of 16 ranks across 2 nodes" in text
    assert (f"every BN layer waits on the link between nodes twice a step (bn_span=256, the widest inside a node: "
            f"{bn['widest_span_in_node_sync_s'] * 1e3:.2f} ms)") in text
    assert f"+ BN statistics {bn['sync_s'] * 1e3:.2f} ms" in text
    assert main([*args, "--bn-span", "128"]) == 0
    text = capsys.readouterr().out
    assert "BN span 128: groups of 4 ranks inside a node" in text and "waits on the link" not in text
    assert main([*args, "--bn-span", "100"]) == 2
    assert "use bn_span=64 or 128" in capsys.readouterr().err


def test_the_planner_page_quotes_todays_prediction(capsys) -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    command = "fastscale-plan resnet50 tencent_cloud_25g_vpc --per-gpu-batch 64 --bn-span 1024"
    assert command in page
    assert main([*command.split()[1:], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    bn, compute = report["bn_span"], report["step"]["compute_s"]
    quoted = (f"adds {bn['sync_s'] * 1e3:.1f} ms per step to {compute * 1e3:.1f} ms of compute; "
              f"{bn['widest_span_in_node']} (8 ranks, one node) would add {bn['widest_span_in_node_sync_s'] * 1e3:.1f} ms")
    assert quoted in " ".join(page.split())


def test_the_pages_quote_the_measured_bn_span_against_the_rule() -> None:
    root = Path(__file__).resolve().parents[1]
    measured = json.loads((root / "benchmarks" / "results" / "bn_span_cost.json").read_text())["report"]
    ratios = sorted(statistics.median(r["added_s"]) / r["rule_s"] for r in measured.values())
    quoted = f"{ratios[0]:.2f}x and {ratios[-1]:.2f}x"
    assert quoted in " ".join((root / "benchmarks" / "README.md").read_text().split())
    assert f"{ratios[0]:.2f}-{ratios[-1]:.2f}x" in " ".join((root / "docs" / "planner.md").read_text().split())
