"""In-place all-reduce algorithms over a flat tensor given a `ProcessGroups`: flat, hierarchical
(Jia et al. 2018), 2D torus (Mikami et al. 2018); ``docs/methods/hierarchical_allreduce.md``.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fastscale.strategies.options import wire_torch_dtype
from lightning_fastscale.strategies.topology import ProcessGroups

# Backends whose native reduce-scatter / all-gather beat per-shard reduce / broadcast.
_NATIVE_SCATTER_GATHER_BACKENDS = frozenset({"nccl"})
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

STAGES: tuple[str, ...] = (
    "flat all-reduce", "in-node all-reduce", "in-node reduce", "in-node reduce-scatter",
    "inter-node all-reduce", "inter-node top-k all-gather", "in-node broadcast", "in-node all-gather",
)
"""Stage names that `CollectiveStageError` reports."""


class CollectiveStageError(RuntimeError):
    """A collective of one stage of an all-reduce failed; ``__cause__`` is the backend's error."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"{stage} failed: {type(cause).__name__}: {cause}")
        self.stage = stage


def _issue(stage: str, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> _Pending | None:
    try:
        work = collective(*args, **kwargs)
    except CollectiveStageError:
        raise
    except Exception as error:
        raise CollectiveStageError(stage, error) from error
    return None if work is None else _Pending(stage, work)


class _Pending:
    """An asynchronous collective whose ``wait`` reports failures as `CollectiveStageError`."""

    def __init__(self, stage: str, work: dist.Work) -> None:
        self.stage, self.work = stage, work

    def wait(self) -> None:
        try:
            self.work.wait()
        except Exception as error:
            raise CollectiveStageError(self.stage, error) from error


@dataclass
class TopKErrorFeedback:
    """Top-k sparsification with error feedback, one residual per ``key`` (Lin et al. 2018).

    With ``momentum`` > 0 the momentum moves here from the optimizer (Lin et al. 2018's momentum
    correction): each key keeps a velocity ``u = momentum * u + g`` and the residual accumulates
    ``u``, not ``g``; the entries sent are cleared from both (momentum factor masking), and the
    optimizer must then run without momentum. A residual whose tensor changes size (another bucket
    layout) restarts from zero, counted in ``resets``.

    Examples:
        >>> topk = TopKErrorFeedback(ratio=0.5, momentum=0.5)
        >>> topk.select("b", torch.tensor([4.0, 1.0]), torch.float32)
        (tensor([0], dtype=torch.int32), tensor([4.]))
        >>> topk.select("b", torch.tensor([0.0, 2.0]), torch.float32)  # u = [0, 2.5], residual [0, 3.5]
        (tensor([1], dtype=torch.int32), tensor([3.5000]))
    """

    ratio: float
    momentum: float = 0.0
    errors: dict[Hashable, Tensor] = field(default_factory=dict)
    velocities: dict[Hashable, Tensor] = field(default_factory=dict)
    resets: int = 0
    restored: set[Hashable] = field(default_factory=set)
    """Keys whose residual came from a checkpoint; a size change there warns (another bucket layout)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"topk_ratio must be in (0, 1], got {self.ratio}.")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"topk_momentum must be in [0, 1) (0: the optimizer keeps its momentum), got {self.momentum}.")

    def num_selected(self, numel: int) -> int:
        """How many entries of a ``numel``-long tensor are sent."""
        return max(1, min(numel, round(self.ratio * numel)))

    def _residual(self, key: Hashable, tensor: Tensor) -> Tensor:
        """``key``'s residual, restarted from zero (with its velocity) where ``tensor`` does not fit it."""
        error = self.errors.get(key)
        if error is not None and error.shape == tensor.shape and error.dtype == tensor.dtype:
            return error
        if error is not None:
            self.resets += 1
            if key in self.restored:
                warnings.warn(
                    f"top-k residual {key} from the checkpoint holds {error.numel()} elements but this run's "
                    f"bucket holds {tensor.numel()} (another bucket layout): it restarts from zero.",
                    stacklevel=3,
                )
        self.restored.discard(key)
        self.velocities.pop(key, None)
        error = self.errors[key] = torch.zeros_like(tensor)
        return error

    def select(self, key: Hashable, tensor: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(indices int32, values in dtype)`` of the top-k of ``tensor + residual``; the residual keeps the rest."""
        error = self._residual(key, tensor)
        if self.momentum:
            velocity = self.velocities.get(key)
            if velocity is None:
                velocity = self.velocities[key] = torch.zeros_like(tensor)
            error.add_(velocity.mul_(self.momentum).add_(tensor))
        else:
            error.add_(tensor)
        indices = error.abs().topk(self.num_selected(tensor.numel()), sorted=False).indices
        values = error[indices].to(dtype)
        error[indices] -= values.to(error.dtype)
        if self.momentum:
            velocity[indices] = 0
        return indices.to(torch.int32), values


def _cast_dtype(wire_dtype: str) -> torch.dtype | None:
    """The dtype the wire stage casts to; ``None`` for ``"fp32"`` (every gradient keeps its own)."""
    dtype = wire_torch_dtype(wire_dtype)
    return None if dtype == torch.float32 else dtype


def _to_wire(tensor: Tensor, wire_dtype: torch.dtype | None) -> Tensor:
    return tensor if wire_dtype is None else tensor.to(wire_dtype)  # ``to`` returns ``tensor`` if it has the dtype


def _chunks(wire: Tensor, chunk_numel: int | None) -> list[Tensor]:
    if chunk_numel is None or chunk_numel >= wire.numel():
        return [wire]
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}.")
    return list(wire.split(chunk_numel))


def _sparse_allreduce_(
    tensor: Tensor, group: dist.ProcessGroup, topk: TopKErrorFeedback,
    key: Hashable, cast: torch.dtype, acc_dtype: torch.dtype,
) -> None:
    acc = tensor.to(acc_dtype)
    indices, values = topk.select(key, acc, cast)
    size = dist.get_world_size(group)
    all_indices = [torch.empty_like(indices) for _ in range(size)]
    all_values = [torch.empty_like(values) for _ in range(size)]
    stage = "inter-node top-k all-gather"
    _issue(stage, dist.all_gather, all_indices, indices, group=group)
    _issue(stage, dist.all_gather, all_values, values, group=group)
    acc.zero_()
    for idx, val in zip(all_indices, all_values):
        acc.index_add_(0, idx, val.to(acc_dtype))
    tensor.copy_(acc)


class _Crossing:
    """One piece's inter-node all-reduce in flight; ``wait`` also copies the wire copy back."""

    def __init__(self, piece: Tensor, wire: Tensor, work: _Pending | None) -> None:
        self.piece, self.wire, self.work = piece, wire, work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.wire is not self.piece:
            self.piece.copy_(self.wire)


def _inter_stage(
    pieces: list[Tensor], groups: ProcessGroups, cast: torch.dtype | None,
    topk: TopKErrorFeedback | None, key: Hashable, after: list[_Pending | None] | None = None,
) -> list[_Crossing | None]:
    """All-reduce each piece over ``groups.inter`` in ``cast`` (the only cast stage); wait for ``after[i]`` first."""
    crossings: list[_Crossing | None] = []
    for i, piece in enumerate(pieces):
        if after is not None and after[i] is not None:
            after[i].wait()
        if piece.numel() == 0:
            crossings.append(None)
        elif topk is not None:
            _sparse_allreduce_(piece, groups.inter, topk, (key, i), cast or piece.dtype, piece.dtype)
            crossings.append(None)
        else:
            wire = _to_wire(piece, cast)
            work = _issue("inter-node all-reduce", dist.all_reduce, wire, group=groups.inter, async_op=True)
            crossings.append(_Crossing(piece, wire, work))
    return crossings


def _wait(works: list[_Pending | _Crossing | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _one_allreduce(tensor: Tensor, group: dist.ProcessGroup, stage: str, cast: torch.dtype | None,
                   chunk_numel: int | None) -> Tensor:
    wire = _to_wire(tensor, cast)
    _wait([_issue(stage, dist.all_reduce, piece, group=group, async_op=True) for piece in _chunks(wire, chunk_numel)])
    if wire is not tensor:
        tensor.copy_(wire)
    return tensor


def flat_allreduce_(
    tensor: Tensor, groups: ProcessGroups, wire_dtype: str = "fp32",
    chunk_numel: int | None = None,
) -> Tensor:
    """Flat all-reduce over every rank, on the private ``groups.world`` (never interleaved with SyncBatchNorm)."""
    return _one_allreduce(tensor, groups.world, "flat all-reduce", _cast_dtype(wire_dtype), chunk_numel)


def hier_allreduce_(
    tensor: Tensor, groups: ProcessGroups, wire_dtype: str = "fp32",
    topk: TopKErrorFeedback | None = None, key: Hashable = 0, chunk_numel: int | None = None,
) -> Tensor:
    """Reduce in the node to its leader, all-reduce among leaders in ``wire_dtype``, broadcast in the node (Jia et al. 2018)."""
    topo = groups.topology
    cast = _cast_dtype(wire_dtype)
    if topo.num_nodes == 1:
        return _one_allreduce(tensor, groups.intra, "in-node all-reduce", cast, chunk_numel)
    pieces = _chunks(tensor, chunk_numel)
    if topo.ranks_per_node == 1:
        _wait(_inter_stage(pieces, groups, cast, topk, key))
        return tensor

    leader = groups.intra_ranks[0]
    inbound = [_issue("in-node reduce", dist.reduce, piece, dst=leader, group=groups.intra, async_op=True)
               for piece in pieces]
    if groups.is_leader:
        crossed = _inter_stage(pieces, groups, cast, topk, key, after=inbound)
    else:
        # gloo may use a non-root's buffer as scratch: receive into it only once the reduce is done
        _wait(inbound)
        crossed = [None] * len(pieces)
    outbound = []
    for piece, crossing in zip(pieces, crossed):
        if crossing is not None:
            crossing.wait()
        outbound.append(_issue("in-node broadcast", dist.broadcast, piece, src=leader,
                               group=groups.intra_out, async_op=True))
    _wait(outbound)
    return tensor


def torus2d_allreduce_(
    tensor: Tensor, groups: ProcessGroups, wire_dtype: str = "fp32",
    topk: TopKErrorFeedback | None = None, key: Hashable = 0, chunk_numel: int | None = None,
    native_scatter_gather: bool | None = None,
) -> Tensor:
    """Reduce-scatter in the node, all-reduce each shard across nodes, all-gather in the node (Mikami et al. 2018).

    ``native_scatter_gather``: the backend's reduce-scatter / all-gather, else one reduce /
    broadcast per shard; ``None``: native on NCCL only.
    """
    topo = groups.topology
    if topo.num_nodes == 1 or topo.ranks_per_node == 1:
        return hier_allreduce_(tensor, groups, wire_dtype, topk, key, chunk_numel)
    pieces = _chunks(tensor, chunk_numel)
    if native_scatter_gather is None:
        native_scatter_gather = groups.backend in _NATIVE_SCATTER_GATHER_BACKENDS
    (_torus_native if native_scatter_gather else _torus_per_shard)(pieces, groups, _cast_dtype(wire_dtype), topk, key)
    return tensor


def _torus_per_shard(
    pieces: list[Tensor], groups: ProcessGroups, cast: torch.dtype | None,
    topk: TopKErrorFeedback | None, key: Hashable,
) -> None:
    parts = groups.topology.ranks_per_node
    me = groups.local_rank
    shards = [piece.tensor_split(parts) for piece in pieces]  # the first numel % parts shards one longer
    inbound = [[_issue("in-node reduce", dist.reduce, shard, dst=groups.intra_ranks[owner], group=groups.intra,
                       async_op=True) if shard.numel() else None for owner, shard in enumerate(piece_shards)]
               for piece_shards in shards]
    # The inter stage of a piece starts as soon as this rank's own shard of it is reduced.
    crossed = _inter_stage(
        [s[me] for s in shards], groups, cast, topk, key, after=[works[me] for works in inbound]
    )
    outbound = []
    for piece_shards, works, crossing in zip(shards, inbound, crossed):
        _wait(works)
        if crossing is not None:
            crossing.wait()
        for owner, shard in enumerate(piece_shards):
            if shard.numel():
                outbound.append(_issue("in-node broadcast", dist.broadcast, shard, src=groups.intra_ranks[owner],
                                       group=groups.intra_out, async_op=True))
    _wait(outbound)


def _torus_native(
    pieces: list[Tensor], groups: ProcessGroups, cast: torch.dtype | None,
    topk: TopKErrorFeedback | None, key: Hashable,
) -> None:
    parts = groups.topology.ranks_per_node
    for i, piece in enumerate(pieces):
        pad = -piece.numel() % parts
        buffer = piece if pad == 0 else torch.cat([piece, piece.new_zeros(pad)])
        shard = buffer.new_empty(buffer.numel() // parts)
        _issue("in-node reduce-scatter", _reduce_scatter, shard, buffer, group=groups.intra)
        _wait(_inter_stage([shard], groups, cast, topk, (key, i)))
        _issue("in-node all-gather", _all_gather, buffer, shard, group=groups.intra_out)
        if pad:
            piece.copy_(buffer[: piece.numel()])


ALLREDUCE_FUNCTIONS: dict[str, Callable[..., Tensor]] = {
    "flat": flat_allreduce_,
    "hier": hier_allreduce_,
    "torus2d": torus2d_allreduce_,
}
"""Algorithm name -> in-place all-reduce."""
