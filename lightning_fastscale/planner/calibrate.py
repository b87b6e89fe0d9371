"""Start-up calibration: time a few collectives on the real process groups, fit alpha/beta/gamma.

The closed forms of Thakur et al. 2005, fitted by non-negative least squares; what is timed and
why is in ``docs/planner.md`` ("Calibration").
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from lightning_fastscale.planner.cost_model import (
    CommParams,
    FlatMeasurement,
    Topology,
    allgather_time,
    broadcast_time,
    reduce_time,
    ring_allreduce_time,
    wire_bytes_per_element,
)
from lightning_fastscale.strategies.options import wire_torch_dtype

# Gradient buckets are MBs to 100s of MBs; small sizes would mostly measure start-up effects.
DEFAULT_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)

# Closed form of each calibrated primitive: (p, nbytes, alpha, beta, gamma) -> seconds.
PRIMITIVES: dict[str, Callable[..., float]] = {
    "allgather": lambda p, n, a, b, g: allgather_time(p, n, a, b),
    "allreduce": ring_allreduce_time,
    "reduce": reduce_time,
    "broadcast": lambda p, n, a, b, g: broadcast_time(p, n, a, b),
}


INTER_PRIMITIVES = ("allreduce",)


def intra_primitives(backend: str) -> tuple[str, ...]:
    """The in-node primitives the strategy runs on ``backend`` (gloo's torus uses no all-gather)."""
    if str(backend).lower() == "gloo":
        return ("allreduce", "reduce", "broadcast")
    return ("allreduce", "reduce", "broadcast", "allgather")


@dataclass(frozen=True)
class LinkFit:
    """Fitted parameters of one link level, the samples and the worst relative residual."""

    alpha: float
    beta: float
    gamma: float
    samples: dict = field(default_factory=dict)
    max_rel_residual: float = 0.0


@dataclass(frozen=True)
class CalibrationResult:
    """Fitted `CommParams` plus the per-level fits and raw timings (for the report)."""

    params: CommParams
    intra: LinkFit | None
    inter: LinkFit | None
    shared: LinkFit | None = None
    flat: FlatMeasurement | None = None


def _nonneg_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (3 unknowns: try each support set)."""
    best, best_err = np.zeros(design.shape[1]), np.inf
    for k in range(1, design.shape[1] + 1):
        for support in itertools.combinations(range(design.shape[1]), k):
            coef, *_ = np.linalg.lstsq(design[:, support], target, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(design.shape[1])
            full[list(support)] = coef
            err = float(np.sum((design @ full - target) ** 2))
            if err < best_err:
                best, best_err = full, err
    return best


def fit_link(
    p: int, samples: dict[str, tuple[Sequence[float], Sequence[float]]], gamma: float | None = None
) -> LinkFit:
    """Alpha, beta, gamma of a link from ``{primitive: (sizes_bytes, seconds)}`` over ``p`` ranks.

    With ``gamma`` given, only alpha and beta are fitted. Raises if the timings do not grow with size.
    """
    if p < 2:
        raise ValueError(f"a link fit needs at least 2 ranks, got p={p}")
    rows, target = [], []
    for name, (sizes, times) in samples.items():
        form = PRIMITIVES[name]
        for n, t in zip(sizes, times):
            coeffs = [form(p, n, 1.0, 0.0, 0.0), form(p, n, 0.0, 1.0, 0.0), form(p, n, 0.0, 0.0, 1.0)]
            known = 0.0 if gamma is None else coeffs[2] * gamma
            rows.append(np.asarray(coeffs) / t)  # relative error: divide each row by its time
            target.append(1.0 - known / t)
    design, target = np.asarray(rows), np.asarray(target)
    if gamma is None:
        alpha, beta, gamma = _nonneg_lstsq(design, target)
    else:
        (alpha, beta), gamma = _nonneg_lstsq(design[:, :2], target), float(gamma)
    if beta <= 0:
        raise ValueError(f"calibration timings {samples} do not grow with size: use larger calibration sizes")
    residual = float(np.max(np.abs(design @ np.array([alpha, beta, gamma]) - 1.0)))
    plain = {name: {"sizes": list(map(float, s)), "seconds": list(map(float, t))} for name, (s, t) in samples.items()}
    return LinkFit(float(alpha), float(beta), float(gamma), plain, residual)


def _time(op, world_group, reps: int, active: bool, cuda: bool = False) -> float:
    """Median over ``reps`` of the slowest member's time of ``op`` (after one warm-up; CUDA synchronised)."""
    device = _device(cuda)
    times = []
    for rep in range(reps + 1):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=world_group)
        elapsed = 0.0
        if active:
            start = time.perf_counter()
            op()
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=world_group)
        if rep:
            times.append(slowest.item())
    return float(np.median(times))


