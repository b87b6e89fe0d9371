"""fastscale-plan: JSON parses and is consistent, plot is written, bad input errors clearly."""
import json

import pytest
import yaml

from lightning_fastscale.planner.cli import main
from lightning_fastscale.planner.cluster import load_cluster
from lightning_fastscale.planner.cost_model import ALGORITHMS, CommSetting, Topology, predict_allreduce
from lightning_fastscale.planner.profile import profile_model


def test_json_report(capsys, tmp_path):
    png = tmp_path / "scaling.png"
    assert main(["resnet18", "tencent_p40_100g", "--gpus", "64", "--max-gpus", "256", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"]["gpus"] == 64 and report["cluster"]["nodes"] == 8
    assert set(report["allreduce_s"]) == set(ALGORITHMS)
    finish = report["fusion"]["per_algorithm_finish_s"]
    if report["plain_ddp"]:  # plain DDP (flat, fp32, no hook) kept within 5 % of the best
        assert report["chosen_algorithm"] == "flat"
        assert report["fusion"]["auto"]["finish_s"] <= 1.05 * min(finish.values())
    else:
        assert report["chosen_algorithm"] == min(finish, key=finish.get)
    assert report["flat_baseline"]["backend"] == "nccl" and report["flat_baseline"]["source"] == "model"
    assert report["flat_baseline"]["seconds"] == min(report["flat_baseline"]["nccl_ring_s"],
                                                     report["flat_baseline"]["nccl_tree_s"])
    plan = report["fusion"]["auto"]
    assert sum(plan["bucket_mb"]) == pytest.approx(report["workload"]["gradient_mb"], rel=1e-3)
    # the exact plan is never worse than the best single cap or two segments
    assert plan["finish_s"] <= report["fusion"]["best_bucket_cap_mb"]["finish_s"] + 1e-12
    assert plan["finish_s"] <= report["fusion"]["two_segment"]["finish_s"] + 1e-12
    step = report["step"]
    assert step["step_s"] == pytest.approx(step["compute_s"] + step["exposed_comm_s"])
    gpus = sorted({p["gpus"] for p in report["scaling"]["points"]})
    assert gpus == [1, 8, 16, 32, 64, 128, 256]
    for point in report["scaling"]["points"]:
        assert 0 < point["efficiency"] <= 1
        if point["gpus"] == 1:
            assert point["efficiency"] == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_report(capsys):
    assert main(["resnet18", "emulated_local", "--max-gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert "chosen algorithm" in out and "bucket_cap_mb_list" in out and "scaling efficiency" in out
    assert "pipelined in 4 MiB chunks" in out


def test_pipeline_chunk_option(capsys):
    args = ["resnet18", "tencent_p40_100g", "--gpus", "64", "--max-gpus", "64", "--json"]
    assert main([*args, "--pipeline-chunk-mb", "0"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*args, "--pipeline-chunk-mb", "1"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert whole["workload"]["pipeline_chunk_mb"] is None and chunked["workload"]["pipeline_chunk_mb"] == 1
    cluster = load_cluster("tencent_p40_100g")
    numel, wire = chunked["workload"]["parameters"], cluster.workload.wire_dtype
    for report, chunk_mb in ((whole, None), (chunked, 1.0)):
        expected = predict_allreduce(numel, Topology(8, 8), cluster.comm_params(), CommSetting(None, wire, None, chunk_mb))
        assert report["allreduce_s"] == pytest.approx(expected, rel=1e-12)
    assert chunked["allreduce_s"] != whole["allreduce_s"]
    assert main([*args, "--pipeline-chunk-mb", "-1"]) == 2
    assert "chunk_mb" in capsys.readouterr().err


def test_bad_cluster_errors_clearly(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "backend": "nccl", "nodes": 2, "ranks_per_node": 4, "intra": {"bandwidth_gbit_s": 100, "latency_us": 1},
        "inter": {"bandwidth_gbit_s": 0, "latency_us": 1}, "device": {"sustained_tflops": 1},
    }))
    assert main(["resnet18", str(path)]) == 2
    assert "inter.bandwidth_gbit_s" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "backend": "mpi"}))
    assert main(["resnet18", str(path)]) == 2
    assert "`backend` ='mpi' must be one of ['nccl', 'gloo']" in capsys.readouterr().err
    assert main(["resnet18", "tencent_p40_100g", "--gpus", "12"]) == 2
    assert "ranks_per_node=8" in capsys.readouterr().err


def test_profile_of_resnet50():
    profile = profile_model("resnet50", batch=1, input_size=224, sustained_tflops=1.0)
    assert profile.numel == 25_557_032
    assert profile.names[0] == "fc.bias" and profile.names[-1] == "conv1.weight"
    # 4.1 GMAC forward per image (He et al. 2016) = 8.2 GFLOP; at 1 TFLOP/s that is 8.2 ms
    assert profile.forward_s == pytest.approx(8.18e-3, rel=0.01)
    assert profile.backward_total_s == pytest.approx(2 * profile.forward_s, rel=0.01)
