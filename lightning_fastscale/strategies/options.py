"""The names the strategy, the planner, the benchmarks and the configs share, one spelling per concept:
the all-reduce algorithms, the wire dtypes and the pipeline chunk size.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = [
    "ALGORITHMS",
    "AUTO_CHUNK_MB_PER_NODE",
    "CommSetting",
    "DEFAULT_PIPELINE_CHUNK_MB",
    "MB",
    "PLAIN_DDP",
    "WIRE_DTYPES",
    "check_algorithm",
    "check_algorithms",
    "chunk_numel_for",
    "resolve_chunk_mb",
    "wire_bytes_per_element",
    "wire_torch_dtype",
]

ALGORITHMS: tuple[str, ...] = ("flat", "hier", "torus2d")
"""The all-reduce algorithms, simplest first: plain DDP's, Jia et al. 2018's, Mikami et al. 2018's."""

WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""``wire_dtype`` name -> the torch dtype of the inter-node stage (``"fp32"``: no cast)."""

MB = 1024 * 1024
"""Bytes in one "MB" of every ``*_mb`` option: a mebibyte, as DDP's ``bucket_cap_mb`` counts it."""

AUTO_CHUNK_MB_PER_NODE = 2.0
DEFAULT_PIPELINE_CHUNK_MB = "auto"
"""Default ``pipeline_chunk_mb``: ``AUTO_CHUNK_MB_PER_NODE`` MiB per node, none on one node (``docs/strategy.md``)."""


def check_algorithm(name: str, setting: str = "algorithm", extra: Iterable[str] = ()) -> str:
    """``name`` if it is one of `ALGORITHMS` (or ``extra``); else ``ValueError`` naming ``setting``."""
    choices = (*ALGORITHMS, *extra)
    if name not in choices:
        raise ValueError(f"{setting}={name!r}: choose one of {list(choices)}.")
    return name


def check_algorithms(names: Iterable[str], setting: str = "algorithms") -> tuple[str, ...]:
    """`check_algorithm` of each name, as a tuple."""
    return tuple(check_algorithm(n, setting) for n in names)


def wire_torch_dtype(wire_dtype: str) -> torch.dtype:
    """The torch dtype of ``wire_dtype``: the one check of a ``wire_dtype``."""
    try:
        return WIRE_DTYPES[wire_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"wire_dtype={wire_dtype!r}: choose one of {list(WIRE_DTYPES)}.") from None


def wire_bytes_per_element(wire_dtype: str) -> int:
    """Bytes one gradient element takes on the wire for ``wire_dtype``."""
    return wire_torch_dtype(wire_dtype).itemsize


def resolve_chunk_mb(pipeline_chunk_mb: float | str | None, num_nodes: int) -> float | None:
    """The chunk size in MiB that ``pipeline_chunk_mb`` means on ``num_nodes`` nodes (``None``: one piece)."""
    if pipeline_chunk_mb == "auto":
        return AUTO_CHUNK_MB_PER_NODE * num_nodes if num_nodes > 1 else None
    if pipeline_chunk_mb is None:
        return None
    if isinstance(pipeline_chunk_mb, (str, bool)) or not pipeline_chunk_mb > 0:
        raise ValueError(
            f"pipeline_chunk_mb={pipeline_chunk_mb!r} must be a size in MiB > 0, 'auto' "
            f"({AUTO_CHUNK_MB_PER_NODE:g} MiB per node) or None (unchunked buckets)."
        )
    return float(pipeline_chunk_mb)


def chunk_numel_for(pipeline_chunk_mb: float | str | None, num_nodes: int = 1, element_size: int = 4) -> int | None:
    """Elements per pipeline chunk for ``pipeline_chunk_mb`` on ``num_nodes`` nodes (``None``: one piece)."""
    chunk_mb = resolve_chunk_mb(pipeline_chunk_mb, num_nodes)
    return None if chunk_mb is None else max(1, int(chunk_mb * MB) // element_size)


@dataclass(frozen=True)
class CommSetting:
    """How the gradients are all-reduced: the strategy's options that the planner prices.

    ``algorithms``: the candidates (``None``: all, and a planner may keep plain DDP).

    Examples:
        >>> CommSetting(wire_dtype="fp16").chunk_numel(num_nodes=4)  # "auto": 2 MiB per node of fp32
        2097152
    """

    algorithms: tuple[str, ...] | None = None
    wire_dtype: str = "fp32"
    topk_ratio: float | None = None
    pipeline_chunk_mb: float | str | None = DEFAULT_PIPELINE_CHUNK_MB

    def __post_init__(self) -> None:
        if self.algorithms is not None:
            object.__setattr__(self, "algorithms", check_algorithms(self.algorithms))
        wire_torch_dtype(self.wire_dtype)
        if self.topk_ratio is not None and not 0 < self.topk_ratio <= 1:
            raise ValueError(f"topk_ratio={self.topk_ratio!r} must be in (0, 1] (or None: no compression).")
        resolve_chunk_mb(self.pipeline_chunk_mb, 1)

    @property
    def candidates(self) -> tuple[str, ...]:
        """The algorithms to compare: ``algorithms``, or all of them."""
        return ALGORITHMS if self.algorithms is None else self.algorithms

    def chunk_numel(self, num_nodes: int, element_size: int = 4) -> int | None:
        """Elements per pipeline chunk on ``num_nodes`` nodes (``None``: one piece)."""
        return chunk_numel_for(self.pipeline_chunk_mb, num_nodes, element_size)


PLAIN_DDP = CommSetting(("flat",), "fp32", None, None)
"""What plain DDP sends: its own flat fp32 all-reduce, unchunked."""
