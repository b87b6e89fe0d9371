"""Building the node groups and registering the communication hook on a ``DistributedDataParallel`` module.

[`install_comm_hook`][lightning_fastscale.strategies.hook_install.install_comm_hook] is the one
place where the strategy's choice (algorithm, wire dtype, top-k, pipelining, the user's hook)
becomes a [`HierarchicalHookState`][lightning_fastscale.strategies.HierarchicalHookState] and a
registered hook, in torch's ``register_comm_hook(state, hook)`` style: the strategy's own hook
(`comm_hooks.HOOKS`), optionally inside the user's wrapper, or the user's hook as the
inter-node stage (`user_hooks.leader_hook`).
"""
from __future__ import annotations

from datetime import timedelta

from torch.nn.parallel import DistributedDataParallel

from lightning_fastscale.strategies.allreduce import TopKErrorFeedback
from lightning_fastscale.strategies.comm_hooks import HOOKS, HierarchicalHookState
from lightning_fastscale.strategies.topology import Topology, build_process_groups
from lightning_fastscale.strategies.user_hooks import LeaderHookState, UserHook, leader_hook


def install_comm_hook(
    ddp_model: DistributedDataParallel,
    topology: Topology,
    algorithm: str,
    *,
    wire_dtype: str = "fp32",
    topk_ratio: float | None = None,
    topk_start_iter: int = 2,
    chunk_numel: int | None = None,
    user_hook: UserHook | None = None,
    timeout: timedelta | None = None,
) -> HierarchicalHookState:
    """Build ``topology``'s process groups and register ``algorithm``'s hook on ``ddp_model``; return its state.

    ``topk_ratio``: top-k compression of the inter-node stage (``None``: off). With a
    ``user_hook`` whose ``hook`` is set, that hook runs among the node leaders; a wrapper alone
    wraps the strategy's hook. Collective: every rank calls it, after ``init_process_group``.
    """
    user_hook = user_hook or UserHook()
    state = HierarchicalHookState(
        groups=build_process_groups(topology, timeout=timeout),
        wire_dtype=wire_dtype,
        topk=None if topk_ratio is None else TopKErrorFeedback(topk_ratio),
        topk_start_iter=topk_start_iter,
        chunk_numel=chunk_numel,
        algorithm=algorithm,
        param_index={id(p): i for i, p in enumerate(ddp_model.parameters())},
    )
    if user_hook.hook is not None:
        ddp_model.register_comm_hook(LeaderHookState.create(state, user_hook), leader_hook)
    else:
        ddp_model.register_comm_hook(state, user_hook.wrap(HOOKS[algorithm]))
    return state
