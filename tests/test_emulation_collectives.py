"""Pure parts of the emulated-cluster measurement API (no namespaces needed)."""
import pytest

from lightning_fastscale.emulation.collectives import bandwidth_bound_s, parse_algorithm, rotated


def test_bandwidth_bound_is_2_n_minus_1_over_n_m_over_b() -> None:
    # 2 nodes, 100 MB, 800 Mbit/s = 100 MB/s: each node must move 100 MB -> 1 s.
    assert bandwidth_bound_s(100e6, 2, 800) == pytest.approx(1.0)
    # 4 nodes: 2 * 3/4 = 1.5x the payload.
    assert bandwidth_bound_s(100e6, 4, 800) == pytest.approx(1.5)


def test_parse_algorithm_specs() -> None:
    assert parse_algorithm("flat") == ("flat", "fp32", 1)
    assert parse_algorithm("hier:fp16@8") == ("hier", "fp16", 8)
    assert parse_algorithm("torus2d@16") == ("torus2d", "fp32", 16)
    assert parse_algorithm("hier:bf16@4mb") == ("hier", "bf16", 4.0)
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        parse_algorithm("tree")
    with pytest.raises(ValueError, match="unknown wire dtype 'int8'"):
        parse_algorithm("hier:int8")
    with pytest.raises(ValueError, match="positive integer"):
        parse_algorithm("hier@0")
    with pytest.raises(ValueError, match="MiB"):
        parse_algorithm("hier@0mb")


def test_rotated_starts_each_round_with_the_next_item() -> None:
    names = ["flat", "hier", "torus2d"]
    assert [rotated(names, r) for r in range(4)] == [
        ["flat", "hier", "torus2d"], ["hier", "torus2d", "flat"], ["torus2d", "flat", "hier"], ["flat", "hier", "torus2d"],
    ]
    assert rotated([], 3) == []


def _interleaved_2x2(rank: int, world: int) -> tuple:
    import torch

    from lightning_fastscale.emulation.collectives import _make_algorithm, _time_interleaved
    from lightning_fastscale.strategies.topology import Topology, build_process_groups

    groups = build_process_groups(Topology.from_world(world, 2))
    calls: list[str] = []

    def recorded(name: str, fn):
        def run(t):
            calls.append(name)
            fn(t)
        return run

    numel = 1000
    runs = {spec: recorded(spec, _make_algorithm(spec, numel, groups, {})) for spec in ("flat", "hier", "torus2d@3")}
    runs["noop"] = recorded("noop", lambda t: None)  # does not reduce: its error must show
    base = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    times, errors = _time_interleaved(runs, base, reps=2)
    return calls, times, errors


@pytest.mark.slow
def test_time_interleaved_rotates_rounds_and_checks_every_result() -> None:
    from tests.distributed import run_distributed

    for calls, times, errors in run_distributed(_interleaved_2x2, 4, timeout=300):  # slow only on a loaded machine
        warm_up, round1, round2 = calls[:4], calls[4:8], calls[8:]
        assert warm_up == ["flat", "hier", "torus2d@3", "noop"]
        assert round1 == ["hier", "torus2d@3", "noop", "flat"]
        assert round2 == ["torus2d@3", "noop", "flat", "hier"]
        assert all(len(t) == 2 and min(t) > 0 for t in times.values())
        assert max(errors[s] for s in ("flat", "hier", "torus2d@3")) < 1e-6
        assert errors["noop"] > 0.5  # rank r kept (r + 1) * base of a sum 10 * base
