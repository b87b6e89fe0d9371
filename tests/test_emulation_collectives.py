"""Pure parts of the emulated-cluster measurement API (no namespaces needed)."""
import pytest

from lightning_fastscale.emulation.collectives import bandwidth_bound_s, parse_algorithm


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
