"""``fastscale-doctor``'s pure core: from measurements to a verdict, fixes and their predicted gains.

The measurements (taken by `doctor_probe`) are plain numbers, so every rule is unit-tested on
synthetic ones. The verdict is the step breakdown's
([`summarize`][lightning_fastscale.diagnostics.step_breakdown.summarize]); each fix is a Hydra
override with a speed-up predicted by a stated rule. The rules: ``docs/doctor.md``.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lightning_fastscale.diagnostics.step_breakdown import PHASES, VERDICTS, BreakdownSummary, RankTotals, summarize
from lightning_fastscale.planner.auto import auto_plan
from lightning_fastscale.planner.baseline import PLAIN_DDP_TOLERANCE
from lightning_fastscale.planner.cost_model import CommParams, Topology
from lightning_fastscale.planner.fusion import ddp_buckets, simulate
from lightning_fastscale.planner.profile import GradientProfile
from lightning_fastscale.planner.scaling import allreduce_cost
from lightning_fastscale.strategies.options import MB, PLAIN_DDP, CommSetting

__all__ = ["Diagnosis", "Fix", "Measurements", "Verdict", "algorithm_overrides", "compressed_wire_bound", "diagnosis_of",
           "large_batch_bound", "propose_fixes", "smaller_images_bound", "verdict_of", "verify_fixes"]

FLAT = "flat/fp32"  # the baseline all-reduce: one over every rank in fp32, what DDP runs


@dataclass
class Measurements:
    """Everything the doctor measured, as plain numbers (seconds, images/s, bytes); each field in ``docs/doctor.md``.

    Examples:
        >>> m = Measurements(parts=[dict(input=0.01, compute=0.1, communication=0.0, optimizer=0.01, rest=0.0)],
        ...                  batch_size=32)
        >>> round(m.step_s, 3)
        0.12
    """

    parts: list[dict[str, float]]
    batch_size: int
    hosts: list[str] = field(default_factory=list)
    grad_bytes: int = 0
    allreduce_s: dict[str, float] = field(default_factory=dict)
    configured_allreduce: str = FLAT
    planner: dict[str, Any] | None = None
    compute_alone_s: float | None = None
    loader_images_per_s: dict[int, float] = field(default_factory=dict)
    num_workers: int = 0
    stored_max_side: int | None = None
    resolution: int | None = None
    crop_ratio: float = 0.875
    compute_variants: dict[str, float] = field(default_factory=dict)
    num_nodes: int = 1
    ranks_per_node: int = 1
    backend: str = "gloo"
    compute_alone_runs_s: list[float] = field(default_factory=list)
    window_scores: list[dict[str, float]] = field(default_factory=list)
    threads: int | None = None
    compute_alone_one_thread_s: float | None = None
    backward_profile: dict[str, list] | None = None
    bucket_caps_mb: list[float] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """Number of ranks measured."""
        return len(self.parts)

    def breakdown(self) -> BreakdownSummary:
        """The step breakdown's summary of `parts` (median, slowest rank, scores, verdict)."""
        return summarize([RankTotals(rank, 1, dict(parts)) for rank, parts in enumerate(self.parts)])

    def rank_step_s(self, rank: int) -> float:
        """Seconds per step of ``rank``: the sum of its parts."""
        return sum(self.parts[rank].get(p, 0.0) for p in PHASES)

    @property
    def step_s(self) -> float:
        """Median over ranks of the step time."""
        return self.breakdown().step_s

    def median_part(self, part: str) -> float:
        """Median over ranks of one part's seconds per step."""
        return self.breakdown().phases[part]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurements:
        """Inverse of `dataclasses.asdict` (JSON turns the worker-count keys into strings)."""
        data = dict(data)
        data["loader_images_per_s"] = {int(k): float(v) for k, v in data.get("loader_images_per_s", {}).items()}
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class Verdict:
    """The bottleneck, the seconds per step each candidate cause accounts for, and a one-line reason."""

    bottleneck: str
    seconds: dict[str, float]
    reason: str
    straggler_rank: int | None = None
    straggler_host: str | None = None
    too_close_to_call: bool = False


