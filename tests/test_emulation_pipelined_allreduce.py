"""The chunk-pipelined hierarchical / 2D-torus all-reduce equals the exact sum (4 gloo ranks as 2x2)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from lightning_fastscale.strategies.pipelined import chunk_bounds
from tests.distributed import run_distributed

CASES = [(None, 1), (None, 3), (None, 64), (torch.float16, 4)]


def _pipelined_sums(rank: int, world_size: int) -> dict:
    from lightning_fastscale.strategies.pipelined import (
        pipelined_hierarchical_allreduce_,
        pipelined_torus2d_allreduce_,
    )
    from lightning_fastscale.strategies.topology import Topology, build_process_groups

    groups = build_process_groups(Topology(world_size, 2))
    # Odd length: uneven chunks and uneven torus shards; values differ per rank and position.
    base = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    expected = sum(base * (r + 1) + r for r in range(world_size))
    out = {}
    for name, fn in (("hier", pipelined_hierarchical_allreduce_), ("torus2d", pipelined_torus2d_allreduce_)):
        for dtype, chunks in CASES:
            t = base * (rank + 1) + rank
            assert fn(t, groups, comm_dtype=dtype, num_chunks=chunks) is t
            # Small results only: the spawn queue is a pipe the parent drains after join.
            out[(name, str(dtype), chunks)] = (
                ((t - expected).abs() / expected.abs().clamp_min(1.0)).max().item(),
                hashlib.sha1(t.numpy().tobytes()).hexdigest(),
            )
    return out


def test_pipelined_allreduce_equals_sum() -> None:
    results = run_distributed(_pipelined_sums, 4, timeout=120)
    assert len(results[0]) == 2 * len(CASES)
    for key, (error, digest) in results[0].items():
        assert all(r[key][1] == digest for r in results), f"{key}: ranks disagree"
        # fp32: exact up to summation order; fp16 on the wire between the 2 nodes only: one
        # fp16 rounding of each node's sum (relative 2**-11) plus that of the result.
        assert error < (1e-6 if key[1] == "None" else 2e-3), (key, error)


def test_chunk_bounds() -> None:
    assert chunk_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(0, 4) == []
    with pytest.raises(ValueError, match="num_chunks"):
        chunk_bounds(10, 0)
