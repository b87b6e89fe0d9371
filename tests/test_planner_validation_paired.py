"""The paired (round-by-round) verdict of the planner validation on known repetitions."""
import pytest

from benchmarks.planner_verdicts import format_across, paired_stats, predict_rows


def test_miss_is_beyond_noise_only_if_the_fastest_won_every_round() -> None:
    # Round i of every algorithm was taken together. hier has the lowest median but torus2d
    # (picked) beats it in round 2: a miss within noise.
    reps = {"flat": [3.0, 3.0, 3.0], "hier": [1.0, 1.0, 1.2], "torus2d": [1.1, 1.1, 1.1]}
    stats = paired_stats(reps, picked="torus2d", fastest="hier")
    assert stats["round_wins"] == {"flat": 0, "hier": 2, "torus2d": 1}
    assert stats["rounds"] == 3
    assert stats["picked_vs_round_best"] == pytest.approx(1.1)  # median of 1.1, 1.1, 1.0
    assert stats["miss_beyond_noise"] is False
    # hier faster in every round: beyond noise.
    reps["hier"][2] = 1.05
    assert paired_stats(reps, picked="torus2d", fastest="hier")["miss_beyond_noise"] is True
    # A right pick is never a miss.
    assert paired_stats(reps, picked="hier", fastest="hier")["miss_beyond_noise"] is False


def _run(fastest: str) -> list[dict]:
    """One run of one case (2 x 4, 1M elements, unchunked), ``fastest`` measured fastest."""
    params = dict(alpha_intra=1e-4, beta_intra=1e-9, alpha_inter=0.0, beta_inter=1.6e-8, gamma=2e-9)
    times = {a: 0.10 for a in ("flat", "hier", "torus2d")} | {fastest: 0.09}
    return [dict(nodes=2, ranks_per_node=4, cap_mbit=500.0, numel=1_000_000, chunks=1, chunk_numel=None,
                 wire_dtype="fp32", default_chunking=True, algorithm=a, measured_s=t, times_s=[t] * 5,
                 interleaved=True, params=params) for a, t in times.items()]


def test_across_runs_counts_changes_of_the_fastest_and_the_best_fixed_choice() -> None:
    picked = predict_rows(_run("flat"))[0]["picked"]
    other = next(a for a in ("flat", "hier", "torus2d") if a != picked)
    report = format_across([_run(picked), _run(other), _run(picked)])
    assert f"fastest {{'{picked}': 2, '{other}': 1}}" in report
    assert report.splitlines()[-1] == (
        "3 runs, 1 cases: the measured fastest changed between runs in 1; (case, run) pairs right: "
        "best fixed choice per case 2/3, planner 2/3")
    steady = format_across([_run(other)] * 2)
    assert steady.endswith("changed between runs in 0; (case, run) pairs right: best fixed choice per case 2/2, planner 0/2")