@dataclass
class Fix:
    """One proposed change: Hydra overrides (or a command), why, and its predicted speed-up.

    ``basis``: the measurements behind the prediction; ``measured_speedup``: filled by ``--verify``;
    ``decides``: settings the fix leaves at their default, whose command-line values it drops.
    """

    overrides: list[str]
    reason: str
    predicted_speedup: float
    basis: str
    command: str | None = None
    decides: list[str] = field(default_factory=list)
    measured_speedup: float | None = None
    verified_step_s: float | None = None


@dataclass
class Diagnosis:
    """Measurements, verdict and fixes: what ``doctor.json`` holds."""

    measurements: Measurements
    verdict: Verdict
    fixes: list[Fix]
    baseline_step_s: float | None = None
    verify_rounds: int = 0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The JSON document: ``bottleneck``, ``breakdown`` (seconds per step per part), ``fixes``, and the rest."""
        m = self.measurements
        summary = m.breakdown()
        return {
            "bottleneck": self.verdict.bottleneck,
            "too_close_to_call": self.verdict.too_close_to_call,
            "reason": self.verdict.reason,
            "notes": self.notes,
            "seconds_per_cause": self.verdict.seconds,
            "straggler_rank": self.verdict.straggler_rank,
            "straggler_host": self.verdict.straggler_host,
            "step_s": m.step_s,
            "breakdown": dict(summary.phases),
            "breakdown_per_rank": m.parts,
            "slowest_rank": summary.slowest_rank,
            "straggler_share": summary.straggler_share,
            "fixes": [asdict(f) for f in self.fixes],
            "baseline_step_s": self.baseline_step_s,
            "verify_rounds": self.verify_rounds,
            "large_batch_bound": large_batch_bound(m),
            "compressed_wire_bound": compressed_wire_bound(m),
            "smaller_images_bound": smaller_images_bound(m),
            "measurements": asdict(m),
        }


def verdict_of(m: Measurements) -> Verdict:
    """The bottleneck of the measured steps (the step breakdown's verdict), with its numbers and a reason."""
    if not m.parts:
        raise ValueError("no step was measured: the doctor needs at least one timed step per rank")
    summary = m.breakdown()
    seconds, bottleneck, step = dict(summary.scores), summary.bottleneck, summary.step_s
    share = seconds[bottleneck] / step if step > 0 else 0.0
    if bottleneck == "straggler":
        slow = summary.slowest_rank
        host = m.hosts[slow] if slow < len(m.hosts) else None
        busy = summary.per_rank[slow]["busy_s"]
        reason = (f"rank {slow}{f' on {host}' if host else ''} is busy {busy:.4f} s per step, "
                  f"{seconds['straggler']:.4f} s more than the other ranks' median "
                  f"(in {summary.straggler_phase}); they wait for it in every all-reduce")
        return Verdict(bottleneck, seconds, reason, slow, host)
    close, contention = None, _contention(m)
    if bottleneck in ("input", "compute") and _input_or_compute_flips(m):
        close = f"which is larger changes between the {len(m.window_scores)} measured windows"
    elif bottleneck in ("input", "compute") and contention:
        compute_one = seconds["compute"] / contention
        if (seconds["input"] > compute_one) != (bottleneck == "input"):
            close = (f"compute alone ran {contention:.1f}x faster on 1 thread than on the run's {m.threads}, so the "
                     f"cores are oversubscribed, and at that rate compute would take {compute_one:.4f} s")
    if close:
        reason = (f"input or compute: too close to call on this machine (input {seconds['input']:.4f} s, compute "
                  f"{seconds['compute']:.4f} s per step; {close})")
        return Verdict(bottleneck, seconds, reason, too_close_to_call=True)
    reasons = {
        "input": f"waiting for the next batch takes {seconds['input']:.4f} s of the {step:.4f} s step ({share:.0%})",
        "compute": f"forward, backward and optimizer take {seconds['compute']:.4f} s of the {step:.4f} s step ({share:.0%})",
        "communication": (f"communication left exposed after backward takes {seconds['communication']:.4f} s of the "
                          f"{step:.4f} s step ({share:.0%}), not counting waits for a slower rank"),
    }
    return Verdict(bottleneck, seconds, reasons[bottleneck])


def _input_or_compute_flips(m: Measurements) -> bool:
    """Whether the larger of input and compute differs between windows (the margin is inside their spread)."""
    margins = [w["input"] - w["compute"] for w in m.window_scores]
    return len(margins) >= 2 and min(margins) < 0 < max(margins)


def _contention(m: Measurements) -> float | None:
    """How many times faster compute alone ran on one thread than on the run's, where beyond `CONTENTION`."""
    one, many = m.compute_alone_one_thread_s, m.compute_alone_s
    if not one or not many or (m.threads or 1) <= 1 or many / one <= CONTENTION:
        return None
    return many / one


# compute alone this many times faster on one thread than on several: the cores are
# oversubscribed (on free cores more threads are never slower than one by this much)
CONTENTION = 1.5
WINDOWS = 4  # windows of the measured steps, each summarised on its own, for the verdict's spread
DISAGREEMENT = 2.0  # a probe and the run this many times apart: load from other processes


def cross_checks(m: Measurements) -> list[str]:
    """Notes where the probes disagree with the run's own breakdown (outside load, oversubscribed cores).

    Examples:
        >>> m = Measurements(parts=[dict(input=0.0, compute=0.5, communication=0.0, optimizer=0.0, rest=0.0)],
        ...                  batch_size=8, compute_alone_s=0.06)
        >>> cross_checks(m)[0][:60]
        'compute alone measured 60.0 ms per step against 500.0 ms ins'
    """
    notes = []
    in_run = m.median_part("compute") + m.median_part("optimizer")
    if m.compute_alone_s and in_run > 0 and max(in_run / m.compute_alone_s, m.compute_alone_s / in_run) > DISAGREEMENT:
        notes.append(f"compute alone measured {1e3 * m.compute_alone_s:.1f} ms per step against {1e3 * in_run:.1f} ms "
                     f"inside the run: more than {DISAGREEMENT:.0f}x apart, so other processes were loading this "
                     "machine during the measurements; rerun on a quiet machine before acting on the verdict")
    wait = m.median_part("input")
    rate = m.loader_images_per_s.get(m.num_workers)
    if m.num_workers == 0 and rate and wait > 0:
        implied = m.batch_size / wait
        if max(implied / rate, rate / implied) > DISAGREEMENT:
            notes.append(f"the loader probe read {rate:.0f} images/s per rank, the run's input wait implies "
                         f"{implied:.0f}: more than {DISAGREEMENT:.0f}x apart, so other processes were loading this "
                         "machine during the measurements")
    contention = _contention(m)
    if contention:
        notes.append(f"compute alone ran {contention:.1f}x faster on 1 thread ({1e3 * m.compute_alone_one_thread_s:.1f} ms) "
                     f"than on the run's {m.threads} ({1e3 * m.compute_alone_s:.1f} ms): the cores are oversubscribed, by "
                     "other processes or by more threads than free cores; measure on a quiet machine, or give the job "
                     "fewer threads (torch.set_num_threads, OMP_NUM_THREADS)")
    return notes


_STRATEGY_OF = {"flat": "hier_ring", "hier": "hier_ring", "torus2d": "hier_torus"}


def algorithm_overrides(label: str) -> list[str]:
    """Hydra overrides that make the strategy run the all-reduce ``"algorithm/wire"``.

    Examples:
        >>> algorithm_overrides("hier/bf16")
        ['strategy=hier_ring', 'strategy.wire_dtype=bf16']
        >>> algorithm_overrides("flat/fp32")
        ['strategy=ddp']
    """
    algorithm, _, wire = label.partition("/")
    if algorithm == "flat" and wire in ("", "fp32"):
        return ["strategy=ddp"]
    overrides = [f"strategy={_STRATEGY_OF[algorithm]}"]
    if algorithm == "flat":
        overrides.append("strategy.algorithm=flat")
    if wire and wire != "fp32":
        overrides.append(f"strategy.wire_dtype={wire}")
    return overrides


# What an all-reduce fix decides: it was measured with exactly this algorithm, wire and no top-k.
ALLREDUCE_SETTINGS = ["strategy.algorithm", "strategy.wire_dtype", "strategy.compression"]

# A fix must promise at least this much to be worth a run of its own.
MIN_SPEEDUP = 1.05


def _input_fixes(m: Measurements) -> list[Fix]:
    """More loader workers (step = max(step - input wait, batch / loader rate)), and for streaming data a smaller stored side."""
    fixes = []
    step, wait = m.step_s, m.median_part("input")
    rest = step - wait
    more = [w for w in m.loader_images_per_s if w > m.num_workers]
    if more:
        best = max(more, key=lambda w: (m.loader_images_per_s[w], -w))
        predicted = max(rest, m.batch_size / m.loader_images_per_s[best])
        need = m.batch_size / rest if rest > 0 else float("inf")
        fixes.append(Fix(
            [f"data.num_workers={best}"],
            f"{best} workers prefetch during the step at {m.loader_images_per_s[best]:.0f} images/s per rank "
            f"(measured); the rest of the step consumes {need:.0f}",
            step / predicted,
            "loader images/s per rank at each worker count; step without its input wait",
        ))
    if m.stored_max_side and m.resolution and m.loader_images_per_s:
        side = math.ceil(m.resolution / m.crop_ratio)
        if side < m.stored_max_side:
            # JPEG decode dominates the loader and scales with the stored pixels (estimate).
            workers = max(m.loader_images_per_s, key=lambda w: (m.loader_images_per_s[w], -w))
            cheaper = (m.stored_max_side / side) ** 2
            loader_s = m.batch_size / (m.loader_images_per_s[workers] * cheaper)
            # the streaming loader (the one that records a stored side) overlaps the step, in
            # its workers or, with none, on its background thread
            predicted = max(rest, loader_s)
            fixes.append(Fix(
                [f"data.num_workers={workers}"] if workers != m.num_workers else [],
                f"images are stored at {m.stored_max_side} px for {m.resolution} px crops; "
                f"decoding {side} px images is about {cheaper:.1f}x cheaper",
                step / predicted,
                "loader images/s scaled by the stored pixel count (decode-bound estimate, not measured)",
                command=f"fastscale-data convert SOURCE NEW_ROOT --max-side {side}  (then data.root=NEW_ROOT)",
            ))
    return fixes


def _communication_fixes(m: Measurements) -> list[Fix]:
    """Every measured all-reduce faster than the configured one: step - min(exposed, t_configured - t_alternative)."""
    current = m.allreduce_s.get(m.configured_allreduce)
    if current is None:
        return []
    exposed = m.breakdown().scores["communication"]
    step, fixes = m.step_s, []
    for label, t in sorted(m.allreduce_s.items(), key=lambda kv: kv[1]):
        if label == m.configured_allreduce or t >= current:
            continue
        saved = min(exposed, current - t)
        base = m.allreduce_s.get(FLAT)
        vs_flat = f"; {base / t:.2f}x the flat all-reduce DDP runs" if base else ""
        fixes.append(Fix(
            algorithm_overrides(label),
            f"all-reduce of the {m.grad_bytes / 2**20:.1f} MiB gradient: {t:.4f} s by {label} against "
            f"{current:.4f} s by {m.configured_allreduce}{vs_flat}",
            step / (step - saved),
            "all-reduce seconds at the gradient size per algorithm; exposed communication of the step",
            decides=list(ALLREDUCE_SETTINGS),
        ))
    return fixes


def _overlap_fixes(m: Measurements) -> list[Fix]:
    """The fusion planner's buckets per measured wire (Jia et al. 2018): step - min(exposed, E_now - E_plan).

    ``E``: communication left after backward on the measured per-gradient backward times, the
    configured DDP buckets (``E_now``) against those `auto_plan` picks on the calibrated link, each
    bucket priced by the cost model scaled to the all-reduce measured at the gradient size.
    """
    planner, profile = m.planner or {}, m.backward_profile
    link, link_sizes = planner.get("params"), planner.get("calibration_sizes")
    if not (link and link_sizes and profile and m.bucket_caps_mb) or m.configured_allreduce not in m.allreduce_s:
        return []
    params = CommParams.from_dict(link)
    grads = GradientProfile(*(tuple(profile[k]) for k in ("names", "grad_bytes", "backward_s")), profile["forward_s"])
    sizes, backward, topology = grads.grad_bytes, grads.backward_s, Topology(m.num_nodes, m.ranks_per_node)

    def cost(label: str):  # the model's shape over bucket sizes, its scale from the measured all-reduce
        algorithm, wire = label.split("/")
        model = allreduce_cost(algorithm, topology, params, PLAIN_DDP if label == FLAT else CommSetting(wire_dtype=wire))
        scale = m.allreduce_s[label] / float(model(np.array([float(sum(sizes))]))[0])
        return lambda nbytes: scale * model(nbytes)

    now = simulate(ddp_buckets(sizes, [int(c * MB) for c in m.bucket_caps_mb]), sizes, backward,
                   cost(m.configured_allreduce))
    exposed, step, fixes = m.breakdown().scores["communication"], m.step_s, []
    tolerance = planner.get("tolerance", PLAIN_DDP_TOLERANCE)
    for wire in sorted({label.split("/")[1] for label in m.allreduce_s}):
        chosen = auto_plan(grads, topology, params, CommSetting(wire_dtype=wire), plain_ddp_tolerance=tolerance)
        label = FLAT if chosen.plain_ddp else f"{chosen.algorithm}/{wire}"
        if chosen.plan.num_buckets < 2 or label not in m.allreduce_s:
            continue  # one bucket: the all-reduce fixes above already price it
        planned = simulate(chosen.plan.ends, sizes, backward, cost(label))
        if planned.exposed_s >= now.exposed_s:
            continue
        mib = ", ".join(f"{b / MB:.3g}" for b in planned.bucket_bytes)
        fixes.append(Fix(
            ["strategy=hier_auto", *([f"strategy.wire_dtype={wire}"] if wire != "fp32" else []),
             "strategy.planner.calibrate=true", "strategy.planner.measure_backward=true",
             f"strategy.planner.calibration_sizes=[{','.join(str(s) for s in link_sizes)}]"],
            f"the fusion planner's {planned.num_buckets} buckets ({mib} MiB) by {label} overlap the all-reduce with "
            f"backward: {planned.exposed_s:.4f} s left after it, against {now.exposed_s:.4f} s by "
            f"{m.configured_allreduce} in the configured buckets (caps {', '.join(f'{c:g}' for c in m.bucket_caps_mb)} MiB)",
            step / (step - min(exposed, now.exposed_s - planned.exposed_s)),
            "backward time per gradient measured on example_input_array; the fusion planner on the calibrated link, "
            "bucket costs scaled to the all-reduce measured at the gradient size; exposed communication of the step",
            decides=list(ALLREDUCE_SETTINGS),
        ))
    return fixes


def _compute_fixes(m: Measurements) -> list[Fix]:
    """Settings whose compute alone measured faster: predicted step = step - (t_now - t_variant)."""
    if m.compute_alone_s is None:
        return []
    step, fixes = m.step_s, []
    for overrides, t in sorted(m.compute_variants.items(), key=lambda kv: kv[1]):
        if t >= m.compute_alone_s:
            continue
        saved = min(m.compute_alone_s - t, m.median_part("compute") + m.median_part("optimizer"))
        fixes.append(Fix(
            overrides.split(),
            f"forward, backward and optimizer take {t:.4f} s with {overrides} against {m.compute_alone_s:.4f} s now",
            step / (step - saved),
            "compute alone on a device-resident batch with and without the change",
        ))
    return fixes


def _straggler_fixes(m: Measurements, verdict: Verdict) -> list[Fix]:
    """No override makes one machine faster: the fix is to find out why, or leave the machine out."""
    rank = verdict.straggler_rank
    if rank is None:
        return []
    step = m.step_s
    saved = min(verdict.seconds["straggler"], step)
    where = f"rank {rank}" + (f" on {verdict.straggler_host}" if verdict.straggler_host else "")
    if len(set(m.hosts)) > 1:
        advice = "check its load (other jobs, thermal throttling, a slower device or loader) or leave that machine out of the job"
    else:  # every rank shares one machine: leaving it out leaves nothing
        advice = ("every rank runs on this one machine, so check what else loads it (other jobs, a slower "
                  "device, the threads per rank against its cores)")
    return [Fix(
        [],
        f"{where} is the straggler: {advice}",
        step / max(step - saved, 1e-12),
        "busy time of the slowest rank against the others' median",
    )]


def propose_fixes(m: Measurements, verdict: Verdict) -> list[Fix]:
    """The bottleneck's fixes, then the others', each by predicted speed-up, those under `MIN_SPEEDUP` left out.

    A straggler's fix is kept whatever its size, since it names the machine.
    """
    found = {
        "input": _input_fixes(m),
        "communication": _communication_fixes(m) + _overlap_fixes(m),
        "compute": _compute_fixes(m),
        "straggler": _straggler_fixes(m, verdict),
    }

    def ranked(fixes: Iterable[Fix]) -> list[Fix]:
        kept = [f for f in fixes if f.predicted_speedup >= MIN_SPEEDUP or (not f.overrides and f.command is None)]
        return sorted(kept, key=lambda f: -f.predicted_speedup)

    return ranked(found[verdict.bottleneck]) + ranked(f for b in VERDICTS if b != verdict.bottleneck for f in found[b])


def diagnosis_of(m: Measurements) -> Diagnosis:
    """Verdict and fixes of one set of measurements."""
    verdict = verdict_of(m)
    return Diagnosis(m, verdict, propose_fixes(m, verdict), notes=cross_checks(m))


def verify_fixes(diagnosis: Diagnosis, fixes: Sequence[Fix], runs: Sequence[Callable[[], float]], rounds: int) -> None:
    """``--verify``: time the baseline (``runs[0]``) and each fix (``runs[i + 1]``), interleaved ``rounds`` times.

    Interleaving spreads the machine's slow spells over all runs; fills the medians and each
    fix's ``measured_speedup``.

    Examples:
        >>> d = Diagnosis(Measurements(parts=[], batch_size=1), Verdict("input", {}, ""), [Fix(["a=1"], "", 2.0, "")])
        >>> verify_fixes(d, d.fixes, [lambda: 0.2, lambda: 0.1], rounds=2)
        >>> d.fixes[0].measured_speedup, d.verify_rounds
        (2.0, 2)
    """
    times = list(zip(*([run() for run in runs] for _ in range(rounds))))  # per run, its time in each round
    diagnosis.baseline_step_s, diagnosis.verify_rounds = statistics.median(times[0]), rounds
    for fix, measured in zip(fixes, times[1:]):
        fix.verified_step_s = statistics.median(measured)
        fix.measured_speedup = diagnosis.baseline_step_s / fix.verified_step_s


# below this bound neither a larger batch, a compressed wire nor smaller images pay for the epochs they cost
# (MLPerf's ResNet-50 reference points: 1.19x the epochs from a global batch of 3,264 to 8,192;
# PowerSGD's in docs/doctor.md)
PAYS_FROM_BOUND = 1.2


def large_batch_bound(m: Measurements) -> float:
    """The most a larger per-device batch can speed up each sample: ``step / (input + compute)``.

    The extra epochs it costs are not counted (Goyal et al. 2017; MLPerf Training); the derivation
    is in ``docs/doctor.md``.

    Examples:
        >>> m = Measurements(parts=[dict(input=0.01, compute=0.09, communication=0.1, optimizer=0.0, rest=0.0)],
        ...                  batch_size=32)
        >>> round(large_batch_bound(m), 2)
        2.0
    """
    per_sample_floor = m.median_part("input") + m.median_part("compute")
    return m.step_s / per_sample_floor if per_sample_floor > 0 else float("inf")


def _pays_note(change: str, bound: float, per: str, does_not_pay: str, pays_if: str) -> str:
    """A report line on a change whose cost is epochs, which a few steps cannot measure: its bound, then a verdict."""
    return f"{change} is at most {bound:.2f}x faster {per}; {does_not_pay if bound < PAYS_FROM_BOUND else pays_if}"


def large_batch_note(m: Measurements) -> str:
    """The report's line on larger batches: the bound, and whether they can pay here."""
    return _pays_note(
        "a larger per-device batch (experiment=large_batch)", large_batch_bound(m),
        "per sample here (step over input + compute)",
        "they do not pay here: too little of the step is communication and optimizer (no slow link, or few ranks)",
        "they pay only if the run needs fewer than that many times the epochs at the larger batch")


def compressed_wire_bound(m: Measurements) -> float:
    """The most a compressed gradient wire can speed up each step: the step over the step without its exposed communication.

    However few bytes cross (PowerSGD, Vogels et al. 2019), the rest of the step stays; the
    epochs its approximation may cost are not counted (``docs/doctor.md``).

    Examples:
        >>> m = Measurements(parts=[dict(input=0.01, compute=0.09, communication=0.1, optimizer=0.0, rest=0.0)],
        ...                  batch_size=32)
        >>> round(compressed_wire_bound(m), 2)
        2.0
    """
    rest = m.step_s - m.median_part("communication")
    return m.step_s / rest if rest > 0 else float("inf")


def compressed_wire_note(m: Measurements) -> str:
    """The report's line on a compressed inter-node wire (``strategy=hier_powersgd``): the bound, and whether it can pay."""
    return _pays_note(
        "a compressed wire between the nodes (strategy=hier_powersgd, torch's PowerSGD)", compressed_wire_bound(m),
        "per step here (step over the step without its exposed communication)",
        "it does not pay here: too little of the step is communication (no slow link, or few ranks)",
        "it changes the gradients, so it pays only if the run needs fewer than that many times the epochs "
        "to its target (callbacks.time_to_accuracy.target measures it)")


def smaller_images_bound(m: Measurements, initial_scale: float = 0.5, finish_fraction: float = 0.2) -> float:
    """The most progressive resizing can speed up a run's average step: input and compute scaled by the pixels it keeps.

    Composer's schedule (``ProgressiveResizing(full_resolution=...)``; Howard et al. 2018) grows
    the side linearly from ``initial_scale`` over the first ``1 - finish_fraction`` of the run, so
    it averages ``(1 - f)(1 + s + s^2) / 3 + f`` of the full pixels; the epochs its small images
    may cost are not counted (``docs/doctor.md``).

    Examples:
        >>> m = Measurements(parts=[dict(input=0.0, compute=0.09, communication=0.01, optimizer=0.0, rest=0.0)],
        ...                  batch_size=32)
        >>> round(smaller_images_bound(m), 2)  # a third of the compute saved: 0.1 / 0.07
        1.43
    """
    pixel_share = (1 - finish_fraction) * (1 + initial_scale + initial_scale ** 2) / 3 + finish_fraction
    saved = (m.median_part("input") + m.median_part("compute")) * (1 - pixel_share)
    return m.step_s / (m.step_s - saved)


def smaller_images_note(m: Measurements) -> str:
    """The report's line on progressive resizing: the bound, and whether it can pay."""
    return _pays_note(
        "training the early epochs on smaller images (ProgressiveResizing, Composer's schedule from half size)",
        smaller_images_bound(m), "per step over a run here (input and compute scaled by the pixels it keeps)",
        "it does not pay here: too little of the step is input and compute (a slow link: see the wire above)",
        "it changes what the network sees, so it pays only if the run needs fewer than that many times the "
        "epochs to its target (callbacks.time_to_accuracy.target measures it)")


def plain_ddp_within(m: Measurements) -> bool:
    """Whether plain DDP's measured all-reduce is within the tolerance of the fastest measured one.

    Examples:
        >>> m = Measurements(parts=[], batch_size=1, allreduce_s={"flat/fp32": 0.002, "flat/bf16": 0.0053})
        >>> plain_ddp_within(m)
        True
    """
    tolerance = (m.planner or {}).get("tolerance", PLAIN_DDP_TOLERANCE)
    return m.allreduce_s[FLAT] <= (1 + tolerance) * min(m.allreduce_s.values())
