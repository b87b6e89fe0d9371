"""The paired (round-by-round) verdict of benchmarks/planner_validation.py on known repetitions."""
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "planner_validation.py"
_spec = importlib.util.spec_from_file_location("planner_validation", _PATH)
planner_validation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(planner_validation)
paired_stats = planner_validation.paired_stats


def test_miss_is_beyond_noise_only_if_the_fastest_won_every_round() -> None:
    # Round i of every algorithm was taken together. hier has the lowest median but torus2d
    # (picked) beats it in round 2: a miss within noise.
    reps = {"ring": [3.0, 3.0, 3.0], "hier": [1.0, 1.0, 1.2], "torus2d": [1.1, 1.1, 1.1]}
    stats = paired_stats(reps, picked="torus2d", fastest="hier")
    assert stats["round_wins"] == {"ring": 0, "hier": 2, "torus2d": 1}
    assert stats["rounds"] == 3
    assert stats["picked_vs_round_best"] == pytest.approx(1.1)  # median of 1.1, 1.1, 1.0
    assert stats["miss_beyond_noise"] is False
    # hier faster in every round: beyond noise.
    reps["hier"][2] = 1.05
    assert paired_stats(reps, picked="torus2d", fastest="hier")["miss_beyond_noise"] is True
    # A right pick is never a miss.
    assert paired_stats(reps, picked="hier", fastest="hier")["miss_beyond_noise"] is False
