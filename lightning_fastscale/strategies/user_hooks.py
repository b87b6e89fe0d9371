"""A user's DDP communication hook composed with the hierarchical all-reduce.

More in ``docs/strategy.md`` ("A user's communication hook").
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations as real objects.
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_fastscale.strategies.comm_hooks import HOOKS, HierarchicalHookState, run_bucket_job

POST_LOCAL_SGD = ("(post-local SGD) replaces the gradient all-reduce by periodic model averaging, so there is no "
                  "gradient all-reduce left to make hierarchical: use lightning's DDPStrategy for post-local SGD.")
"""Why post-local SGD is refused, whichever option asks for it."""


def _name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", repr(hook))


def check_user_hook(
    hook: Callable | None,
    state: Any,
    wrapper: Callable | None,
    algorithm: str,
    wire_dtype: str,
    compression: str | None,
) -> None:
    """Raise ``ValueError`` naming the settings when ``hook``/``state``/``wrapper`` cannot combine (``"auto"`` is rechecked)."""
    if hook is None:
        if state is not None:
            raise ValueError("ddp_comm_state= was given without ddp_comm_hook=: give the hook it belongs to.")
        return
    if hook is default_hooks.allreduce_hook:
        raise ValueError(
            "ddp_comm_hook=allreduce_hook is DDP's flat all-reduce, which this strategy replaces: drop it "
            "(algorithm='flat' is the flat all-reduce) or use lightning's DDPStrategy."
        )
    if hook is post_localSGD_hook.post_localSGD_hook:
        raise ValueError(f"ddp_comm_hook=post_localSGD_hook {POST_LOCAL_SGD}")
    if algorithm not in ("hier", "auto"):
        raise ValueError(
            f"ddp_comm_hook={_name(hook)} runs as the inter-node stage of algorithm='hier' (among the node "
            f"leaders, on the node-averaged bucket), not with algorithm={algorithm!r}: 'torus2d' reduces each "
            "bucket as per-rank shards, which a bucket hook cannot take, and 'flat' has no inter-node stage. "
            "Use algorithm='hier', or lightning's DDPStrategy for the hook alone."
        )
    if wire_dtype != "fp32" or compression is not None:
        raise ValueError(
            f"ddp_comm_hook={_name(hook)} decides what crosses the nodes; wire_dtype={wire_dtype!r} and "
            f"compression={compression!r} would cast or sparsify it a second time: leave wire_dtype='fp32' "
            "and compression=None (fp16_compress_hook gives an fp16 inter-node wire)."
        )
    if isinstance(state, dist.ProcessGroup) or getattr(state, "process_group", None) is not None:
        raise ValueError(
            f"ddp_comm_state for {_name(hook)} names its own process group; the strategy runs the hook "
            "among the node leaders and sets that group itself: leave process_group=None."
        )
    if state is not None and not hasattr(state, "process_group"):
        raise ValueError(
            f"ddp_comm_state={type(state).__name__} has no process_group attribute, so the strategy cannot "
            "point the hook at the node leaders' group: give a state with process_group=None (such as "
            "PowerSGDState) or None (torch's default hooks)."
        )


@dataclass(frozen=True)
class UserHook:
    """A user's ``ddp_comm_hook``, ``ddp_comm_state`` and ``ddp_comm_wrapper``, each optional.

    Examples:
        >>> from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        >>> hook = UserHook(default_hooks.fp16_compress_hook)
        >>> hook.given, hook.name, UserHook().given
        (True, 'fp16_compress_hook', False)
    """

    hook: Optional[Callable] = None
    state: Any = None
    wrapper: Optional[Callable] = None

    @property
    def given(self) -> bool:
        """Whether the user's hook or wrapper takes the place of the strategy's plain hook."""
        return self.hook is not None or self.wrapper is not None

    @property
    def name(self) -> Optional[str]:
        """The hook's qualified name (``None`` without a hook)."""
        return None if self.hook is None else _name(self.hook)

    def __getstate__(self) -> dict:
        # PowerSGDState's own unpickling reads the default process group, which a rank started by
        # spawn (ddp_spawn, a multirun on several devices) does not have yet: carry its fields
        # instead; its group is the strategy's to set at setup anyway
        fields = {"hook": self.hook, "state": self.state, "wrapper": self.wrapper}
        slots = getattr(type(self.state), "__slots__", ())
        if "process_group" in slots:
            fields["state"] = None
            fields["state_slots"] = (type(self.state), {s: getattr(self.state, s) for s in slots if s != "process_group"})
        return fields

    def __setstate__(self, fields: dict) -> None:
        fields = dict(fields)
        if "state_slots" in fields:
            cls, values = fields.pop("state_slots")
            fields["state"] = cls.__new__(cls)
            for slot, value in {**values, "process_group": None}.items():
                setattr(fields["state"], slot, value)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def check(self, algorithm: str, wire_dtype: str, compression: Optional[str]) -> None:
        """`check_user_hook` against these settings."""
        check_user_hook(self.hook, self.state, self.wrapper, algorithm, wire_dtype, compression)

    def wrap(self, hook: Callable) -> Callable:
        """``hook`` inside the user's wrapper, if there is one."""
        return self.wrapper(hook) if self.wrapper is not None else hook

    def register_alone(self, ddp_model: DistributedDataParallel) -> None:
        """Register the user's hook as plain DDP would (one node: the hook is the whole all-reduce)."""
        assert self.hook is not None
        ddp_model.register_comm_hook(self.state, self.wrap(self.hook))

    def register(self, ddp_model: DistributedDataParallel, hierarchy: HierarchicalHookState) -> None:
        """Register `leader_hook` (with a user's hook) or the strategy's hook for ``hierarchy.algorithm``, wrapped."""
        if self.hook is not None:
            ddp_model.register_comm_hook(LeaderHookState.create(hierarchy, self), leader_hook)
        else:
            ddp_model.register_comm_hook(hierarchy, self.wrap(HOOKS[hierarchy.algorithm]))


