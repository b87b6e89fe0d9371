"""fastscale-doctor: the verdict and fix rules on synthetic measurements, and the probe in a real fit.

The pure core gets numbers with a known answer: each of the four bottlenecks is named, and each
fix's predicted speed-up equals its stated formula. One in-process fit (CPU, one rank) runs the
probe on a loader slowed by a per-sample delay and checks that it measures the loader at more
workers and names ``input``. The command-line runs (Hydra, several ranks, the emulated cluster,
``--verify``) are in ``test_diagnostics_doctor_cli.py``.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lightning_fastscale.diagnostics.doctor import (
    Diagnosis,
    Measurements,
    algorithm_overrides,
    compressed_wire_bound,
    diagnosis_of,
    large_batch_bound,
    smaller_images_bound,
)
from lightning_fastscale.diagnostics.doctor_cli import check_settings, merge_overrides
from lightning_fastscale.diagnostics.doctor_probe import (
    DoctorProbe,
    bucket_caps_mb,
    measure_allreduce,
    measure_backward,
    measure_compute,
)
from lightning_fastscale.diagnostics.doctor_report import dumps, plot_report, render_report
from lightning_fastscale.diagnostics.step_breakdown import VERDICTS
from lightning_fastscale.diagnostics.step_breakdown_callback import StepBreakdown
from lightning_fastscale.module import ImageClassifier
from lightning_fastscale.planner import CommParams
from tests.distributed import run_distributed
from tests.doctor_helpers import InjectedDataModule


def _parts(input=0.0, compute=0.0, communication=0.0, optimizer=0.0, rest=0.0) -> dict[str, float]:
    return dict(input=input, compute=compute, communication=communication, optimizer=optimizer, rest=rest)


def test_input_bound_step_gets_more_workers_with_the_overlap_formula():
    m = Measurements(parts=[_parts(input=0.3, compute=0.1, optimizer=0.02)], batch_size=32,
                     loader_images_per_s={0: 100.0, 2: 190.0, 4: 400.0}, num_workers=0)
    d = diagnosis_of(m)
    assert d.verdict.bottleneck == "input"
    fix = d.fixes[0]
    assert fix.overrides == ["data.num_workers=4"]
    # workers prefetch during the step: max(step without input wait, batch / loader rate)
    assert fix.predicted_speedup == pytest.approx(0.42 / max(0.12, 32 / 400.0))
    slower = Measurements(parts=m.parts, batch_size=32, loader_images_per_s={0: 100.0, 4: 160.0}, num_workers=0)
    assert diagnosis_of(slower).fixes[0].predicted_speedup == pytest.approx(0.42 / (32 / 160.0))


def test_streaming_max_side_fix_is_an_estimate_with_its_command():
    m = Measurements(parts=[_parts(input=0.3, compute=0.05)], batch_size=32, loader_images_per_s={4: 100.0},
                     num_workers=4, stored_max_side=512, resolution=224, crop_ratio=0.875)
    fix = next(f for f in diagnosis_of(m).fixes if f.command)
    assert "--max-side 256" in fix.command and "estimate" in fix.basis
    assert fix.predicted_speedup == pytest.approx(0.35 / max(0.05, 32 / (100.0 * (512 / 256) ** 2)))
    # at 0 workers the streaming loader decodes on its background thread: it overlaps the step too
    m.loader_images_per_s, m.num_workers = {0: 100.0}, 0
    fix = next(f for f in diagnosis_of(m).fixes if f.command)
    assert fix.overrides == [] and fix.predicted_speedup == pytest.approx(0.35 / max(0.05, 32 / 400.0))


def test_exposed_communication_gets_the_fastest_measured_allreduce():
    parts = [_parts(compute=0.1, communication=0.4, optimizer=0.01)] * 4
    m = Measurements(parts=parts, batch_size=32, grad_bytes=100 << 20, num_nodes=2, ranks_per_node=2,
                     allreduce_s={"flat/fp32": 0.5, "flat/bf16": 0.3, "hier/fp32": 0.35, "hier/bf16": 0.15,
                                  "torus2d/fp32": 0.6})
    d = diagnosis_of(m)
    assert d.verdict.bottleneck == "communication"
    best = d.fixes[0]
    assert best.overrides == ["strategy=hier_ring", "strategy.wire_dtype=bf16"]
    # a faster all-reduce saves at most the exposed part: step - min(exposed, t_now - t_fix)
    assert best.predicted_speedup == pytest.approx(0.51 / (0.51 - min(0.4, 0.5 - 0.15)))
    assert [f.overrides for f in d.fixes][1:] == [
        ["strategy=hier_ring", "strategy.algorithm=flat", "strategy.wire_dtype=bf16"],
        ["strategy=hier_ring"]]  # torus2d/fp32 is slower than what runs now: not proposed
    assert algorithm_overrides("torus2d/fp16") == ["strategy=hier_torus", "strategy.wire_dtype=fp16"]


# Two one-rank nodes on gloo: every algorithm all-reduces b fp32 bytes with e bytes per element on
# the wire in 2 * ALPHA + b * e / 4 * BETA (one ring step each way, Thakur et al. 2005).
ALPHA, BETA = 1e-3, 1.5e-7
GRADS = [4_000, 200_000, 60_000, 1_000]  # bytes, backward order
BACKWARD = [0.010, 0.010, 0.020, 0.005]  # seconds of backward before each gradient is ready
SCALE = {"fp32": 1.1, "bf16": 1.2}  # measured / modelled all-reduce of the whole gradient


def _model_s(nbytes: float, wire: str) -> float:
    return 2 * ALPHA + nbytes * {"fp32": 4, "bf16": 2}[wire] / 4 * BETA


def _exposed(buckets: list[list[int]], wire: str, scale: float = 1.0) -> float:
    """Communication after backward: each bucket starts when its last gradient is ready and the link is free."""
    finish, ready, i = 0.0, 0.0, 0
    for bucket in buckets:
        ready += sum(BACKWARD[i:i + len(bucket)])
        i += len(bucket)
        finish = max(finish, ready) + scale * _model_s(sum(bucket), wire)
    return finish - sum(BACKWARD)


def _best_buckets(wire: str) -> list[list[int]]:
    """Brute force over every split: the earliest end of communication, then the fewest buckets."""
    splits = [[GRADS[a:b] for a, b in zip((0, *cut), (*cut, len(GRADS)))]
              for k in range(len(GRADS)) for cut in itertools.combinations(range(1, len(GRADS)), k)]
    return min(splits, key=lambda s: (round(_exposed(s, wire), 12), len(s)))


def _overlap_case(caps=(1.0, 25.0), configured="flat/fp32", backward=None) -> Measurements:
    g = sum(GRADS)
    link = CommParams(ALPHA, BETA, ALPHA, BETA, backend="gloo").as_dict()
    return Measurements(
        parts=[_parts(compute=0.05, communication=0.06, optimizer=0.002)] * 2, batch_size=32, grad_bytes=g,
        num_nodes=2, ranks_per_node=1, configured_allreduce=configured, bucket_caps_mb=list(caps),
        allreduce_s={f"{a}/{w}": SCALE[w] * _model_s(g, w) for a in ("flat", "hier", "torus2d") for w in SCALE},
        planner={"predicted_s": {}, "plain_ddp": False, "tolerance": 0.05, "params": link,
                 "calibration_sizes": [g // 4, g]},
        backward_profile={"names": [f"p{i}" for i in range(len(GRADS))], "grad_bytes": GRADS,
                          "backward_s": backward or BACKWARD, "forward_s": 0.02})


def test_overlap_with_backward_is_proposed_with_the_planners_buckets_and_the_formula():
    m = _overlap_case()
    d = diagnosis_of(m)
    assert d.verdict.bottleneck == "communication"
    step, exposed = m.step_s, 0.06
    # now: DDP's default caps (1 MiB first, then 25 MiB) hold the 0.25 MiB gradient in one bucket
    now = _exposed([GRADS], "fp32", SCALE["fp32"])
    assert now == pytest.approx(m.allreduce_s["flat/fp32"])
    overlap = [f for f in d.fixes if f.overrides[0] == "strategy=hier_auto"]
    assert len(overlap) == 2
    for wire in ("bf16", "fp32"):  # fp32: plain DDP's own all-reduce is kept, in the planner's buckets
        buckets = _best_buckets(wire)
        assert len(buckets) > 1
        planned = _exposed(buckets, wire, SCALE[wire])
        fix = next(f for f in overlap if ("strategy.wire_dtype=bf16" in f.overrides) == (wire == "bf16"))
        assert fix.predicted_speedup == pytest.approx(step / (step - min(exposed, now - planned)))
        assert f"{len(buckets)} buckets ({', '.join(f'{sum(b) / 2**20:.3g}' for b in buckets)} MiB)" in fix.reason
    best = d.fixes[0]
    assert best.overrides == ["strategy=hier_auto", "strategy.wire_dtype=bf16", "strategy.planner.calibrate=true",
                              "strategy.planner.measure_backward=true",
                              f"strategy.planner.calibration_sizes=[{sum(GRADS) // 4},{sum(GRADS)}]"]
    # above the same wire in one bucket: step - min(exposed, t_now - t_fix)
    same_layout = next(f for f in d.fixes if f.overrides == algorithm_overrides("flat/bf16"))
    t16 = m.allreduce_s["flat/bf16"]
    assert same_layout.predicted_speedup == pytest.approx(step / (step - min(exposed, now - t16)))
    assert best.predicted_speedup > same_layout.predicted_speedup
    # the overrides compose into the strategy fastscale-train builds, with the planner measuring both
    conf = Path(__file__).resolve().parents[1] / "lightning_fastscale" / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        strategy = instantiate(compose("train", overrides=best.overrides).strategy)
    planner = strategy.planner
    assert (strategy.algorithm, strategy.wire_dtype) == ("auto", "bf16")
    assert planner.calibrate and planner.measure_backward
    assert list(planner.calibration_sizes) == [sum(GRADS) // 4, sum(GRADS)]


def test_no_overlap_fix_where_one_bucket_is_best_or_already_runs():
    # every gradient ready at the end of backward: nothing to overlap, one bucket is the plan
    late = diagnosis_of(_overlap_case(backward=[0.045, 0.0, 0.0, 0.0]))
    assert late.verdict.bottleneck == "communication" and late.fixes  # the 16-bit wire still is
    assert not any(f.overrides[0] == "strategy=hier_auto" for f in late.fixes)
    # the configured run already has the planner's bf16 buckets (strategy=hier_auto): nothing better to propose
    planned = [sum(b) / 2**20 for b in _best_buckets("bf16")]
    already = diagnosis_of(_overlap_case(caps=planned, configured="flat/bf16"))
    assert not any(f.overrides[0] == "strategy=hier_auto" for f in already.fixes)
    # no backward profile (no example_input_array): no prediction
    bare = _overlap_case()
    bare.backward_profile = None
    assert not any(f.overrides[0] == "strategy=hier_auto" for f in diagnosis_of(bare).fixes)


def test_one_slow_rank_is_the_straggler_named_with_its_host():
    fast = _parts(compute=0.1, communication=0.2, optimizer=0.01)
    slow = _parts(input=0.2, compute=0.1, communication=0.0, optimizer=0.01)
    m = Measurements(parts=[fast, fast, slow, fast], batch_size=32, hosts=["a", "a", "b", "b"])
    d = diagnosis_of(m)
    assert (d.verdict.bottleneck, d.verdict.straggler_rank, d.verdict.straggler_host) == ("straggler", 2, "b")
    assert "rank 2 on b" in d.verdict.reason
    assert d.fixes[0].overrides == [] and "rank 2 on b" in d.fixes[0].reason
    assert d.fixes[0].predicted_speedup == pytest.approx(m.step_s / (m.step_s - d.verdict.seconds["straggler"]))


def test_a_straggler_on_the_one_shared_host_is_not_told_to_leave_the_machine_out():
    fast, slow = _parts(compute=0.1, communication=0.2), _parts(input=0.2, compute=0.1)
    one_host = diagnosis_of(Measurements(parts=[fast, slow], batch_size=32, hosts=["a", "a"]))
    assert one_host.verdict.bottleneck == "straggler"
    assert "leave that machine out" not in one_host.fixes[0].reason and "this one machine" in one_host.fixes[0].reason
    two_hosts = diagnosis_of(Measurements(parts=[fast, slow], batch_size=32, hosts=["a", "b"]))
    assert "leave that machine out" in two_hosts.fixes[0].reason


@pytest.mark.parametrize(("times", "planner_plain", "line"), [
    # plain DDP measured fastest, the planner's fit predicted otherwise
    ({"flat/fp32": 0.0020, "flat/bf16": 0.0053}, False,
     "plain DDP (flat/fp32) is within 5% of the best measured (but the planner predicts otherwise: "
     "strategy=hier_auto installs one)"),
    ({"flat/fp32": 0.0020, "flat/bf16": 0.0053}, True,
     "plain DDP (flat/fp32) is within 5% of the best measured (and the planner agrees: strategy=hier_auto installs no hook)"),
    ({"flat/fp32": 0.9294, "hier/bf16": 0.4163}, False,
     "plain DDP (flat/fp32) is not within 5% of the best measured (and the planner agrees: strategy=hier_auto installs one)"),
])
def test_the_plain_ddp_line_agrees_with_the_table_it_sits_under(times, planner_plain, line):
    m = Measurements(parts=[_parts(compute=0.1, communication=0.01)] * 2, batch_size=8, allreduce_s=times,
                     planner={"predicted_s": {}, "plain_ddp": planner_plain, "tolerance": 0.05})
    assert line in [x.strip() for x in render_report(diagnosis_of(m)).splitlines()]


def _scores(input: float, compute: float) -> dict[str, float]:
    return {"input": input, "compute": compute, "communication": 0.0, "straggler": 0.0}


def test_a_margin_inside_the_windows_spread_is_too_close_to_call():
    parts = [_parts(input=0.052, compute=0.050)]
    flips = diagnosis_of(Measurements(parts=parts, batch_size=8,
                                      window_scores=[_scores(0.06, 0.05), _scores(0.04, 0.05), _scores(0.055, 0.05)]))
    assert flips.verdict.too_close_to_call and flips.verdict.reason.startswith(
        "input or compute: too close to call on this machine")
    assert "INPUT OR COMPUTE: TOO CLOSE TO CALL" in render_report(flips)
    assert json.loads(dumps(flips))["too_close_to_call"] is True
    steady = diagnosis_of(Measurements(parts=parts, batch_size=8,
                                       window_scores=[_scores(0.06, 0.05), _scores(0.052, 0.05), _scores(0.055, 0.05)]))
    assert steady.verdict.bottleneck == "input" and not steady.verdict.too_close_to_call


def test_probes_more_than_2x_from_the_run_are_named_as_outside_load():
    # the case: compute alone 64 ms against 522 ms inside the run; loader 922 images/s against ~6,000 implied
    m = Measurements(parts=[_parts(input=0.0053, compute=0.522)], batch_size=32, compute_alone_s=0.064,
                     loader_images_per_s={0: 922.0}, num_workers=0)
    notes = diagnosis_of(m).notes
    assert len(notes) == 2 and all("other processes were loading this machine" in n for n in notes)
    assert "64.0 ms per step against 522.0 ms" in notes[0] and "922 images/s" in notes[1]
    agree = Measurements(parts=[_parts(input=0.0053, compute=0.10)], batch_size=32, compute_alone_s=0.09,
                         loader_images_per_s={0: 5000.0}, num_workers=0)
    assert diagnosis_of(agree).notes == []


def test_compute_much_faster_on_one_thread_is_named_oversubscribed_cores():
    # the stability benchmark's input-bound job beside a process spinning on one of 2 cores (2 torch
    # threads): 447 ms of compute in the run against 102 ms of input; compute alone 450 ms, 60 ms on 1 thread
    loaded = dict(batch_size=32, compute_alone_s=0.45, compute_alone_one_thread_s=0.06, threads=2)
    d = diagnosis_of(Measurements(parts=[_parts(input=0.102, compute=0.447)], **loaded))
    assert d.verdict.too_close_to_call and "the cores are oversubscribed" in d.verdict.reason
    assert "at that rate compute would take 0.0596 s" in d.verdict.reason
    assert any(n.startswith("compute alone ran 7.5x faster on 1 thread (60.0 ms) than on the run's 2") for n in d.notes)
    # compute-bound even at the one-thread rate (59.6 ms against 20 ms of input): named compute, with the note
    busy = diagnosis_of(Measurements(parts=[_parts(input=0.02, compute=0.447)], **loaded))
    assert busy.verdict.bottleneck == "compute" and not busy.verdict.too_close_to_call and len(busy.notes) == 1
    # on free cores one thread is slower than two: no contention
    quiet = diagnosis_of(Measurements(parts=[_parts(input=0.102, compute=0.039)], batch_size=32, compute_alone_s=0.031,
                                      compute_alone_one_thread_s=0.05, threads=2))
    assert quiet.verdict.bottleneck == "input" and not quiet.verdict.too_close_to_call and quiet.notes == []


def test_larger_batches_are_bounded_by_step_over_input_and_compute_and_said_not_to_pay_without_comm():
    # the time-to-accuracy benchmark's plain arm, record regime (ms/step): 2 ranks over a slow link
    slow_link = Measurements(parts=[_parts(input=0.7e-3, compute=32.3e-3, communication=76.5e-3, optimizer=1.0e-3)],
                             batch_size=32)
    assert large_batch_bound(slow_link) == pytest.approx(110.5 / 33.0)
    # ... and on one machine, where plain DDP's all-reduce is 0.10x its compute
    one_machine = Measurements(parts=[_parts(input=0.5e-3, compute=25.2e-3, communication=2.7e-3, optimizer=0.6e-3)],
                               batch_size=32)
    assert large_batch_bound(one_machine) == pytest.approx(29.0 / 25.7)
    assert "do not pay here" in render_report(diagnosis_of(one_machine))
    report = render_report(diagnosis_of(slow_link))
    assert "at most 3.35x faster per sample" in report and "do not pay" not in report
    assert diagnosis_of(slow_link).to_json()["large_batch_bound"] == pytest.approx(110.5 / 33.0)


def test_a_compressed_wire_is_bounded_by_the_step_without_its_exposed_communication():
    # the time-to-accuracy benchmark's plain arm (ms/step), record and cloud regimes, and one machine
    record = Measurements(parts=[_parts(input=0.7e-3, compute=49.3e-3, communication=124.9e-3, optimizer=1.4e-3)],
                          batch_size=32)
    cloud = Measurements(parts=[_parts(input=0.7e-3, compute=45.6e-3, communication=21.2e-3, optimizer=1.2e-3)],
                         batch_size=32)
    one_machine = Measurements(parts=[_parts(input=0.5e-3, compute=25.2e-3, communication=2.7e-3, optimizer=0.6e-3)],
                               batch_size=32)
    assert compressed_wire_bound(record) == pytest.approx(176.3 / 51.4)
    assert compressed_wire_bound(cloud) == pytest.approx(68.7 / 47.5)
    assert compressed_wire_bound(one_machine) == pytest.approx(29.0 / 26.3)
    report = render_report(diagnosis_of(record))
    assert "strategy=hier_powersgd, torch's PowerSGD) is at most 3.43x faster per step" in report
    assert "it pays only if the run needs fewer than that many times the epochs" in report
    assert "it does not pay here" in render_report(diagnosis_of(one_machine))
    assert diagnosis_of(cloud).to_json()["compressed_wire_bound"] == pytest.approx(68.7 / 47.5)


def test_smaller_images_are_bounded_by_the_pixels_composers_schedule_keeps():
    from lightning_fastscale.callbacks.progressive_resizing import composer_schedule, value_at_epoch

    def pixel_share(epochs: int, side: int, initial_scale: float) -> float:  # the callback's own schedule, epoch by epoch
        schedule = composer_schedule(epochs, side, initial_scale)
        return sum((value_at_epoch(schedule, e) / side) ** 2 for e in range(epochs)) / epochs

    compute_only = Measurements(parts=[_parts(compute=1.0)], batch_size=32)
    for scale in (0.5, 2 / 3):  # a long run's schedule keeps the share the bound's formula gives
        share = 1 / smaller_images_bound(compute_only, initial_scale=scale)
        assert share == pytest.approx(pixel_share(90, 224, scale), abs=0.01)
    # the time-to-accuracy benchmark's plain arm over the cloud link: the bound at the arm's 2/3
    # covers the compute the arm measured saved (its 8 epochs at 16, 16, 20, 20, 20, 24, 24, 24 px)
    summary = {(r["machine"], r["arm"]): r for r in json.loads(
        (Path(__file__).resolve().parents[1] / "benchmarks/results/time_to_accuracy_resizing_summary.json").read_text())}
    plain, resized = summary[("cloud", "plain")]["step_phases_s"], summary[("cloud", "fp16_wire_resizing")]["step_phases_s"]
    cloud = Measurements(parts=[plain], batch_size=32)
    step = sum(plain.values())
    bound_saved = step - step / smaller_images_bound(cloud, initial_scale=2 / 3)
    assert plain["compute"] - resized["compute"] <= bound_saved <= 1.1 * (plain["compute"] - resized["compute"])
    # the report: over the cloud link it may pay; over the record link, where the step is communication, it does not
    record = Measurements(parts=[_parts(input=0.7e-3, compute=49.3e-3, communication=124.9e-3, optimizer=1.4e-3)],
                          batch_size=32)
    report = render_report(diagnosis_of(cloud))
    assert f"smaller images: training the early epochs on smaller images (ProgressiveResizing, Composer's schedule from " \
           f"half size) is at most {smaller_images_bound(cloud):.2f}x faster per step" in report
    assert "so it pays only if the run needs fewer than that many times the epochs" in report.split("smaller images:")[1]
    assert smaller_images_bound(record) < 1.2 and "it does not pay here" in render_report(diagnosis_of(record)).split(
        "smaller images:")[1]
    assert diagnosis_of(cloud).to_json()["smaller_images_bound"] == pytest.approx(smaller_images_bound(cloud))


def test_compute_bound_step_takes_only_variants_measured_faster():
    m = Measurements(parts=[_parts(input=0.01, compute=0.5, optimizer=0.05)], batch_size=64, compute_alone_s=0.55,
                     compute_variants={"precision=bf16_mixed model.channels_last=true": 0.25})
    d = diagnosis_of(m)
    assert d.verdict.bottleneck == "compute"
    assert d.fixes[0].overrides == ["precision=bf16_mixed", "model.channels_last=true"]
    assert d.fixes[0].predicted_speedup == pytest.approx(0.56 / (0.56 - 0.30))
    m.compute_variants = {"precision=bf16_mixed model.channels_last=true": 0.7}  # slower on this device
    assert diagnosis_of(m).fixes == []


def test_every_bottleneck_is_reachable_and_report_json_and_png_carry_it(tmp_path):
    m = Measurements(parts=[_parts(compute=0.1, communication=0.4)] * 2, batch_size=8, hosts=["h0", "h1"],
                     allreduce_s={"flat/fp32": 0.5, "flat/bf16": 0.25}, grad_bytes=1 << 20,
                     loader_images_per_s={0: 1000.0}, compute_alone_s=0.1)
    d = diagnosis_of(m)
    d.fixes[0].measured_speedup, d.fixes[0].verified_step_s = 1.4, 0.36
    doc = json.loads(dumps(d))
    assert doc["bottleneck"] in VERDICTS and doc["bottleneck"] == "communication"
    assert set(doc["breakdown"]) == {"input", "compute", "communication", "optimizer", "rest"}
    assert doc["fixes"][0]["overrides"] == ["strategy=hier_ring", "strategy.algorithm=flat", "strategy.wire_dtype=bf16"]
    assert doc["fixes"][0]["measured_speedup"] == 1.4 and doc["fixes"][0]["predicted_speedup"] > 1
    assert Measurements.from_dict(doc["measurements"]).loader_images_per_s == {0: 1000.0}
    text = render_report(d)
    assert "bottleneck: COMMUNICATION" in text and "measured 1.40x" in text
    png = plot_report(d, tmp_path / "doctor.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no step was measured"):
        diagnosis_of(Measurements(parts=[], batch_size=1))
    assert isinstance(d, Diagnosis)


def test_fix_overrides_replace_the_command_line_ones():
    base = ["strategy=hier_ring", "strategy.ranks_per_node=1", "data.num_workers=0", "+trainer.limit_train_batches=9"]
    # the same strategy option: the command line's settings inside it stay
    assert merge_overrides(base, ["strategy=hier_ring", "strategy.wire_dtype=bf16"]) == [
        "strategy.ranks_per_node=1", "data.num_workers=0", "+trainer.limit_train_batches=9",
        "strategy=hier_ring", "strategy.wire_dtype=bf16"]
    # another option of the group: its old settings go
    merged = merge_overrides(base, ["strategy=ddp"])
    assert merged == ["data.num_workers=0", "+trainer.limit_train_batches=9", "strategy=ddp"]
    assert merge_overrides(base, ["data.num_workers=2"])[-2:] == ["+trainer.limit_train_batches=9", "data.num_workers=2"]
    # an all-reduce fix was measured with its own algorithm and wire: the command line's go
    fix = diagnosis_of(Measurements(parts=[_parts(compute=0.1, communication=0.4)] * 2, batch_size=8,
                                allreduce_s={"flat/fp32": 0.5, "hier/fp32": 0.2})).fixes[0]
    assert fix.overrides == ["strategy=hier_ring"]
    assert merge_overrides(["strategy=hier_ring", "strategy.algorithm=flat", "strategy.wire_dtype=bf16",
                            "strategy.ranks_per_node=1"], fix.overrides, fix.decides) == [
        "strategy.ranks_per_node=1", "strategy=hier_ring"]


def test_settings_that_cannot_measure_are_refused_by_name():
    check_settings({"warmup_steps": 0, "steps": 20})
    for name, value in (("steps", 0), ("verify_rounds", -1), ("warmup_steps", 1.5), ("loader_batches", True),
                        ("max_workers", -1)):
        with pytest.raises(ValueError, match=f"doctor.{name}="):
            check_settings({name: value})


def test_probe_in_a_fit_measures_a_slow_loader_and_names_input(tmp_path):
    pl.seed_everything(0, verbose=False)
    dm = InjectedDataModule(batch_size=16, resolution=8, train_size=256, sample_delay_s=0.003)
    module = ImageClassifier("linear", num_classes=10, model_kwargs={"resolution": 8})
    probe = DoctorProbe(compute_steps=2, loader_batches=3)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, limit_val_batches=0,
                         default_root_dir=tmp_path,
                         callbacks=[StepBreakdown(every_n_steps=6, warmup_steps=2, dirpath=tmp_path, plot=False,
                                                  print_table=False), probe])
    trainer.fit(module, datamodule=dm)
    m = probe.measurements
    assert m is not None and m.world_size == 1 and m.batch_size == 16 and m.num_workers == 0
    assert set(m.loader_images_per_s) >= {0, 1}  # the configured count and at least one more
    # 16 samples x 3 ms of sleep: at most ~330 images/s at 0 workers
    assert m.loader_images_per_s[0] < 16 / (16 * 0.003) * 1.05
    assert m.compute_alone_s is not None and m.compute_alone_s > 0
    assert m.grad_bytes == 4 * sum(p.numel() for p in module.parameters())
    d = diagnosis_of(m)
    assert d.verdict.bottleneck == "input", render_report(d)
    assert dm.num_workers == 0  # the probe restores the configured worker count
    # the GPU variant's code path (bf16 autocast, channels-last copy) on this CPU; the real weights stay
    before = {k: v.clone() for k, v in module.state_dict().items()}
    batch = next(iter(dm.train_dataloader()))
    assert measure_compute(trainer, module, batch, 1, channels_last=True, precision="bf16-mixed") > 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert not module.channels_last
    # what the fusion fix needs: each gradient's backward on example_input_array (set from the datamodule)
    profile = measure_backward(module)
    assert profile is not None and sum(profile["grad_bytes"]) == m.grad_bytes
    assert sorted(profile["names"]) == sorted(n for n, _ in module.named_parameters())
    assert all(t >= 0 for t in profile["backward_s"]) and sum(profile["backward_s"]) > 0
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert bucket_caps_mb(trainer.strategy) == []  # one device: no DDP, no buckets


def _allreduce_two_nodes(rank: int, world_size: int) -> tuple:
    return measure_allreduce(1 << 18, num_nodes=2, ranks_per_node=1, device=torch.device("cpu"), reps=1)


@pytest.mark.slow
def test_allreduce_probe_times_every_algorithm_and_wire_with_the_planners_view():
    # two processes as two one-rank "nodes": hier and torus2d have an inter-node stage to run
    results = run_distributed(_allreduce_two_nodes, 2)
    (measured, planner), other = results
    assert other == results[0] or other[0].keys() == measured.keys()
    assert set(measured) == {f"{a}/{w}" for a in ("flat", "hier", "torus2d") for w in ("fp32", "bf16")}
    assert all(t > 0 for t in measured.values())
    if planner is not None:  # the link fit can fail on a machine too loaded for timings to grow with size
        assert set(measured) <= set(planner["predicted_s"]) and isinstance(planner["plain_ddp"], bool)
        # what the fusion fix plans on: the fitted link, plain DDP's all-reduce timed at both sizes
        assert planner["calibration_sizes"] == [1 << 18, 1 << 20]
        assert planner["params"]["flat_measured"]["sizes_bytes"] == [1 << 18, 1 << 20]
