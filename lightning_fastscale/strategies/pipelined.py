"""Pipelined two-level all-reduce: chunks flow through the intra- and inter-node stages at once.

The hierarchical all-reduce of Jia et al. 2018 ("Highly Scalable Deep Learning Training
System with Mixed-Precision: Training ImageNet in Four Minutes", Tencent) and the 2D-torus
all-reduce of Mikami et al. 2018 ("Massively Distributed SGD: ImageNet/ResNet-50 Training in
a Flash", Sony) move only 2(N-1)/N * M bytes over each node's slow link, but run as three
stages one after another, the time of the fast intra-node stages adds to the slow inter-node
one. Splitting the tensor into chunks and issuing every stage asynchronously lets the
intra-node stage of chunk i+1 and the broadcast of chunk i-1 run while chunk i crosses the
network, so the total tends to the time of the inter-node stage alone (the bandwidth bound)
plus one chunk's intra-node work.

Primitive choice follows gloo on CPU, where ``reduce``/``all_reduce``/``broadcast`` are much
faster than ``reduce_scatter``/``all_gather`` (see issue 3): the torus variant therefore
all-reduces inside the node and broadcasts each shard from its owner instead of
reduce-scatter / all-gather, which also allows unequal shards (no padding).

All functions reduce with SUM, in place, and must be called by every rank with the same
arguments and the :class:`~lightning_fastscale.strategies.topology.ProcessGroups` of
:func:`~lightning_fastscale.strategies.topology.build_process_groups`: the inbound stage runs
on ``groups.intra``, the outbound one on ``groups.intra_out`` (a separate gloo queue, so a
chunk's broadcast never waits behind a later chunk's reduction), the network stage on
``groups.inter``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_fastscale.strategies.topology import ProcessGroups

__all__ = ["pipelined_hierarchical_allreduce_", "pipelined_torus2d_allreduce_", "chunk_bounds"]


def chunk_bounds(numel: int, num_chunks: int) -> list[tuple[int, int]]:
    """Split ``[0, numel)`` into at most ``num_chunks`` contiguous ranges of equal size.

    Only the last range may be shorter. Empty ranges are never returned.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if numel == 0:
        return []
    step = -(-numel // num_chunks)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def _wire(chunk: torch.Tensor, comm_dtype: torch.dtype | None) -> torch.Tensor:
    return chunk if comm_dtype is None or comm_dtype == chunk.dtype else chunk.to(comm_dtype)


def pipelined_hierarchical_allreduce_(
    tensor: torch.Tensor,
    groups: ProcessGroups,
    *,
    comm_dtype: torch.dtype | None = None,
    num_chunks: int = 8,
) -> torch.Tensor:
    """Hierarchical all-reduce (Jia et al. 2018) with chunks pipelined through its 3 stages.

    Per chunk: ``reduce`` to local rank 0 inside the node; local rank 0 all-reduces the node
    sums across nodes (cast to ``comm_dtype`` for the wire only); ``broadcast`` back inside
    the node. Returns ``tensor`` holding the global sum.
    """
    intra, intra_out, inter = groups.intra, groups.intra_out, groups.inter
    flat = tensor.view(-1)
    local_rank = groups.local_rank
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), num_chunks)]
    reduces = [dist.reduce(c, group_dst=0, group=intra, async_op=True) for c in chunks]
    if local_rank == 0:
        wires, inters = [], []
        for chunk, work in zip(chunks, reduces):
            work.wait()
            wire = _wire(chunk, comm_dtype)
            wires.append(wire)
            inters.append(dist.all_reduce(wire, group=inter, async_op=True))
        broadcasts = []
        for chunk, wire, work in zip(chunks, wires, inters):
            work.wait()
            if wire is not chunk:
                chunk.copy_(wire)
            broadcasts.append(dist.broadcast(chunk, group_src=0, group=intra_out, async_op=True))
    else:
        broadcasts = []
        for chunk, work in zip(chunks, reduces):
            # gloo may use a non-root's buffer as scratch: receive only once it is done with it.
            work.wait()
            broadcasts.append(dist.broadcast(chunk, group_src=0, group=intra_out, async_op=True))
    for work in broadcasts:
        work.wait()
    return tensor


def pipelined_torus2d_allreduce_(
    tensor: torch.Tensor,
    groups: ProcessGroups,
    *,
    comm_dtype: torch.dtype | None = None,
    num_chunks: int = 8,
) -> torch.Tensor:
    """2D-torus all-reduce (Mikami et al. 2018) with chunks pipelined through its stages.

    Per chunk: ``all_reduce`` inside the node; local rank r all-reduces shard r of the chunk
    with local rank r of every other node (all shards cross the network in parallel,
    ``comm_dtype`` on the wire); each shard is broadcast from its owner inside the node.
    Returns ``tensor``.
    """
    intra, intra_out, inter = groups.intra, groups.intra_out, groups.inter
    flat = tensor.view(-1)
    local_rank = groups.local_rank
    local_size = groups.topology.ranks_per_node
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), num_chunks)]
    intra_sums = [dist.all_reduce(c, group=intra, async_op=True) for c in chunks]
    mine, wires, inters = [], [], []
    for chunk, work in zip(chunks, intra_sums):
        work.wait()
        shard = torch.tensor_split(chunk, local_size)[local_rank]
        wire = _wire(shard, comm_dtype)
        mine.append(shard)
        wires.append(wire)
        inters.append(dist.all_reduce(wire, group=inter, async_op=True))
    broadcasts = []
    for i, chunk in enumerate(chunks):
        for owner, shard in enumerate(torch.tensor_split(chunk, local_size)):
            if owner == local_rank:
                inters[i].wait()
                if wires[i] is not mine[i]:
                    shard.copy_(wires[i])
            broadcasts.append(dist.broadcast(shard, group_src=owner, group=intra_out, async_op=True))
    for work in broadcasts:
        work.wait()
    return tensor
