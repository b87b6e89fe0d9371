"""Real multi-node launch on an emulated cluster: 2 network-namespace nodes x 2 ranks via torchrun.

The job under test (``Trainer(strategy="hier_ring", num_nodes=2, devices=2)``) and the reference
(plain DDP, one node x 4 ranks, same data and seed) run at the same time on a 3-node emulated
cluster; the reference's node uses only its loopback. Both see the same DistributedSampler
shards (same global ranks), so their final weights must agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fastscale.emulation import EmulatedCluster, NamespaceUnavailable, check_namespace_support
from tests.multinode_train_script import TinyClassifier

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "multinode_train_script.py"
STRATEGY = "hier_ring"
PORT = "29500"  # free by construction: every emulated node is a fresh network namespace


def _namespaces_or_skip() -> None:
    try:
        check_namespace_support()
    except NamespaceUnavailable as err:
        pytest.skip(f"emulated cluster unavailable: {err}")


def _torchrun(nnodes: int, node_rank: int, nproc: int, master: str, out: Path, *script_args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
        "--nproc_per_node", str(nproc), "--master_addr", master, "--master_port", PORT,
        str(SCRIPT), "--out", str(out), *script_args,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


@pytest.mark.slow  # ~45 s; make test keeps the emulated two-node run of test_data_streaming and the in-process hier == DDP tests
@pytest.mark.timeout(150)
def test_two_emulated_nodes_match_single_node_ddp(tmp_path: Path) -> None:
    _namespaces_or_skip()
    multi, single = tmp_path / "multi", tmp_path / "single"
    multi.mkdir()
    single.mkdir()
    with EmulatedCluster(3, bandwidth_mbit=200) as cluster:
        master = cluster.nodes[0].address
        job = ["--strategy", STRATEGY, "--num-nodes", "2", "--devices", "2"]
        reference = ["--strategy", "ddp", "--num-nodes", "1", "--devices", "4"]
        commands = [
            _torchrun(2, 0, 2, master, multi, *job),
            _torchrun(2, 1, 2, master, multi, *job),
            _torchrun(1, 0, 4, cluster.nodes[2].address, single, *reference),
        ]
        results = cluster.run(commands, timeout=120, env=_env())
        for r in results:
            err = r.stderr or ""
            assert r.returncode == 0, f"node {r.node} failed:\n{err[err.find('Traceback'):][:4000]}"
        link = [cluster.link_bytes(i) for i in range(3)]

    reports = [json.loads((multi / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, rep in enumerate(reports):
        # The launcher's environment, not a setting of ours, told every rank where it runs.
        assert rep["num_nodes"] == 2 and rep["world_size"] == 4
        assert rep["node_rank"] == rank // 2 == int(rep["emulated_node"])
        assert rep["local_rank"] == rank % 2
        assert rep["strategy"] == "HierarchicalAllReduceStrategy"
        assert rep["topology_num_nodes"] == 2 and rep["topology_ranks_per_node"] == 2
        # The hierarchical hook really ran: in-node reduce/broadcast on every rank, and the
        # node leaders (local rank 0) all-reduced across the emulated link.
        calls = rep["collective_calls"]
        assert rep["hook_calls"] > 0 and calls.get("in-node reduce", 0) > 0 and calls.get("in-node broadcast", 0) > 0
        assert (calls.get("inter-node all-reduce", 0) > 0) == (rank % 2 == 0)

    # The 2-node job's gradients crossed the emulated link; the reference's never left its node.
    num_params = sum(p.numel() for p in torch.load(multi / "weights.pt").values())
    assert min(link[0]["tx"], link[1]["tx"]) > num_params * 4
    assert link[2]["tx"] < 10_000

    got, want = torch.load(multi / "weights.pt"), torch.load(single / "weights.pt")
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    # Training moved the weights (two runs that never stepped would also "match").
    torch.manual_seed(0)  # what seed_everything(0) in the script does before building the model
    initial = TinyClassifier().state_dict()
    assert all((got[k] - initial[k]).abs().max() > 1e-3 for k in got)


def test_cluster_removes_everything_on_failure() -> None:
    _namespaces_or_skip()
    cluster = EmulatedCluster(2, bandwidth_mbit=100)
    procs = []
    with pytest.raises(KeyboardInterrupt):
        with cluster:
            procs.append(cluster.start(0, ["sleep", "300"]))
            procs.append(cluster.start(1, ["bash", "-c", "sleep 300 & sleep 300"]))
            raise KeyboardInterrupt
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cluster.name not in listed
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)
    with pytest.raises(TimeoutError, match="exceeded"):
        with EmulatedCluster(1) as quick:
            quick.run([["sleep", "30"]], timeout=0.5)
    assert quick.name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