@dataclass
class LeaderHookState:
    """State of `leader_hook`: the strategy's groups and thread, the user's hook and its state."""

    hierarchy: HierarchicalHookState
    hook: Callable
    hook_state: Any

    @classmethod
    def create(cls, hierarchy: HierarchicalHookState, user: UserHook) -> "LeaderHookState":
        """Point the user's state (``None`` or an object with ``process_group=None``) at the node leaders' group."""
        assert user.hook is not None
        inter = hierarchy.groups.inter
        if user.state is not None:
            user.state.process_group = inter
        return cls(hierarchy=hierarchy, hook=user.wrap(user.hook), hook_state=inter if user.state is None else user.state)


def leader_hook(state: LeaderHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce the bucket onto the node leader, run the user's hook among leaders, broadcast in the node.

    Runs where, and in the order, the strategy's own hooks run, so collectives match on every rank.
    """
    tensor = bucket.buffer()
    index = bucket.index()
    hierarchy = state.hierarchy
    groups = hierarchy.groups
    ranks_per_node = groups.topology.ranks_per_node
    leader = groups.intra_ranks[0]

    def reduce() -> None:
        if ranks_per_node > 1:
            dist.reduce(tensor, dst=leader, group=groups.intra)
        if groups.is_leader:
            if ranks_per_node > 1:
                tensor.div_(ranks_per_node)
            averaged = state.hook(state.hook_state, bucket).wait()
            if averaged.data_ptr() != tensor.data_ptr():
                tensor.copy_(averaged)
        if ranks_per_node > 1:
            dist.broadcast(tensor, src=leader, group=groups.intra_out)

    def work(future: torch.futures.Future) -> None:
        reduce()
        future.set_result(tensor)

    return run_bucket_job(hierarchy, tensor, index, work)
