"""The strategy's pieces alone, without processes: node checks, plan resolution, hook jobs, residuals, report."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_fastscale.strategies.allreduce import TopKErrorFeedback
from lightning_fastscale.strategies.comm_hooks import (
    CommHookError,
    HierarchicalHookState,
    hier_hook,
    run_bucket_job,
)
from lightning_fastscale.strategies.node_checks import check_nodes_uniform
from lightning_fastscale.strategies.plan_report import algorithm_label, algorithm_note, hook_name, plan_message
from lightning_fastscale.strategies.planning import runs_ddp_allreduce
from lightning_fastscale.strategies.topk_residuals import (
    SavedResiduals,
    comm_layout,
    residual_path,
    residual_state,
    resplit_residuals,
    restore_residuals,
)
from lightning_fastscale.strategies.topology import ProcessGroups, Topology
from lightning_fastscale.strategies.user_hooks import UserHook, leader_hook

TWO_BY_TWO = Topology(num_nodes=2, ranks_per_node=2)


def _hook_state(inline: bool, topk: TopKErrorFeedback | None = None) -> HierarchicalHookState:
    # No collective runs here, so the groups themselves are never touched.
    groups = ProcessGroups(TWO_BY_TWO, rank=1, backend="gloo", intra=None, intra_out=None, inter=None,  # type: ignore[arg-type]
                           world=None, intra_ranks=[0, 1], inter_ranks=[1, 3])  # type: ignore[arg-type]
    return HierarchicalHookState(groups=groups, algorithm="hier", inline=inline, topk=topk)


def test_nodes_with_different_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"different numbers of ranks per node \['2', '3'\]"):
        check_nodes_uniform([(0, 0, 2), (1, 0, 2), (2, 1, 3), (3, 1, 3)], devices=2)


def test_ddp_allreduce_only_where_nothing_needs_a_hook() -> None:
    one = Topology(1, 4)
    assert runs_ddp_allreduce(one, "fp32", None, False, None)
    assert not runs_ddp_allreduce(one, "fp32", "topk", False, None)
    assert not runs_ddp_allreduce(one, "fp32", None, True, None)
    assert not runs_ddp_allreduce(TWO_BY_TWO, "fp32", None, False, None)
    assert runs_ddp_allreduce(TWO_BY_TWO, "fp16", None, False, "plain DDP within 5%")


@pytest.mark.parametrize("inline", [True, False])
def test_a_failed_bucket_fails_the_later_ones_without_running_them(inline: bool) -> None:
    state = _hook_state(inline)
    tensor, ran = torch.ones(4), []

    def fails(future: torch.futures.Future) -> None:
        ran.append("first")
        raise RuntimeError("peer gone")

    def would_run(future: torch.futures.Future) -> None:
        ran.append("second")
        future.set_result(tensor)

    try:
        with pytest.raises(CommHookError, match="hier all-reduce of DDP bucket 3 failed on rank 1 in stage 'hook'"):
            run_bucket_job(state, tensor, 3, fails).wait()
        with pytest.raises(CommHookError, match="bucket 3"):
            run_bucket_job(state, tensor, 4, would_run).wait()
        assert ran == ["first"] and isinstance(state.error.__cause__, RuntimeError)
    finally:
        state.close()


def test_a_good_bucket_completes_with_its_tensor() -> None:
    state = _hook_state(inline=False)
    tensor = torch.ones(3)
    try:
        assert run_bucket_job(state, tensor, 0, lambda future: future.set_result(tensor.mul_(2))).wait() is tensor
        assert state.error is None and tensor.tolist() == [2.0, 2.0, 2.0]
    finally:
        state.close()


def _save_residuals(ckpt, topology: Topology, algorithm: str, chunk_numel: int | None,
                    errors: dict[int, dict]) -> SavedResiduals:
    """Write rank r's ``errors[r]`` (empty where not given) beside ``ckpt``, as the strategy does."""
    for rank in range(topology.world_size):
        state = _hook_state(inline=True, topk=TopKErrorFeedback(0.5))
        state.topk.errors, state.iteration = errors.get(rank, {}), 7
        torch.save(residual_state(state, comm_layout(topology, algorithm, 0.5, chunk_numel, rank)),
                   residual_path(ckpt, rank))
    return SavedResiduals(str(ckpt), lambda path: torch.load(path, weights_only=True))


def _restore(saved: SavedResiduals, topology: Topology, algorithm: str, chunk_numel: int | None) -> list:
    states = []
    for rank in range(topology.world_size):
        state = _hook_state(inline=True, topk=TopKErrorFeedback(0.5))
        restore_residuals(state, saved, comm_layout(topology, algorithm, 0.5, chunk_numel, rank), torch.device("cpu"))
        states.append(state)
    return states


