"""Measure all-reduce algorithms on an emulated cluster: the API behind ``benchmarks/allreduce.py``.

`measure_allreduce` builds an [`EmulatedCluster`][lightning_fastscale.emulation.EmulatedCluster]
per bandwidth cap, starts ``torchrun --nnodes N --node_rank i`` on every emulated node (the
real multi-node launch path) and times each algorithm on each size. Results come back as a
plain dict, so the planner can fit its alpha-beta cost model to them.

More in ``docs/emulated_cluster.md`` ("Measuring algorithms").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_fastscale.strategies.options import ALGORITHMS, WIRE_DTYPES, chunk_numel_for

__all__ = ["measure_allreduce", "bandwidth_bound_s", "parse_algorithm", "rotated", "WIRE_DTYPES"]

_ALGORITHMS = (*ALGORITHMS, "hier_topk", "torus2d_topk")
_MASTER_PORT = 29500  # free by construction: the emulated network namespaces are new


def parse_algorithm(spec: str) -> tuple[str, str, int | float]:
    """``"hier:fp16@8"`` -> ``("hier", "fp16", 8)`` (8 chunks); ``"hier@4mb"`` -> ``("hier", "fp32", 4.0)``
    (4 MiB chunks, a float). Defaults: ``fp32`` on the wire, 1 chunk."""
    head, _, chunks = spec.partition("@")
    name, _, dtype = head.partition(":")
    dtype = dtype or "fp32"
    if name not in _ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r} in {spec!r}; choose from {', '.join(_ALGORITHMS)}")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {dtype!r} in {spec!r}; choose from {', '.join(WIRE_DTYPES)}")
    if chunks.lower().endswith("mb"):
        try:
            size_mb = float(chunks[:-2])
        except ValueError:
            size_mb = 0.0
        if not size_mb > 0:
            raise ValueError(f"chunk size in {spec!r} must be a positive number of MiB (e.g. hier@4mb)")
        return name, dtype, size_mb
    if chunks and not (chunks.isdigit() and int(chunks) >= 1):
        raise ValueError(f"chunk count in {spec!r} must be a positive integer (e.g. hier@8) or MiB (hier@4mb)")
    return name, dtype, int(chunks or 1)


def bandwidth_bound_s(num_bytes: float, num_nodes: int, bandwidth_mbit: float) -> float:
    """Lower bound on the time of an all-reduce of ``num_bytes`` across ``num_nodes`` links."""
    return 2 * (num_nodes - 1) / num_nodes * num_bytes / (bandwidth_mbit * 1e6 / 8)


def measure_allreduce(
    numels: Sequence[int],
    algorithms: Sequence[str],
    caps_mbit: Sequence[float | None],
    *,
    num_nodes: int = 2,
    ranks_per_node: int = 4,
    reps: int = 3,
    topk_ratio: float = 0.01,
    timeout_s: float = 900.0,
) -> dict:
    """Time all-reduce ``algorithms`` of fp32 tensors of ``numels`` elements on emulated clusters.

    One emulated cluster of ``num_nodes`` x ``ranks_per_node`` CPU ranks (gloo) is built per
    entry of ``caps_mbit`` (Mbit/s per node link and direction; ``None`` = uncapped). Per
    size, every algorithm runs once to warm up, then ``reps`` rounds each run every algorithm
    once, in an order rotated by one each round (see the module docstring); a repetition's
    time is the slowest rank's. ``times_s[i]`` of every algorithm of one size come from the
    same round ``i``, so they can be compared in pairs. Needs root (network namespaces); raises
    [`NamespaceUnavailable`][lightning_fastscale.emulation.NamespaceUnavailable] otherwise.

    Returns ``{"config": {...}, "results": [{"cap_mbit", "numel", "algorithm", "times_s",
    "median_s", "rel_error", "bound_s", "bound_fraction", "ratio_vs_flat"}, ...]}`` where
    ``rel_error`` is the largest over the rounds, ``bound_s`` is for the fp32 payload and ``ratio_vs_flat`` is flat's median over this
    one's, measured in the same cluster (``None`` when ``flat`` was not requested).
    """
    from lightning_fastscale.emulation.netns_cluster import EmulatedCluster

    for spec in algorithms:
        parse_algorithm(spec)
    config = dict(numels=list(numels), algorithms=list(algorithms), reps=reps, schedule="interleaved",
                  topk_ratio=topk_ratio, ranks_per_node=ranks_per_node)
    results = []
    for cap in caps_mbit:
        with tempfile.TemporaryDirectory(prefix="fastscale-allreduce-") as tmp:
            out = Path(tmp) / "result.json"
            worker_cfg = dict(config, output=str(out))
            with EmulatedCluster(num_nodes, bandwidth_mbit=cap) as cluster:
                commands = [
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(num_nodes),
                     "--node_rank", str(i), "--nproc_per_node", str(ranks_per_node),
                     "--master_addr", cluster.nodes[0].address, "--master_port", str(_MASTER_PORT),
                     "-m", "lightning_fastscale.emulation.collectives", "--worker", json.dumps(worker_cfg)]
                    for i in range(num_nodes)
                ]
                ran = cluster.run(commands, timeout=timeout_s)
            failed = [r for r in ran if r.returncode != 0]
            if failed or not out.exists():
                detail = "\n".join(f"--- node {r.node} rc={r.returncode} ---\n{(r.stderr or '')[-3000:]}" for r in ran)
                raise RuntimeError(f"all-reduce measurement failed at cap {cap} Mbit/s\n{detail}")
            measured = json.loads(out.read_text())
        flat = {r["numel"]: r["median_s"] for r in measured if r["algorithm"] == "flat"}
        for row in measured:
            bound = None if cap is None else bandwidth_bound_s(row["numel"] * 4, num_nodes, cap)
            row.update(
                cap_mbit=cap,
                bound_s=bound,
                bound_fraction=None if bound is None else bound / row["median_s"],
                ratio_vs_flat=flat[row["numel"]] / row["median_s"] if row["numel"] in flat else None,
            )
            results.append(row)
    return {"config": dict(config, num_nodes=num_nodes, caps_mbit=list(caps_mbit)), "results": results}


# -- worker side (runs under torchrun inside an emulated node) --------------------------------
def _make_algorithm(spec: str, numel: int, groups, cfg: dict) -> Callable:
    from lightning_fastscale.strategies import allreduce

    name, dtype, chunks = parse_algorithm(spec)
    if isinstance(chunks, float):
        chunk_numel = chunk_numel_for(chunks)
    else:
        chunk_numel = None if chunks == 1 else -(-numel // chunks)
    if name.endswith("_topk"):
        fn = allreduce.ALLREDUCE_FUNCTIONS[name.removesuffix("_topk")]
        topk = allreduce.TopKErrorFeedback(cfg["topk_ratio"])
        return lambda t: fn(t, groups, wire_dtype=dtype, topk=topk, chunk_numel=chunk_numel)
    fn = allreduce.ALLREDUCE_FUNCTIONS[name]
    return lambda t: fn(t, groups, wire_dtype=dtype, chunk_numel=chunk_numel)


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """``items`` rotated left by ``shift`` (round ``r`` of the timing starts with item ``r mod n``)."""
    k = shift % len(items) if items else 0
    return [*items[k:], *items[:k]]


def _time_interleaved(runs: dict[str, Callable], base, reps: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Time every run of ``runs`` once per round, ``reps`` rounds after one warm-up round.

    Round ``r`` runs them in the order `rotated` by ``r``, so no algorithm always goes
    first or follows the same one. Rank ``r`` reduces ``(r + 1) * base``, whose exact sum is
    known without gathering. Returns the times (slowest rank's, one per round, in round order)
    and the largest relative error of the result over all rounds, per name.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    expected = base * (world * (world + 1) / 2)
    expected_norm = expected.norm()
    work = torch.empty_like(base)
    times: dict[str, list[float]] = {name: [] for name in runs}
    errors = dict.fromkeys(runs, 0.0)
    for round_ in range(reps + 1):  # round 0 warms up connections and the allocator
        for name in rotated(list(runs), round_):
            torch.mul(base, rank + 1, out=work)
            dist.barrier()
            start = time.perf_counter()
            runs[name](work)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            errors[name] = max(errors[name], ((work - expected).norm() / expected_norm).item())
            if round_ > 0:
                times[name].append(elapsed.item())
    return times, errors


def _worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from lightning_fastscale.strategies.topology import Topology, build_process_groups

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_process_groups(Topology.from_world(world, cfg["ranks_per_node"]))
    rows = []
    for numel in cfg["numels"]:
        base = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        runs = {spec: _make_algorithm(spec, numel, groups, cfg) for spec in cfg["algorithms"]}
        times, errors = _time_interleaved(runs, base, cfg["reps"])
        for spec in runs:
            rows.append(dict(numel=numel, algorithm=spec, times_s=times[spec],
                             median_s=statistics.median(times[spec]), rel_error=errors[spec]))
            if rank == 0:
                print(f"[allreduce] {spec:18s} numel={numel} median={rows[-1]['median_s']:.3f}s "
                      f"rel_error={errors[spec]:.2e}", flush=True)
    if rank == 0:
        Path(cfg["output"]).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", required=True, help="JSON config (internal: used by measure_allreduce)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(json.loads(args.worker))


if __name__ == "__main__":
    _main()
