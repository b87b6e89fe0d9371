"""fastscale-plan: JSON parses and is consistent, plot is written, bad input errors clearly."""
import json

import pytest
import yaml

from lightning_fastscale.planner.cli import main
from lightning_fastscale.planner.cost_model import ALGORITHMS
from lightning_fastscale.planner.profile import profile_model


def test_json_report(capsys, tmp_path):
    png = tmp_path / "scaling.png"
    assert main(["resnet18", "tencent_p40_100g", "--gpus", "64", "--max-gpus", "256", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"]["gpus"] == 64 and report["cluster"]["nodes"] == 8
    assert set(report["allreduce_s"]) == set(ALGORITHMS)
    finish = report["fusion"]["per_algorithm_finish_s"]
    assert report["chosen_algorithm"] == min(finish, key=finish.get)
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


def test_bad_cluster_errors_clearly(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "nodes": 2, "ranks_per_node": 4, "intra": {"bandwidth_gbit_s": 100, "latency_us": 1},
        "inter": {"bandwidth_gbit_s": 0, "latency_us": 1}, "device": {"sustained_tflops": 1},
    }))
    assert main(["resnet18", str(path)]) == 2
    assert "inter.bandwidth_gbit_s" in capsys.readouterr().err
    assert main(["resnet18", "tencent_p40_100g", "--gpus", "12"]) == 2
    assert "ranks_per_node=8" in capsys.readouterr().err


def test_profile_of_resnet50():
    profile = profile_model("resnet50", batch=1, input_size=224, sustained_tflops=1.0)
    assert profile.numel == 25_557_032
    assert profile.names[0] == "fc.bias" and profile.names[-1] == "conv1.weight"
    # 4.1 GMAC forward per image (He et al. 2016) = 8.2 GFLOP; at 1 TFLOP/s that is 8.2 ms
    assert profile.forward_s == pytest.approx(8.18e-3, rel=0.01)
    assert profile.backward_total_s == pytest.approx(2 * profile.forward_s, rel=0.01)
