"""Topology arithmetic, launcher detection and every bad setting's error (no processes needed)."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

import lightning_fastscale.strategies  # noqa: F401  (registers the names)
from lightning_fastscale.strategies import HierarchicalAllReduceStrategy, Topology, detect_ranks_per_node


def test_topology_layout() -> None:
    topo = Topology(num_nodes=2, ranks_per_node=4)
    assert topo.world_size == 8 and topo == Topology.from_world(8, 4) == Topology(2, 4)
    assert [topo.node_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [topo.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert topo.node_ranks(1) == [4, 5, 6, 7] and topo.peer_ranks(0) == [0, 4] and topo.peer_ranks(3) == [3, 7]
    with pytest.raises(ValueError, match="outside world"):
        topo.node_rank(8)


@pytest.mark.parametrize("world,ranks_per_node,match", [(6, 4, "not a multiple of ranks_per_node=4"),
                                                  (4, 0, "ranks_per_node must be an integer >= 1"),
                                                  (0, 1, "world_size must be an integer >= 1")])
def test_topology_errors(world: int, ranks_per_node: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology.from_world(world, ranks_per_node)
    with pytest.raises(ValueError, match="num_nodes must be an integer >= 1"):
        Topology(0, 2)


def test_one_spelling_per_option() -> None:
    with pytest.raises(ValueError, match=r"algorithm='ring': choose one of \['flat', 'hier', 'torus2d', 'auto'\]"):
        HierarchicalAllReduceStrategy(algorithm="ring")
    with pytest.raises(ValueError, match=r"wire_dtype='float16': choose one of \['fp32', 'fp16', 'bf16'\]"):
        HierarchicalAllReduceStrategy(wire_dtype="float16")


def test_detect_ranks_per_node() -> None:
    assert detect_ranks_per_node({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert detect_ranks_per_node({"SLURM_NTASKS_PER_NODE": "8(x2)"}) == 8
    assert detect_ranks_per_node({"SLURM_NTASKS_PER_NODE": "4(x2),3"}) is None  # uneven nodes
    assert detect_ranks_per_node({}) is None


def _strategy(devices: int, num_nodes: int = 1, env=None, **kw) -> HierarchicalAllReduceStrategy:
    strategy = HierarchicalAllReduceStrategy(
        parallel_devices=[torch.device("cpu")] * devices, cluster_environment=env or LightningEnvironment(), **kw
    )
    strategy.num_nodes = num_nodes
    strategy.set_world_ranks()
    return strategy


def test_setup_topology_from_devices_and_nodes() -> None:
    assert _strategy(4, num_nodes=2)._resolve_topology() == Topology(num_nodes=2, ranks_per_node=4)
    assert _strategy(4, ranks_per_node=2)._resolve_topology() == Topology(num_nodes=2, ranks_per_node=2)


def test_world_not_multiple_of_ranks_per_node() -> None:
    match = r"ranks_per_node=2\) with Trainer\(devices=3, num_nodes=1\): world size 3 is not a multiple"
    with pytest.raises(ValueError, match=match):
        _strategy(3, ranks_per_node=2)._resolve_topology()
    with pytest.raises(ValueError, match=match):  # the same check, callable before any process starts
        _strategy(3, ranks_per_node=2).check_topology()


def test_devices_disagree_with_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"launcher runs 2 ranks per node .*devices=4.*set devices=2"):
        _strategy(4, env=TorchElasticEnvironment())._resolve_topology()


def test_num_nodes_disagree_with_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"num_nodes=1, devices=2\) gives 2 ranks but the launcher's world size is 4"):
        _strategy(2, num_nodes=1, env=TorchElasticEnvironment())._resolve_topology()


@pytest.mark.parametrize("kwargs,match", [
    ({"algorithm": "tree"}, "algorithm='tree'"),
    ({"wire_dtype": "fp8"}, "wire_dtype='fp8'"),
    ({"compression": "powersgd"}, "compression='powersgd'"),
    ({"compression": "topk", "algorithm": "flat"}, "algorithm='flat' does not"),
    ({"compression": "topk", "topk_ratio": 1.5}, "topk_ratio"),
    ({"ranks_per_node": 0}, "ranks_per_node=0"),
    ({"bucket_cap_mb": 10, "two_segment_split": 3}, "only one of"),
    ({"ddp_comm_hook": print, "algorithm": "torus2d"}, "not with algorithm='torus2d'"),
])
def test_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HierarchicalAllReduceStrategy(**kwargs)


def test_registered_names() -> None:
    for name, algorithm, start in [("hier_ring", "hier", "popen"), ("hier_torus", "torus2d", "popen"),
                                   ("hier_ring_spawn", "hier", "spawn"), ("hier_torus_spawn", "torus2d", "spawn")]:
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2)
        assert isinstance(trainer.strategy, HierarchicalAllReduceStrategy)
        assert (trainer.strategy.algorithm, trainer.strategy._start_method) == (algorithm, start)


def test_two_segment_fusion_plan() -> None:
    from lightning_fastscale.strategies import two_segment_fusion_plan

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))  # 110 + 22 floats
    caps = two_segment_fusion_plan(model, 2)
    assert caps[0] * 1024 * 1024 == pytest.approx(22 * 4) and caps[1] * 1024 * 1024 > 132 * 4
    with pytest.raises(ValueError, match="two_segment_split=4"):
        two_segment_fusion_plan(model, 4)


@pytest.mark.parametrize("name,algorithm", [("hier_ring", "hier"), ("hier_torus", "torus2d")])
def test_strategy_configs_instantiate(name: str, algorithm: str) -> None:
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(str(Path(__file__).parents[1] / "lightning_fastscale" / "conf"), version_base="1.3"):
        node = compose("train", overrides=[f"strategy={name}"]).strategy  # hier_torus extends hier_ring
    strategy = instantiate(node, start_method="spawn")  # what fastscale-train does inside a multirun
    assert isinstance(strategy, HierarchicalAllReduceStrategy)
    assert (strategy.algorithm, strategy.wire_dtype, strategy._start_method) == (algorithm, "fp32", "spawn")