def test_residuals_restore_only_on_their_layout(tmp_path) -> None:
    saved = _save_residuals(tmp_path / "c.ckpt", TWO_BY_TWO, "hier", None, {2: {(0, 1): torch.tensor([0.25, -1.0])}})
    resumed = _restore(saved, TWO_BY_TWO, "hier", None)[2]
    assert resumed.iteration == 7 and resumed.topk.restored == {(0, 1)}
    assert torch.equal(resumed.topk.errors[(0, 1)], torch.tensor([0.25, -1.0]))

    other = _hook_state(inline=True, topk=TopKErrorFeedback(0.5))
    with pytest.warns(UserWarning, match="algorithm 'hier' in the checkpoint vs 'torus2d' now"):
        restore_residuals(other, saved, comm_layout(TWO_BY_TWO, "torus2d", 0.5, None, 2), torch.device("cpu"))
    # the torus keeps a shard per local rank: another world size cannot re-split it
    torus = _save_residuals(tmp_path / "t.ckpt", TWO_BY_TWO, "torus2d", None, {})
    with pytest.warns(UserWarning, match="world_size 4 in the checkpoint vs 6 now.*restarts from zero"):
        restore_residuals(other, torus, comm_layout(Topology(3, 2), "torus2d", 0.5, None, 0), torch.device("cpu"))
    with pytest.warns(UserWarning, match=f"no top-k residuals for rank 1 at {tmp_path / 'x.ckpt'}"):
        restore_residuals(other, SavedResiduals(str(tmp_path / "x.ckpt"), saved.load),
                          comm_layout(TWO_BY_TWO, "hier", 0.5, None, 1), torch.device("cpu"))
    assert other.iteration == 0 and other.topk.errors == {}


def _joined(errors: dict) -> dict:
    """Per bucket: its chunks joined in order."""
    return {b: torch.cat([errors[k] for k in sorted(k for k in errors if k[0] == b)]) for b in {k[0] for k in errors}}


@pytest.mark.parametrize("before,after", [(4, 2), (2, 3), (4, 3), (3, 3)])
def test_a_resplit_keeps_the_residual_sum_per_bucket(before: int, after: int) -> None:
    g = torch.Generator().manual_seed(before * 10 + after)
    old = [{(b, i): torch.randn(5, generator=g) for b in ("a", "b") for i in range(2)} for _ in range(before)]
    new = [resplit_residuals(old, h, after, 3) for h in range(after)]
    for bucket in ("a", "b"):
        kept = sum(_joined(errors)[bucket] for errors in old)
        assert torch.allclose(sum(_joined(errors).get(bucket, 0) for errors in new), kept, atol=1e-6)
    assert all(t.numel() <= 3 for errors in new for t in errors.values())  # cut into the new chunks
    if before == after:
        assert all(torch.equal(_joined(n)[b], _joined(o)[b]) for n, o in zip(new, old) for b in ("a", "b"))


def test_residuals_follow_the_node_leaders_to_another_world_size(tmp_path) -> None:
    """2 nodes x 2 ranks (leaders 0 and 2 hold residuals, in 4-element chunks) resumed on 3 nodes
    x 1 rank, unchunked: the per-bucket sum is kept and every rank takes the hook's iteration."""
    g = torch.Generator().manual_seed(0)
    errors = {r: {("p", i): torch.randn(4, generator=g) for i in range(2)} for r in (0, 2)}
    saved = _save_residuals(tmp_path / "c.ckpt", TWO_BY_TWO, "hier", 4, errors)
    states = _restore(saved, Topology(3, 1), "hier", None)
    assert [s.iteration for s in states] == [7, 7, 7]
    restored = sum(_joined(s.topk.errors).get("p", 0) for s in states)
    assert torch.allclose(restored, _joined(errors[0])["p"] + _joined(errors[2])["p"])
    assert set(states[0].topk.errors) == {("p", 0)} and states[2].topk.errors == {}  # 0 -> 0, 2 -> 1, none for 2
    # on one node there is no inter-node stage left to owe the sum to
    with pytest.warns(UserWarning, match="one node has no inter-node stage"):
        _restore(saved, Topology(1, 2), "hier", None)


