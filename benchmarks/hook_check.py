"""Check the communication hooks end to end: DDP with our hook trains to the same weights as plain DDP.

`check_hooks` spawns ``world_size`` ranks on one machine over gloo, trains the same small
model for a few SGD steps with plain DDP and with each algorithm's hook (``ranks_per_node`` ranks
per emulated node), and compares the final weights. With ``device="cuda"`` every rank puts its
model and batches on the one GPU (NCCL refuses two ranks on one device, gloo does not), so the
hooks run on CUDA buckets: the worker thread's device, its stream waiting for the bucket, and
DDP's use of the result ordered after the communication. `check_hooks_on_cuda` is that
check, skipped cleanly where CUDA is not available.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from lightning_fastscale.emulation.faults import free_port

# Relative error of the final weights against plain DDP: fp32 differs only in summation order;
# a 16-bit wire rounds every step's gradient (2^-11 for fp16).
TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}


def _train(rank: int, world_size: int, device: str, hook: Any, state: Any, steps: int) -> torch.Tensor:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 5)).to(device)
    # Small buckets: several per step, so buckets are in flight while backward still runs.
    ddp = DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None, bucket_cap_mb=0.1)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g).to(device)
        y = torch.randint(0, 5, (64,), generator=g).to(device)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()


def _rank_entry(rank: int, world_size: int, port: int, device: str, ranks_per_node: int,
                cases: Sequence[tuple[str, str]], steps: int, results: Any) -> None:
    import torch.distributed as dist

    from lightning_fastscale.strategies.comm_hooks import HOOKS, HierarchicalHookState
    from lightning_fastscale.strategies.topology import Topology, build_process_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        reference = _train(rank, world_size, device, None, None, steps)
        topology = Topology.from_world(world_size, ranks_per_node)
        out = {}
        for algorithm, wire in cases:
            groups = build_process_groups(topology, timeout=timedelta(seconds=120))
            state = HierarchicalHookState(groups=groups, wire_dtype=wire, algorithm=algorithm)
            try:
                weights = _train(rank, world_size, device, HOOKS[algorithm], state, steps)
            finally:
                state.close()
            gathered = [torch.empty_like(weights) for _ in range(world_size)]
            dist.all_gather(gathered, weights)
            groups.destroy()
            out[f"{algorithm}:{wire}"] = {
                "rel_error": ((weights - reference).norm() / reference.norm()).item(),
                "ranks_agree": all(torch.equal(g, weights) for g in gathered),
                "tolerance": TOLERANCE[wire],
            }
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def check_hooks(
    device: str = "cpu",
    *,
    world_size: int = 4,
    ranks_per_node: int = 2,
    cases: Sequence[tuple[str, str]] = (("hier", "fp32"), ("torus2d", "fp32"), ("flat", "fp32"), ("hier", "fp16")),
    steps: int = 3,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Train with plain DDP and with each ``(algorithm, wire_dtype)`` hook; compare the weights.

    Returns ``{"status": "pass" | "fail", "device", "cases": {"hier:fp32": {"rel_error",
    "ranks_agree", "tolerance", "ok"}, ...}}``. Raises ``TimeoutError`` after ``timeout_s``.

    Examples:
        >>> report = check_hooks("cpu", cases=[("hier", "fp32")])  # doctest: +SKIP
        >>> report["status"], report["cases"]["hier:fp32"]["rel_error"] < 1e-5  # doctest: +SKIP
        ('pass', True)
    """
    import torch.multiprocessing as mp

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: choose 'cpu' or 'cuda'")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(
        _rank_entry, args=(world_size, free_port(), device, ranks_per_node, list(cases), steps, results),
        nprocs=world_size, join=False, start_method="spawn",
    )
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"check_hooks on {device} exceeded {timeout_s}s")
    finally:
        for proc in procs.processes:
            if proc.is_alive():
                proc.kill()
    out = results.get()
    for case in out.values():
        case["ok"] = case["ranks_agree"] and case["rel_error"] <= case["tolerance"]
    return {"status": "pass" if all(c["ok"] for c in out.values()) else "fail", "device": device, "cases": out}


def check_hooks_on_cuda(**kwargs: Any) -> dict[str, Any]:
    """`check_hooks` with CUDA tensors, all ranks on one GPU over gloo; ``{"status": "skipped",
    "reason": ...}`` without CUDA."""
    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "CUDA is not available", "device": "cuda", "cases": {}}
    return check_hooks("cuda", **kwargs)