_TORCH_DTYPES = {2: torch.float16, 4: torch.float32}


def _device(cuda: bool) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _on_cuda(group: dist.ProcessGroup | None = None) -> bool:
    return str(dist.get_backend(group)).lower() == "nccl"


def _measure(
    group, p: int, sizes: Sequence[int], reps: int, active: bool, root: int, primitives: Sequence[str],
    element_size: int = 4,
) -> dict:
    """``{primitive: (bytes, seconds)}``; sizes rounded to ``p`` elements, ``root`` the reduce/broadcast rank."""
    e, dtype = element_size, _TORCH_DTYPES[element_size]
    cuda = _on_cuda()
    device = _device(cuda)
    used = [e * max(p, nbytes // e // p * p) for nbytes in sizes]
    samples = {name: (used, []) for name in primitives}
    for nbytes in used:
        full = torch.ones(nbytes // e, dtype=dtype, device=device)
        part = torch.ones(nbytes // e // p, dtype=dtype, device=device)
        ops = {
            "allgather": lambda: dist.all_gather_into_tensor(full, part, group=group),
            "allreduce": lambda: dist.all_reduce(full, group=group),
            "reduce": lambda: dist.reduce(full, dst=root, group=group),
            "broadcast": lambda: dist.broadcast(full, src=root, group=group),
        }
        for name in primitives:
            samples[name][1].append(_time(ops[name], None, reps, active, cuda))
    return samples


def measure_flat_allreduce(
    group: dist.ProcessGroup | None,
    nbytes: int | Sequence[int],
    topology: Topology,
    reps: int = 3,
    wire_dtype: str = "fp32",
) -> FlatMeasurement:
    """Time plain DDP's all-reduce: one ``dist.all_reduce`` of each of ``nbytes`` on ``group`` (collective call).

    ``topology``: the nodes x ranks per node the group spans; every rank returns rank 0's measurement.
    """
    sizes = [int(nbytes)] if isinstance(nbytes, (int, float)) else [int(n) for n in nbytes]
    world = dist.get_world_size(group)
    if topology.world_size != world:
        raise ValueError(f"measure_flat_allreduce: topology {topology} has {topology.world_size} ranks but the "
                         f"group has {world}: give the topology the group spans")
    backend = str(dist.get_backend(group)).lower()
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"measure_flat_allreduce: backend {backend!r}; the planner prices nccl and gloo")
    cuda = _on_cuda(group)
    device = _device(cuda)
    dtype = wire_torch_dtype(wire_dtype)
    element = dtype.itemsize
    used, seconds = [], []
    for size in sizes:
        numel = max(1, size // element)
        tensor = torch.ones(numel, dtype=dtype, device=device)
        seconds.append(_time(lambda: dist.all_reduce(tensor, group=group), group, reps, True, cuda))
        used.append(numel * element)
    shared = [seconds]
    if world > 1:
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return FlatMeasurement(topology.num_nodes, topology.ranks_per_node, backend, tuple(map(float, used)),
                           tuple(shared[0]), wire_dtype)


def fit_calibration(
    ranks_per_node: int,
    nodes: int,
    intra_samples: dict | None,
    inter_samples: dict | None,
    shared_samples: dict | None = None,
    flat: FlatMeasurement | None = None,
    backend: str = "gloo",
) -> CalibrationResult:
    """The `CalibrationResult` of measured samples (``{primitive: (bytes, seconds)}``): a pure function.

    ``intra_samples``: inside a node, ``inter_samples``: among the node leaders,
    ``shared_samples``: every rank's inter-node all-reduce at once (bytes per flow).
    """
    intra = inter = shared = None
    if ranks_per_node > 1 and intra_samples:
        intra = fit_link(ranks_per_node, intra_samples)
    if nodes > 1 and inter_samples:
        inter = fit_link(nodes, inter_samples, gamma=0.0)
    if nodes > 1 and ranks_per_node > 1 and shared_samples:
        shared = fit_link(nodes, shared_samples, gamma=0.0)
    if intra is None and inter is None:
        raise ValueError("calibration needs at least 2 ranks (ranks_per_node > 1 or nodes > 1)")
    near, far = intra or inter, inter or intra
    # The fit gives seconds per byte of each of the ranks_per_node flows; the link's is 1/ranks_per_node of it.
    beta_shared = None if shared is None else shared.beta / ranks_per_node
    params = CommParams(near.alpha, near.beta, far.alpha, far.beta, (intra or inter).gamma,
                        beta_inter_shared=beta_shared, gamma_inter=None if inter is None else 0.0,
                        backend=flat.backend if flat is not None else backend, flat_measured=flat)
    return CalibrationResult(params, intra, inter, shared, flat)


def calibrate(
    intra_group: dist.ProcessGroup | None,
    leader_group: dist.ProcessGroup | None,
    ranks_per_node: int,
    nodes: int,
    is_leader: bool,
    sizes: Sequence[int] = DEFAULT_SIZES,
    reps: int = 3,
    intra_root: int = 0,
    flow_group: dist.ProcessGroup | None = None,
    wire_dtype: str = "fp32",
    flat_sizes: Sequence[int] | None = None,
) -> CalibrationResult:
    """Measure and fit the link parameters on the running process groups (collective call).

    ``flow_group``: the ranks with this rank's local rank (``beta_inter_shared``);
    ``flat_sizes``: also time plain DDP's all-reduce on the world group.
    """
    wire = wire_bytes_per_element(wire_dtype)
    intra = inter = shared = None
    if ranks_per_node > 1:
        intra = _measure(intra_group, ranks_per_node, sizes, reps, True, intra_root,
                         intra_primitives(dist.get_backend()))
    if nodes > 1:
        inter = _measure(leader_group, nodes, sizes, reps, is_leader, 0, INTER_PRIMITIVES, wire)
    if nodes > 1 and ranks_per_node > 1 and flow_group is not None:
        # the torus's inter-node stage: every rank's flow carries 1/ranks_per_node of the bytes at once
        shared = _measure(flow_group, nodes, [s // ranks_per_node for s in sizes], reps, True, 0, INTER_PRIMITIVES, wire)
    # rank 0's samples, so that every rank fits the same numbers
    flat = None
    if flat_sizes:
        flat = measure_flat_allreduce(None, flat_sizes, Topology(nodes, ranks_per_node), reps)
    samples = [intra, inter, shared]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(samples, src=0)
    backend = str(dist.get_backend()).lower()
    return fit_calibration(ranks_per_node, nodes, *samples, flat=flat,
                           backend=backend if backend in ("nccl", "gloo") else "gloo")


def calibrate_process_groups(
    groups, sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 3, wire_dtype: str = "fp32",
    flat_sizes: Sequence[int] | None = None,
) -> CalibrationResult:
    """`calibrate` on the strategy's ``ProcessGroups`` (the leaders' ``inter`` group on local rank 0)."""
    topo = groups.topology
    leader = groups.local_rank == 0
    return calibrate(groups.intra, groups.inter if leader else None, topo.ranks_per_node,
                     topo.num_nodes, leader, sizes, reps, groups.intra_ranks[0], flow_group=groups.inter,
                     wire_dtype=wire_dtype, flat_sizes=flat_sizes)


def _main(argv: Sequence[str] | None = None) -> None:
    """``torchrun ... -m lightning_fastscale.planner.calibrate --output params.json`` (rank 0 writes)."""
    import argparse
    import json
    import os

    from lightning_fastscale.strategies.topology import build_process_groups

    parser = argparse.ArgumentParser(description="Fit alpha/beta/gamma on the running cluster.")
    parser.add_argument("--ranks-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="message sizes in bytes")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--wire-dtype", default="fp32", help="dtype of the inter-node measurements (fp32, fp16, bf16)")
    parser.add_argument("--flat-sizes", type=int, nargs="+", help="sizes in bytes at which to time plain DDP's "
                        "all-reduce on the world group (default: --sizes; add the model's gradient size)")
    parser.add_argument("--output", required=True, help="JSON file written by rank 0")
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    groups = build_process_groups(Topology.from_world(dist.get_world_size(), args.ranks_per_node))
    result = calibrate_process_groups(groups, args.sizes, args.reps, args.wire_dtype,
                                      flat_sizes=args.flat_sizes or args.sizes)
    if dist.get_rank() == 0:
        fits = {name: None if fit is None else {"alpha": fit.alpha, "beta": fit.beta, "gamma": fit.gamma,
                                                "max_rel_residual": fit.max_rel_residual, "samples": fit.samples}
                for name, fit in (("intra", result.intra), ("inter", result.inter), ("shared", result.shared))}
        with open(args.output, "w") as fh:
            # "flat_allreduce" has the form of a cluster file's section of that name (planner/cluster.py).
            json.dump({"params": result.params.as_dict(), "fits": fits, "wire_dtype": args.wire_dtype,
                       "backend": result.params.backend,
                       "flat_allreduce": None if result.flat is None else result.flat.as_dict(),
                       "nodes": groups.topology.num_nodes, "ranks_per_node": args.ranks_per_node}, fh, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
