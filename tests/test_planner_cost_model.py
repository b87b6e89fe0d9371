"""Closed-form checks of the alpha-beta-gamma model (Thakur et al. 2005 forms)."""
import math

import numpy as np
import pytest

from lightning_fastscale.planner.cost_model import (
    ALGORITHMS,
    CommParams,
    CommSetting,
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
    stage_times,
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
WHOLE = CommSetting(pipeline_chunk_mb=None)  # the closed forms of one unchunked all-reduce


def test_single_node_is_intra_ring():
    topo = Topology(1, 4)
    n = 1e6
    assert allreduce_time("flat", n, topo, PARAMS) == pytest.approx(
        ring_allreduce_time(4, 4 * n, PARAMS.alpha_intra, PARAMS.beta_intra, PARAMS.gamma))


def test_one_rank_per_node_all_algorithms_are_the_inter_ring():
    topo = Topology(8, 1)
    n = 3e5
    expected = ring_allreduce_time(8, 4 * n, PARAMS.alpha_inter, PARAMS.beta_inter, PARAMS.gamma)
    for algorithm, t in predict_allreduce(n, topo, PARAMS, WHOLE).items():
        assert t == pytest.approx(expected), algorithm


def test_bandwidth_terms_match_the_byte_counts():
    # No latency, no reduction cost, (almost) free intra-node link: only NIC bytes count.
    params = CommParams(0.0, 1e-18, 0.0, 1e-8, 0.0)
    topo = Topology(2, 4)
    nbytes = 4 * 1e7
    bound = bandwidth_bound(2, nbytes, 1e-8)
    t = predict_allreduce(1e7, topo, params, WHOLE)
    assert t["hier"] == pytest.approx(bound, rel=1e-6)
    assert t["torus2d"] == pytest.approx(bound, rel=1e-6)
    # flat ring sends 2(P-1)/P n per node instead of 2(N-1)/N n: 1.75x for 2 x 4
    assert t["flat"] / t["hier"] == pytest.approx(1.75, rel=1e-6)


def test_torus_latency_terms():
    # Latency only on the inter-node link: torus makes 2(N-1) steps, the flat ring 2(P-1).
    params = CommParams(0.0, 1e-18, 1e-3, 1e-18, 0.0)
    topo = Topology(4, 8)
    t = predict_allreduce(1000, topo, params, WHOLE)
    assert t["torus2d"] == pytest.approx(2 * 3 * 1e-3, rel=1e-6)
    assert t["hier"] == pytest.approx(2 * 3 * 1e-3, rel=1e-6)
    assert t["flat"] == pytest.approx(2 * 31 * 1e-3, rel=1e-6)


def test_wire_dtype_applies_to_the_inter_node_stage_only():
    params = CommParams(1e-5, 1e-10, 2e-5, 1e-8, 1e-11)
    topo, n = Topology(4, 4), 1e6
    for algorithm in ("hier", "torus2d"):
        fp32 = stage_times(algorithm, n, topo, params, "fp32")
        fp16 = stage_times(algorithm, n, topo, params, "bf16")
        latency = stage_times(algorithm, 0.0, topo, params, "fp32")
        # in-node stages unchanged (sums stay fp32); only the inter-node bytes halve
        assert fp16[0] == pytest.approx(fp32[0]) and fp16[2] == pytest.approx(fp32[2])
        assert fp16[1] - latency[1] == pytest.approx((fp32[1] - latency[1]) / 2, rel=1e-12)
        assert allreduce_time(algorithm, n, topo, params, "fp16") == pytest.approx(sum(fp16))
    # the flat ring crosses nodes with all of it, and one node casts its whole all-reduce
    no_latency = CommParams(0.0, 1e-10, 0.0, 1e-8, 1e-11)
    for algorithm in ("flat", "hier", "torus2d"):
        one_node = Topology(1, 8)
        assert allreduce_time(algorithm, n, one_node, no_latency, "fp16") == pytest.approx(
            allreduce_time(algorithm, n, one_node, no_latency, "fp32") / 2, rel=1e-12)
    assert allreduce_time("flat", n, topo, no_latency, "fp16") == pytest.approx(
        allreduce_time("flat", n, topo, no_latency, "fp32") / 2, rel=1e-12)


def test_gamma_inter_prices_the_reduction_between_nodes():
    # gamma_inter replaces gamma in the all-reduces between nodes (flat ring, inter stage) only
    base = CommParams(0.0, 1e-10, 0.0, 1e-8, 2e-9)
    hidden = CommParams(0.0, 1e-10, 0.0, 1e-8, 2e-9, gamma_inter=0.0)
    topo, n = Topology(4, 2), 1e6
    for algorithm in ("hier", "torus2d"):
        full, free = stage_times(algorithm, n, topo, base), stage_times(algorithm, n, topo, hidden)
        flows = 2 if algorithm == "torus2d" else 1
        assert full[1] - free[1] == pytest.approx(3 / 4 * 4 * n / flows * 2e-9, rel=1e-12)
        assert (full[0], full[2]) == pytest.approx((free[0], free[2]), rel=1e-12)
    ring_gain = allreduce_time("flat", n, topo, base) - allreduce_time("flat", n, topo, hidden)
    assert ring_gain == pytest.approx(7 / 8 * 4 * n * 2e-9, rel=1e-12)
    # one node: the in-node gamma applies whatever gamma_inter says
    assert allreduce_time("flat", n, Topology(1, 8), hidden) == pytest.approx(allreduce_time("flat", n, Topology(1, 8), base))
    with pytest.raises(ValueError, match="gamma_inter"):
        CommParams(0.0, 1e-9, 0.0, 1e-9, gamma_inter=-1.0)


def test_one_chunk_equals_unchunked():
    topo = Topology(2, 4)
    for algorithm in ALGORITHMS:
        for wire in ("fp32", "fp16"):
            whole = allreduce_time(algorithm, 3e6, topo, PARAMS, wire)
            assert allreduce_time(algorithm, 3e6, topo, PARAMS, wire, chunk_numel=3e6) == pytest.approx(whole, rel=1e-12)
            assert allreduce_time(algorithm, 3e6, topo, PARAMS, wire, chunk_numel=1e9) == pytest.approx(whole, rel=1e-12)


def test_pipelined_hier_closed_form():
    # hier on 2 x 2, 8 chunks of 1e6 elements: every chunk pays every stage's latency; the
    # inter-node stage (slowest) moves the whole message, the others one chunk each.
    a_in, b_in, a_x, b_x = 1e-4, 1e-10, 3e-4, 1e-8
    params = CommParams(a_in, b_in, a_x, b_x, 0.0)
    n, c, k = 8e6, 1e6, 8
    reduce_lat, bcast_lat = (1 + 1) * a_in, (1 + 1) * a_in  # p=2: (p-1) + log2 p messages
    inter_lat = 2 * a_x  # ring all-reduce over 2 nodes
    expected = (k * (reduce_lat + inter_lat + bcast_lat)
                + 2 * 1 / 2 * (4 * n) * b_x  # inter-node bandwidth term, whole message
                + 2 * (2 * 1 / 2 * (4 * c) * b_in))  # fill (reduce) + drain (broadcast) of one chunk
    got = allreduce_time("hier", n, Topology(2, 2), params, chunk_numel=c)
    assert got == pytest.approx(expected, rel=1e-12)


def test_many_chunks_tend_to_the_slowest_stage():
    # Without latency, pipelining can only help, never beats the slowest stage alone, and
    # approaches it as chunks shrink.
    params = CommParams(0.0, 1e-9, 0.0, 8e-9, 1e-10)
    topo, n = Topology(4, 4), 1.6e7
    for algorithm in ("hier", "torus2d"):
        stages = stage_times(algorithm, n, topo, params)
        unchunked, slowest = sum(stages), max(stages)
        times = [allreduce_time(algorithm, n, topo, params, chunk_numel=n / k) for k in (1, 4, 64, 4096)]
        assert times[0] == pytest.approx(unchunked)
        assert all(later <= earlier + 1e-15 for earlier, later in zip(times, times[1:]))
        assert all(t >= slowest * (1 - 1e-12) for t in times)
        assert times[-1] == pytest.approx(slowest, rel=1e-3)


def test_chunked_flat_ring_only_adds_latency():
    topo, n, k = Topology(2, 4), 4e6, 5
    whole = allreduce_time("flat", n, topo, PARAMS)
    latency = allreduce_time("flat", 1e-300, topo, PARAMS)  # one message's latency terms
    chunked = allreduce_time("flat", n, topo, PARAMS, chunk_numel=n / k)
    assert chunked == pytest.approx(whole + (k - 1) * latency, rel=1e-9)


def test_chunked_vectorised_equals_scalar_and_zero_is_free():
    topo = Topology(2, 4)
    sizes = np.array([0.0, 10.0, 5e5, 3e6, 1.7e7])
    for algorithm in ALGORITHMS:
        vec = allreduce_time(algorithm, sizes, topo, PARAMS, "fp16", chunk_numel=1 << 20)
        assert vec[0] == 0.0
        assert np.allclose(vec[1:], [allreduce_time(algorithm, s, topo, PARAMS, "fp16", chunk_numel=1 << 20)
                                     for s in sizes[1:]], rtol=1e-12)
    with pytest.raises(ValueError, match="chunk_numel"):
        allreduce_time("hier", 1e6, topo, PARAMS, chunk_numel=0)


def test_concurrent_flows_and_per_flow_limit():
    topo, n = Topology(8, 4), 1e7
    base = CommParams(0.0, 1e-18, 0.0, 1e-9, 0.0)
    bound = bandwidth_bound(8, 4 * n, 1e-9)
    assert base.flow_beta(1) == 1e-9 and base.flow_beta(4) == 4e-9  # fair sharing
    # the torus's concurrent flows cost what the shared link gives them, the others are unaffected
    contended = CommParams(0.0, 1e-18, 0.0, 1e-9, 0.0, beta_inter_shared=1.5e-9)
    assert allreduce_time("torus2d", n, topo, contended) == pytest.approx(1.5 * bound, rel=1e-6)
    assert allreduce_time("hier", n, topo, contended) == pytest.approx(bound, rel=1e-6)
    # a per-flow limit of a quarter of the link: one-flow algorithms 4x slower, torus unaffected
    limited = CommParams(0.0, 1e-18, 0.0, 1e-9, 0.0, beta_flow=4e-9)
    t, t0 = predict_allreduce(n, topo, limited, WHOLE), predict_allreduce(n, topo, base, WHOLE)
    assert t["torus2d"] == pytest.approx(t0["torus2d"], rel=1e-9)
    assert t["hier"] == pytest.approx(4 * t0["hier"], rel=1e-6)
    assert t["flat"] == pytest.approx(4 * t0["flat"], rel=1e-6)
    with pytest.raises(ValueError, match="beta_inter_shared"):
        CommParams(0.0, 1e-9, 0.0, 1e-9, beta_inter_shared=0.0)


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
    for algorithm in ("flat", "hier", "torus2d"):
        vec = allreduce_time(algorithm, sizes, topo, PARAMS)
        assert np.allclose(vec, [allreduce_time(algorithm, s, topo, PARAMS) for s in sizes])


def test_choose_algorithm():
    # Slow NIC, fast NVLink: a two-level algorithm beats the flat ring on large messages.
    assert choose_algorithm(PARAMS, 100e6, Topology(4, 8), WHOLE) in ("hier", "torus2d")
    # One node: always ring.
    assert choose_algorithm(PARAMS, 100e6, Topology(1, 8)) == "flat"
    # Same link inside and between nodes: the extra stages cost, the flat ring wins.
    flat = CommParams(1e-6, 1e-9, 1e-6, 1e-9, 0.0)
    assert choose_algorithm(flat, 100e6, Topology(4, 8), WHOLE) == "flat"
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
        allreduce_time("flat", 1, Topology(2, 2), PARAMS, "int8")
    assert math.isclose(allreduce_time("flat", 1e6, Topology(1, 1), PARAMS), 0.0)


def test_flat_ring_step_is_the_slowest_edge_with_its_own_latency():
    # 2 x 4 ring: 14 steps of n/8 bytes; each step lasts as long as its slowest edge, that
    # edge's latency plus its transfer (not the other edge's latency added on top).
    topo, n = Topology(2, 4), 8e6  # 32 MB in fp32, 4 MB per step
    step_bytes = 4 * n / 8
    slow_node_link = CommParams(alpha_intra=1e-3, beta_intra=1e-10, alpha_inter=1e-4, beta_inter=1e-8)
    assert allreduce_time("flat", n, topo, slow_node_link) == pytest.approx(14 * (1e-4 + step_bytes * 1e-8))
    slow_in_node = CommParams(alpha_intra=1e-3, beta_intra=1e-8, alpha_inter=1e-4, beta_inter=1e-9)
    assert allreduce_time("flat", n, topo, slow_in_node) == pytest.approx(14 * (1e-3 + step_bytes * 1e-8))
    # no bytes: the larger latency sets each step
    assert allreduce_time("flat", 0.0, topo, slow_node_link) == 0.0
    assert stage_times("flat", 0.0, topo, slow_node_link)[0] == pytest.approx(14 * 1e-3)
