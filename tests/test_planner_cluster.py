"""Cluster descriptions: shipped ones load; nonsense gets an error naming the field."""
import pytest
import yaml

from lightning_fastscale.planner.cluster import ClusterConfigError, available_clusters, load_cluster

GOOD = {
    "name": "t", "backend": "nccl", "nodes": 2, "ranks_per_node": 4,
    "intra": {"bandwidth_gbit_s": 100, "latency_us": 5},
    "inter": {"bandwidth_gbit_s": 10, "latency_us": 20},
    "device": {"name": "x", "sustained_tflops": 10},
}


def write(tmp_path, **changes):
    raw = {**GOOD, **changes}
    raw = {k: v for k, v in raw.items() if v is not None}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_shipped_clusters_load_and_cite_sources():
    names = available_clusters()
    for expected in ("tencent_p40_100g", "sony_v100_abci", "horovod_torus_10gbe", "tencent_cloud_25g_vpc", "emulated_local"):
        assert expected in names
    for name in names:
        cluster = load_cluster(name)
        assert cluster.sources and cluster.assumptions, name
        params = cluster.comm_params()
        assert params.beta_inter == pytest.approx(8 / (cluster.inter.bandwidth_gbit_s * 1e9))


def test_units():
    cluster = load_cluster("tencent_p40_100g")
    assert cluster.inter.beta == pytest.approx(8e-11)  # 100 Gbit/s
    assert cluster.inter.alpha == pytest.approx(5e-6)
    assert cluster.topology().world_size == 2048


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"inter": {"bandwidth_gbit_s": 0, "latency_us": 1}}, "inter.bandwidth_gbit_s"),
        ({"intra": {"bandwidth_gbit_s": -5, "latency_us": 1}}, "intra.bandwidth_gbit_s"),
        ({"inter": {"bandwidth_gbit_s": 10, "latency_us": -1}}, "inter.latency_us"),
        ({"inter": {"bandwidth_gbit_s": "fast", "latency_us": 1}}, "inter.bandwidth_gbit_s"),
        ({"inter": {"bandwidth_gbit_s": 10}}, "inter.latency_us"),
        ({"nodes": None, "gpus": 10}, "gpus"),
        ({"gpus": 16}, "nodes"),
        ({"ranks_per_node": 0}, "ranks_per_node"),
        ({"nodes": 1.5}, "nodes"),
        ({"device": {"name": "x", "sustained_tflops": 0}}, "device.sustained_tflops"),
        ({"device": None}, "device"),
        ({"workload": {"wire_dtype": "int3"}}, "workload.wire_dtype"),
        ({"workload": {"topk_ratio": 2}}, "workload.topk_ratio"),
        ({"bandwith": 3}, "<top level>"),
        ({"inter": {"bandwidth_gbit_s": 10, "latency_us": 1, "per_flow_gbit_s": 0}}, "inter.per_flow_gbit_s"),
        ({"inter": {"bandwidth_gbit_s": 10, "latency_us": 1, "shared_gbit_s": -1}}, "inter.shared_gbit_s"),
        ({"intra": {"bandwidth_gbit_s": 10, "latency_us": 1, "per_flow_gbit_s": 5}}, "intra"),
        ({"inter": {"bandwidth_gbit_s": 10, "latency_us": 1, "reduction_hidden": "yes"}}, "inter.reduction_hidden"),
    ],
)
def test_nonsense_is_named(tmp_path, changes, field):
    with pytest.raises(ClusterConfigError) as err:
        load_cluster(write(tmp_path, **changes))
    assert f"`{field}`" in str(err.value)


def test_per_flow_and_shared_link_units(tmp_path):
    inter = {"bandwidth_gbit_s": 10, "latency_us": 20, "per_flow_gbit_s": 4, "shared_gbit_s": 8,
             "reduction_hidden": True}
    params = load_cluster(write(tmp_path, inter=inter, reduce_gbyte_s=100)).comm_params()
    assert params.gamma == pytest.approx(1e-11) and params.gamma_inter == 0.0 and params.inter_gamma == 0.0
    assert params.beta_flow == pytest.approx(8 / 4e9)
    assert params.beta_inter_shared == pytest.approx(8 / 8e9)
    # 4 ranks per node at 8 Gbit/s in total: 2 Gbit/s each; one flow alone: capped at 4 of the 10
    assert params.flow_beta(4) == pytest.approx(4 * 8 / 8e9)
    assert params.flow_beta(1) == pytest.approx(8 / 4e9)


def test_ranks_that_do_not_divide_say_so(tmp_path):
    with pytest.raises(ClusterConfigError, match="not a multiple of ranks_per_node=4"):
        load_cluster(write(tmp_path, nodes=None, gpus=10))


def test_unknown_name_lists_shipped(tmp_path):
    with pytest.raises(ClusterConfigError, match="tencent_p40_100g"):
        load_cluster("no_such_cluster")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1,\n")
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        load_cluster(bad)
