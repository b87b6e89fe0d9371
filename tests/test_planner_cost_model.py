"""Closed-form checks of the alpha-beta-gamma model (Thakur et al. 2005 forms)."""
import math

import numpy as np
import pytest

from lightning_fastscale.planner.cost_model import (
    CommParams,
    Topology,
    allgather_time,
    allreduce_time,
    bandwidth_bound,
    broadcast_time,
    choose_algorithm,
    predict_allreduce,
    reduce_scatter_time,
    reduce_time,
    ring_allreduce_time,
)


def test_ring_closed_form():
    # 2(p-1) a + 2(p-1)/p n b + (p-1)/p n g with p=4, n=1000, a=1, b=0.01, g=0.001
    assert ring_allreduce_time(4, 1000, 1.0, 0.01, 0.001) == pytest.approx(6 + 15 + 0.75)
    assert ring_allreduce_time(1, 1000, 1.0, 0.01) == 0.0


def test_primitives_closed_forms():
    p, n, a, b, g = 8, 4096.0, 2.0, 0.5, 0.25
    assert reduce_scatter_time(p, n, a, b, g) == pytest.approx(7 * a + 7 / 8 * n * (b + g))
    assert allgather_time(p, n, a, b) == pytest.approx(7 * a + 7 / 8 * n * b)
    assert reduce_time(p, n, a, b, g) == pytest.approx((7 + 3) * a + 2 * 7 / 8 * n * b + 7 / 8 * n * g)
    assert broadcast_time(p, n, a, b) == pytest.approx((3 + 7) * a + 2 * 7 / 8 * n * b)
    # reduce-scatter + all-gather is the ring all-reduce
    assert reduce_scatter_time(p, n, a, b, g) + allgather_time(p, n, a, b) == pytest.approx(
        ring_allreduce_time(p, n, a, b, g))


PARAMS = CommParams(alpha_intra=5e-6, beta_intra=1e-10, alpha_inter=2e-5, beta_inter=8e-9, gamma=1e-11)


def test_single_node_is_intra_ring():
    topo = Topology(1, 4)
    n = 1e6
    assert allreduce_time("ring", n, topo, PARAMS) == pytest.approx(
        ring_allreduce_time(4, 4 * n, PARAMS.alpha_intra, PARAMS.beta_intra, PARAMS.gamma))


def test_one_rank_per_node_all_algorithms_are_the_inter_ring():
    topo = Topology(8, 1)
    n = 3e5
    expected = ring_allreduce_time(8, 4 * n, PARAMS.alpha_inter, PARAMS.beta_inter, PARAMS.gamma)
    for algorithm, t in predict_allreduce(n, topo, PARAMS).items():
        assert t == pytest.approx(expected), algorithm


def test_bandwidth_terms_match_the_byte_counts():
    # No latency, no reduction cost, (almost) free intra-node link: only NIC bytes count.
    params = CommParams(0.0, 1e-18, 0.0, 1e-8, 0.0)
    topo = Topology(2, 4)
    nbytes = 4 * 1e7
    bound = bandwidth_bound(2, nbytes, 1e-8)
    t = predict_allreduce(1e7, topo, params)
    assert t["hier"] == pytest.approx(bound, rel=1e-6)
    assert t["torus2d"] == pytest.approx(bound, rel=1e-6)
    # flat ring sends 2(P-1)/P n per node instead of 2(N-1)/N n: 1.75x for 2 x 4
    assert t["ring"] / t["hier"] == pytest.approx(1.75, rel=1e-6)


def test_torus_latency_terms():
    # Latency only on the inter-node link: torus makes 2(N-1) steps, the flat ring 2(P-1).
    params = CommParams(0.0, 1e-18, 1e-3, 1e-18, 0.0)
    topo = Topology(4, 8)
    t = predict_allreduce(1000, topo, params)
    assert t["torus2d"] == pytest.approx(2 * 3 * 1e-3, rel=1e-6)
    assert t["hier"] == pytest.approx(2 * 3 * 1e-3, rel=1e-6)
    assert t["ring"] == pytest.approx(2 * 31 * 1e-3, rel=1e-6)


def test_wire_dtype_halves_bandwidth_term():
    params = CommParams(0.0, 1e-10, 0.0, 1e-8, 1e-11)
    topo = Topology(4, 4)
    for algorithm in ("ring", "hier", "torus2d"):
        fp32 = allreduce_time(algorithm, 1e6, topo, params, "fp32")
        fp16 = allreduce_time(algorithm, 1e6, topo, params, "fp16")
        assert fp16 == pytest.approx(fp32 / 2, rel=1e-9)


def test_topk_inter_stage_closed_form():
    params = CommParams(0.0, 1e-18, 1e-4, 1e-8, 0.0)
    topo, numel, ratio = Topology(4, 1), 1e6, 0.01
    dense = allreduce_time("hier", numel, topo, params)
    sparse = allreduce_time("hier", numel, topo, params, topk_ratio=ratio)
    # all-gather of k (fp32 value, int32 index) pairs from each of N-1 other nodes
    assert sparse == pytest.approx(3 * 1e-4 + 3 * ratio * numel * 8 * 1e-8, rel=1e-9)
    assert sparse < dense
    with pytest.raises(ValueError, match="topk_ratio"):
        allreduce_time("hier", numel, topo, params, topk_ratio=0.0)


def test_vectorised_sizes_equal_scalar_calls():
    topo = Topology(2, 4)
    sizes = np.array([1.0, 1e3, 1e6])
    for algorithm in ("ring", "hier", "torus2d"):
        vec = allreduce_time(algorithm, sizes, topo, PARAMS)
        assert np.allclose(vec, [allreduce_time(algorithm, s, topo, PARAMS) for s in sizes])


def test_choose_algorithm():
    # Slow NIC, fast NVLink: a two-level algorithm beats the flat ring on large messages.
    assert choose_algorithm(PARAMS, 100e6, Topology(4, 8)) in ("hier", "torus2d")
    # One node: always ring.
    assert choose_algorithm(PARAMS, 100e6, Topology(1, 8)) == "ring"
    # Same link inside and between nodes: the extra stages cost, the flat ring wins.
    flat = CommParams(1e-6, 1e-9, 1e-6, 1e-9, 0.0)
    assert choose_algorithm(flat, 100e6, Topology(4, 8)) == "ring"
    with pytest.raises(ValueError, match="topology"):
        choose_algorithm(PARAMS, 1e6)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="beta_inter"):
        CommParams(1e-6, 1e-9, 1e-6, 0.0)
    with pytest.raises(ValueError, match="alpha_intra"):
        CommParams(-1.0, 1e-9, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology.from_world(10, 4)
    with pytest.raises(ValueError, match="algorithm"):
        allreduce_time("tree", 1, Topology(2, 2), PARAMS)
    with pytest.raises(ValueError, match="wire_dtype"):
        allreduce_time("ring", 1, Topology(2, 2), PARAMS, "int8")
    assert math.isclose(allreduce_time("ring", 1e6, Topology(1, 1), PARAMS), 0.0)