def test_momentum_correction_velocities_travel_with_the_residuals(tmp_path) -> None:
    """With ``topk_momentum`` each leader's velocities are saved, restored on the same layout and
    re-split like the residuals on another world size (their sum is the global momentum); a run
    without momentum correction does not take them."""
    g = torch.Generator().manual_seed(1)
    parts = {r: {("p", 0): torch.randn(4, generator=g)} for r in (0, 2)}
    velocities = {r: {("p", 0): torch.randn(4, generator=g)} for r in (0, 2)}
    for rank in range(TWO_BY_TWO.world_size):
        state = _hook_state(inline=True, topk=TopKErrorFeedback(0.5, momentum=0.9))
        state.topk.errors, state.topk.velocities = parts.get(rank, {}), velocities.get(rank, {})
        state.iteration = 7
        torch.save(residual_state(state, comm_layout(TWO_BY_TWO, "hier", 0.5, None, rank, 0.9)),
                   residual_path(tmp_path / "c.ckpt", rank))
    saved = SavedResiduals(str(tmp_path / "c.ckpt"), lambda path: torch.load(path, weights_only=True))

    def restore(topology: Topology, rank: int, momentum: float) -> object:
        state = _hook_state(inline=True, topk=TopKErrorFeedback(0.5, momentum=momentum))
        restore_residuals(state, saved, comm_layout(topology, "hier", 0.5, None, rank, momentum), torch.device("cpu"))
        return state

    same = restore(TWO_BY_TWO, 2, 0.9)
    assert torch.equal(same.topk.velocities[("p", 0)], velocities[2][("p", 0)])
    assert torch.equal(same.topk.errors[("p", 0)], parts[2][("p", 0)])
    with pytest.warns(UserWarning, match="one node has no inter-node stage"):
        one = restore(Topology(1, 1), 0, 0.9)
    assert one.topk.velocities == {}
    three = [restore(Topology(3, 1), rank, 0.9) for rank in range(3)]
    total = sum(s.topk.velocities.get(("p", 0), 0) for s in three)
    assert torch.allclose(total, velocities[0][("p", 0)] + velocities[2][("p", 0)])
    with pytest.warns(UserWarning, match="topk_momentum 0.9 in the checkpoint vs None now"):
        plain = restore(TWO_BY_TWO, 2, 0.0)
    assert plain.topk.errors == {} and plain.topk.velocities == {}


def test_report_names_the_users_hook_and_where_it_runs() -> None:
    user = UserHook(default_hooks.fp16_compress_hook)
    assert hook_name("hier", user, ddp_allreduce=False) == "fp16_compress_hook"
    assert algorithm_label("hier", user, num_nodes=2) == "hier (inter-node stage: fp16_compress_hook)"
    assert algorithm_label("flat", user, num_nodes=1) == "fp16_compress_hook"
    assert plan_message("S", {"strategy/a": 1, "strategy/b": [2.0]}) == "S: a=1, b=[2.0]"


class _DDP:
    def register_comm_hook(self, state, hook) -> None:
        self.registered = (state, hook)


def _wrapper(hook):
    return ("wrapped", hook)


def test_user_hook_registers_inside_its_wrapper() -> None:
    ddp = _DDP()
    UserHook(default_hooks.fp16_compress_hook, "state", _wrapper).register_alone(ddp)  # type: ignore[arg-type]
    assert ddp.registered == ("state", ("wrapped", default_hooks.fp16_compress_hook))
    assert UserHook(wrapper=_wrapper).given and not UserHook().given


def test_registered_hook_is_the_strategys_or_the_users_among_leaders() -> None:
    state, ddp = _hook_state(inline=True), _DDP()
    UserHook().register(ddp, state)  # type: ignore[arg-type]
    assert ddp.registered == (state, hier_hook)
    UserHook(wrapper=_wrapper).register(ddp, state)  # type: ignore[arg-type]
    assert ddp.registered == (state, ("wrapped", hier_hook))
    UserHook(default_hooks.fp16_compress_hook).register(ddp, state)  # type: ignore[arg-type]
    leader_state, hook = ddp.registered
    assert hook is leader_hook and leader_state.hierarchy is state
    assert leader_state.hook is default_hooks.fp16_compress_hook and leader_state.hook_state is state.groups.inter


def test_algorithm_note_says_when_another_algorithm_runs() -> None:
    assert algorithm_note("hier", "flat", Topology(1, 4), ddp_allreduce=True).endswith("DDP's own flat all-reduce: one node, fp32, no compression")
    assert algorithm_note("torus2d", "torus2d", Topology(1, 4), ddp_allreduce=False).endswith("inside the node: one node")
    assert algorithm_note("hier", "hier", Topology(3, 1), ddp_allreduce=False).endswith("across nodes: one rank per node")
    assert algorithm_note("torus2d", "torus2d", Topology(2, 4), ddp_allreduce=False) is None
    assert algorithm_note("auto", "flat", Topology(1, 4), ddp_allreduce=True) is None  # plain_ddp_reason's job
    assert algorithm_note("flat", "flat", Topology(1, 4), ddp_allreduce=True) is None


def test_comm_setting_refuses_a_bad_option_by_name() -> None:
    from lightning_fastscale.strategies.options import PLAIN_DDP, CommSetting

    for bad, name in (({"wire_dtype": "fp8"}, "wire_dtype"), ({"topk_ratio": 0.0}, "topk_ratio"),
                      ({"algorithms": ("ring",)}, "algorithms"), ({"pipeline_chunk_mb": -1}, "pipeline_chunk_mb")):
        with pytest.raises(ValueError, match=name):
            CommSetting(**bad)
    assert CommSetting().candidates == ("flat", "hier", "torus2d") and CommSetting(("hier",)).candidates == ("hier",)
    assert CommSetting(pipeline_chunk_mb=1.0).chunk_numel(num_nodes=8) == 2**18  # 1 MiB of fp32
    assert PLAIN_DDP.chunk_numel(num_nodes=8) is None and PLAIN_DDP.candidates == ("flat",)
