"""The doctor's measurements, taken inside Lightning's fit by a callback so every rank takes part.

[`DoctorProbe`][lightning_fastscale.diagnostics.doctor_probe.DoctorProbe] measures, at the start of
fit on every rank, the all-reduce at the gradient's size by each algorithm, the loader at more
workers and compute alone; the short real run's steps are then split by the step breakdown, and
every rank's numbers all-gathered. What each probe does: ``docs/doctor.md``. `diagnose` runs it
on a user's own Trainer.
"""
from __future__ import annotations

import functools
import logging
import socket
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from lightning_fastscale.data.worker_autotune import cores_per_rank, images_per_second
from lightning_fastscale.diagnostics.doctor import FLAT, WINDOWS, Diagnosis, Measurements, diagnosis_of, verify_fixes
from lightning_fastscale.diagnostics.step_breakdown_callback import StepBreakdown
from lightning_fastscale.lightning_internals import copy_without_trainer, transfer_batch
from lightning_fastscale.planner.profile import measure_backward_profile
from lightning_fastscale.strategies.options import MB

log = logging.getLogger(__name__)

__all__ = ["DoctorProbe", "bucket_caps_mb", "diagnose", "measure_allreduce", "measure_backward", "measure_compute",
           "measure_loader", "measured_fit"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_allreduce(
    numel: int, num_nodes: int, ranks_per_node: int, device: torch.device, reps: int = 2,
    wire_dtypes: tuple[str, ...] = ("fp32", "bf16"),
) -> tuple[dict[str, float], dict[str, Any] | None]:
    """Each ``"algorithm/wire"``'s seconds for one all-reduce of ``numel`` fp32 numbers, and the planner's view.

    Collective: the planner's calibration (which times plain DDP's ``flat/fp32``), then the
    strategy's algorithms in each wire dtype. The view
    ([`compare_algorithms`][lightning_fastscale.planner.compare_algorithms]) is ``None`` where the
    link fit failed (timings that do not grow with size, e.g. a tiny gradient).
    """
    from lightning_fastscale.planner.baseline import compare_algorithms
    from lightning_fastscale.planner.calibrate import _on_cuda, _time, calibrate_process_groups, measure_flat_allreduce
    from lightning_fastscale.strategies.allreduce import ALLREDUCE_FUNCTIONS
    from lightning_fastscale.strategies.options import DEFAULT_PIPELINE_CHUNK_MB, chunk_numel_for
    from lightning_fastscale.strategies.topology import Topology, build_process_groups

    topology, nbytes = Topology(num_nodes, ranks_per_node), 4 * numel
    sizes = [max(nbytes // 4, 4096), nbytes]
    groups = build_process_groups(topology)
    try:
        try:
            # plain DDP's all-reduce at both sizes too: its latency prices the fusion planner's small buckets
            calibration = calibrate_process_groups(groups, sizes=sizes, reps=reps, flat_sizes=sizes)
        except ValueError as err:
            log.warning("link calibration failed (%s); plain DDP's all-reduce is timed alone", err)
            calibration = None
            flat = measure_flat_allreduce(None, nbytes, topology, reps)
        else:
            flat = calibration.params.flat_measured
        results = {FLAT: flat.seconds[-1]}
        tensor = torch.ones(numel, device=device)
        chunk = chunk_numel_for(DEFAULT_PIPELINE_CHUNK_MB, num_nodes)
        # On one node every algorithm is the flat all-reduce: only that one is timed.
        algorithms = {name: fn for name, fn in ALLREDUCE_FUNCTIONS.items() if num_nodes > 1 or name == "flat"}
        for name, fn in algorithms.items():
            for wire in wire_dtypes:
                label = f"{name}/{wire}"
                if label == FLAT:
                    continue
                try:
                    results[label] = _time(lambda fn=fn, wire=wire: fn(tensor, groups, wire, chunk_numel=chunk),
                                           None, reps, True, _on_cuda())
                except (RuntimeError, TypeError) as err:  # a backend without that dtype: not an option here
                    log.warning("all-reduce %s not measured: %s", label, err)
    finally:
        groups.destroy()
    if calibration is None:
        return results, None
    view = compare_algorithms(numel, topology, calibration.params, wire_dtypes, measured=dict(results))
    return results, {"predicted_s": {c["label"]: c["predicted_s"] for c in view["candidates"]},
                     "plain_ddp": view["plain_ddp"], "tolerance": view["tolerance"],
                     "params": calibration.params.as_dict(), "calibration_sizes": sizes}


def measure_backward(module: pl.LightningModule) -> dict[str, Any] | None:
    """The seconds each gradient of a copy of ``module`` takes in backward on its ``example_input_array``.

    What ``CostModelPlanner(measure_backward=True)`` times
    ([`measure_backward_profile`][lightning_fastscale.planner.measure_backward_profile]), as plain
    data; ``None`` without an ``example_input_array`` tensor (that planner needs one too).
    """
    example = getattr(module, "example_input_array", None)
    if not isinstance(example, torch.Tensor):
        return None
    clone = copy_without_trainer(module)  # its parameters carry no DDP hooks: nothing is communicated
    clone.train()
    with torch.enable_grad():
        return asdict(measure_backward_profile(clone, example))


def bucket_caps_mb(strategy: Any) -> list[float]:
    """The DDP bucket caps in MiB the strategy forms, gradient-ready order, the last repeating; [] without DDP."""
    kwargs = getattr(strategy, "_ddp_kwargs", None)
    if kwargs is None:
        return []
    if kwargs.get("bucket_cap_mb_list"):
        return [float(c) for c in kwargs["bucket_cap_mb_list"]]
    if kwargs.get("bucket_cap_mb") is not None:
        return [float(kwargs["bucket_cap_mb"])]
    return [dist._DEFAULT_FIRST_BUCKET_BYTES / MB, 25.0]  # DDP's defaults: a smaller first bucket, then 25 MiB


def measure_loader(
    datamodule: Any, worker_counts: list[int], batches: int, batch_size: int, repeats: int = 1,
) -> dict[int, float]:
    """Images/s of ``datamodule.train_dataloader()`` at each worker count, median of ``repeats`` (its ``num_workers`` restored)."""
    rates = {}
    saved = {k: getattr(datamodule, k) for k in ("num_workers", "persistent_workers", "prefetch_factor")
             if hasattr(datamodule, k)}
    try:
        for workers in worker_counts:
            datamodule.num_workers = workers
            if "persistent_workers" in saved:
                datamodule.persistent_workers = False  # the probe's loader must stop its workers
            if "prefetch_factor" in saved:  # DataLoader refuses a prefetch factor without workers
                datamodule.prefetch_factor = (saved["prefetch_factor"] or 2) if workers > 0 else None
            rates[workers] = statistics.median(
                images_per_second(datamodule.train_dataloader(), batches, max(2, workers), batch_size)
                for _ in range(repeats))
    finally:
        for k, v in saved.items():
            setattr(datamodule, k, v)
    return rates


def measure_compute(trainer: pl.Trainer, module: pl.LightningModule, batch: Any, steps: int,
                    channels_last: bool = False, precision: str | None = None) -> float:
    """Seconds per step of forward, backward and optimizer on a copy of ``module`` on ``batch``.

    The copy has no DDP (nothing is communicated) and a new optimizer of the configured class;
    ``precision="bf16-mixed"`` times that autocast instead of the configured precision.
    """
    clone = copy_without_trainer(module)
    if channels_last:
        clone = clone.to(memory_format=torch.channels_last)
        if hasattr(clone, "channels_last"):  # ImageClassifier also converts its batches
            clone.channels_last = True
    optimizer = trainer.optimizers[0]
    clone_opt = type(optimizer)(clone.parameters(), **optimizer.defaults)
    device = module.device
    if precision == "bf16-mixed":
        context: Callable[[], Any] = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    else:
        context = trainer.precision_plugin.forward_context

    def step() -> None:
        with context():
            out = clone.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        loss.backward()
        clone_opt.step()
        clone_opt.zero_grad(set_to_none=True)

    with warnings.catch_warnings(), torch.enable_grad():
        warnings.filterwarnings("ignore", message=".*self.log.*")  # the copy has no Trainer to log to
        clone.train()
        step()
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
    return (time.perf_counter() - start) / steps


class DoctorProbe(Callback):
    """Measures what ``fastscale-doctor`` needs during one short fit; after it `measurements` holds every rank's.

    Needs a [`StepBreakdown`][lightning_fastscale.diagnostics.StepBreakdown] before it among the
    Trainer's callbacks. ``measure=False``: only read the step breakdown (the ``--verify`` runs);
    ``max_workers``: None for the cores per rank; ``repeats``: repeats of compute alone and of the loader
    (medians are used; compute's spread is reported); the rest are the ``doctor.*`` settings of ``docs/doctor.md``.

    Example::

        trainer = pl.Trainer(max_steps=25, callbacks=[StepBreakdown(warmup_steps=5), DoctorProbe()])
        trainer.fit(model, datamodule=dm)
        print(trainer.callbacks[-1].measurements.step_s)
    """

    def __init__(self, measure: bool = True, compute_steps: int = 5, loader_batches: int = 8,
                 allreduce_reps: int = 2, max_workers: int | None = None, repeats: int = 3) -> None:
        self.measure = measure
        self.repeats = repeats
        self.max_workers = max_workers
        self.compute_steps = compute_steps
        self.loader_batches = loader_batches
        self.allreduce_reps = allreduce_reps
        self.measurements: Measurements | None = None
        self._local: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _breakdown_of(trainer) is None:
            raise RuntimeError("DoctorProbe needs a StepBreakdown callback in the Trainer to read the step parts from")
        if not self.measure:
            return
        device = pl_module.device
        local: dict[str, Any] = {"host": socket.gethostname()}
        dm = trainer.datamodule
        grad_numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        local["grad_bytes"] = 4 * grad_numel
        topology = getattr(trainer.strategy, "topology", None)
        nodes = topology.num_nodes if topology is not None else trainer.num_nodes
        ranks_per_node = topology.ranks_per_node if topology is not None else trainer.num_devices
        local["num_nodes"], local["ranks_per_node"] = nodes, ranks_per_node
        local["backend"] = str(dist.get_backend()) if dist.is_initialized() else "none"
        if trainer.world_size > 1:
            local["allreduce_s"], local["planner"] = measure_allreduce(grad_numel, nodes, ranks_per_node, device,
                                                                       self.allreduce_reps)
            local["backward_profile"], local["bucket_caps_mb"] = measure_backward(pl_module), bucket_caps_mb(trainer.strategy)
        algorithm = getattr(trainer.strategy, "resolved_algorithm", None) or "flat"
        local["configured_allreduce"] = f"{algorithm}/{getattr(trainer.strategy, 'wire_dtype', 'fp32')}"
        batch_size = getattr(dm, "train_batch_size", None) or getattr(dm, "batch_size", None)
        if dm is not None and hasattr(dm, "num_workers") and isinstance(dm.num_workers, int) and batch_size:
            configured = dm.num_workers
            cores = self.max_workers if self.max_workers is not None else cores_per_rank(trainer.num_devices)
            counts = sorted({configured} | {w for w in (max(2 * configured, configured + 1), cores) if configured < w <= cores})
            local["loader_images_per_s"] = measure_loader(dm, counts, self.loader_batches, batch_size, self.repeats)
            local["num_workers"] = configured
            batch = next(iter(dm.train_dataloader()))
        else:
            batch = next(iter(trainer.train_dataloader))
        local["batch_size"] = int(batch_size or len(batch[0]))
        local["stored_max_side"] = getattr(getattr(dm, "metadata", None), "max_side", None)
        local["resolution"] = getattr(dm, "train_resolution", None)
        local["crop_ratio"] = float(getattr(dm, "crop_ratio", 0.875))
        batch = transfer_batch(pl_module, batch)
        # in this process, so with the run's own torch threads
        local["threads"] = torch.get_num_threads()
        runs, one_thread = [], []
        for _ in range(self.repeats):  # interleaved, so load that comes and goes meets both alike
            runs.append(measure_compute(trainer, pl_module, batch, self.compute_steps))
            if device.type == "cpu" and local["threads"] > 1:
                torch.set_num_threads(1)
                try:
                    one_thread.append(measure_compute(trainer, pl_module, batch, self.compute_steps))
                finally:
                    torch.set_num_threads(local["threads"])
        local["compute_alone_runs_s"], local["compute_alone_s"] = runs, statistics.median(runs)
        local["compute_alone_one_thread_s"] = statistics.median(one_thread) if one_thread else None
        if device.type == "cuda":
            # what the GPU recipe adds where the job lacks it: bf16 autocast instead of plain fp32
            # (never in place of a precision plugin such as LARS), channels-last memory format
            to_bf16 = type(trainer.precision_plugin) is Precision
            to_nhwc = not getattr(pl_module, "channels_last", True)
            overrides = ["precision=bf16_mixed"] * to_bf16 + ["model.channels_last=true"] * to_nhwc
            if overrides:
                local["compute_variants"] = {" ".join(overrides): measure_compute(
                    trainer, pl_module, batch, self.compute_steps, channels_last=to_nhwc,
                    precision="bf16-mixed" if to_bf16 else None)}
        self._local = local
        if dist.is_initialized():
            dist.barrier()  # the real run starts together on every rank

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        breakdown = _breakdown_of(trainer)
        if breakdown.summary is None:
            raise RuntimeError("the step breakdown timed no step: raise doctor.steps (or +trainer.limit_train_batches)")
        parts = [dict(rank["phases"]) for rank in sorted(breakdown.summary.per_rank, key=lambda r: r["rank"])]
        self._local["window_scores"] = [dict(w.scores) for w in breakdown.windows
                                        if w.first_step is not None and w.first_step >= breakdown.warmup_steps]
        gathered = [self._local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, self._local)
        self.measurements = _combine(gathered, parts)


def _breakdown_of(trainer: pl.Trainer) -> StepBreakdown | None:
    return next((c for c in trainer.callbacks if isinstance(c, StepBreakdown)), None)


_SAME_ON_EVERY_RANK = (
    "batch_size", "grad_bytes", "allreduce_s", "planner", "configured_allreduce", "num_workers", "stored_max_side",
    "resolution", "crop_ratio", "num_nodes", "ranks_per_node", "backend", "window_scores", "threads",
    "backward_profile", "bucket_caps_mb",
)


def _combine(per_rank: list[dict[str, Any]], parts: list[dict[str, float]]) -> Measurements:
    """One `Measurements` from every rank's numbers (the loader: its slowest rank)."""
    first = per_rank[0]
    loader: dict[int, float] = {}
    for rank in per_rank:
        for w, rate in rank.get("loader_images_per_s", {}).items():
            loader[w] = min(loader.get(w, rate), rate)
    slowest = max((r for r in per_rank if r.get("compute_alone_s") is not None), key=lambda r: r["compute_alone_s"],
                  default={})
    combined = {
        "hosts": [r.get("host", "") for r in per_rank],
        "loader_images_per_s": loader,
        "compute_variants": {k: statistics.median(r["compute_variants"][k] for r in per_rank)
                             for k in first.get("compute_variants", {})},
        "compute_alone_s": _median([r.get("compute_alone_s") for r in per_rank]),
        "compute_alone_runs_s": slowest.get("compute_alone_runs_s", []),
        "compute_alone_one_thread_s": _median([r.get("compute_alone_one_thread_s") for r in per_rank]),
    }
    shared = {k: first[k] for k in _SAME_ON_EVERY_RANK if k in first}  # rank zero's; defaults where not measured
    return Measurements(**{"batch_size": 0, "backend": "none", **shared}, parts=parts, **combined)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def diagnose(trainer: pl.Trainer, model: pl.LightningModule, datamodule: pl.LightningDataModule | None = None,
             verify: bool = False, warmup_steps: int = 5, steps: int = 20, verify_rounds: int = 1,
             **probe_args: Any) -> Diagnosis:
    """``fastscale-doctor`` on your own module and Trainer, without Hydra: measure, name the bottleneck, propose fixes.

    Fits ``warmup_steps + steps`` steps (no validation; call it where you would call
    ``trainer.fit``) and returns, on every rank, the
    [`Diagnosis`][lightning_fastscale.diagnostics.doctor.Diagnosis] ``fastscale-doctor`` writes. Use a
    fresh Trainer to train. ``verify=True`` also fits the baseline and each fix that sets attributes
    of ``model`` / ``datamodule``, interleaved ``verify_rounds`` times (``docs/doctor.md``);
    ``probe_args`` go to `DoctorProbe`.

    Example:
        >>> from lightning_fastscale import diagnose
        >>> d = diagnose(pl.Trainer(devices=2), MyModule(), MyDataModule(), verify=True)  # doctest: +SKIP
        >>> d.verdict.bottleneck, d.fixes[0].overrides, d.fixes[0].measured_speedup  # doctest: +SKIP
        ('input', ['data.num_workers=4'], 2.1)
    """
    if warmup_steps < 0 or steps < 1 or verify_rounds < 1:
        raise ValueError(f"diagnose(warmup_steps={warmup_steps}, steps={steps}, verify_rounds={verify_rounds}): "
                         "need warmup_steps >= 0, steps >= 1 and verify_rounds >= 1")
    trainer.limit_val_batches = 0
    trainer.num_sanity_val_steps = 0
    trainer.fit_loop.max_epochs = -1
    diagnosis = diagnosis_of(measured_fit(trainer, model, datamodule, DoctorProbe(**probe_args), warmup_steps, steps))
    if verify:
        targets = {"model": model, "data": datamodule}
        candidates = [(f, _attributes(f.overrides, targets)) for f in diagnosis.fixes if f.overrides]
        applied = [(f, setting) for f, setting in candidates if setting is not None]
        diagnosis.notes += [f"not verified: {' '.join(f.overrides)} changes the Trainer; measure it with "
                            "fastscale-doctor --verify (docs/doctor.md)" for f, setting in candidates if setting is None]

        def step_s(setting: dict[tuple[str, str], Any]) -> float:
            saved = _set(setting, targets)
            try:
                return measured_fit(trainer, model, datamodule, DoctorProbe(measure=False), warmup_steps, steps).step_s
            finally:
                _set(saved, targets)

        runs = [functools.partial(step_s, setting) for setting in [{}, *(s for _, s in applied)]]
        verify_fixes(diagnosis, [f for f, _ in applied], runs, verify_rounds)
    return diagnosis


def measured_fit(trainer: pl.Trainer, model: pl.LightningModule, datamodule: pl.LightningDataModule | None,
                 probe: DoctorProbe, warmup_steps: int, steps: int, dirpath: Path | None = None,
                 plot: bool = False) -> Measurements:
    """Fit ``warmup_steps + steps`` more steps with a step breakdown and ``probe`` added for the fit."""
    # several windows after the warm-up: their spread tells a clear verdict from a close call
    added = [StepBreakdown(every_n_steps=max(1, steps // WINDOWS), dirpath=dirpath, warmup_steps=warmup_steps,
                           plot=plot, print_table=False), probe]
    trainer.callbacks.extend(added)
    trainer.fit_loop.epoch_loop.max_steps = trainer.global_step + warmup_steps + steps
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        for callback in added:
            trainer.callbacks.remove(callback)
    assert probe.measurements is not None
    return probe.measurements


def _attributes(overrides: list[str], targets: dict[str, Any]) -> dict[tuple[str, str], Any] | None:
    """The attributes of the user's objects that ``overrides`` set (``data.num_workers=4``); None if one is not such."""
    setting = {}
    for item in overrides:
        key, _, value = item.partition("=")
        group, _, name = key.partition(".")
        target = targets.get(group)
        if target is None or not name or "." in name or not hasattr(target, name):
            return None
        setting[group, name] = yaml.safe_load(value)
    return setting


def _set(setting: dict[tuple[str, str], Any], targets: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """Set each attribute of ``setting``; returns their values before."""
    saved = {(group, name): getattr(targets[group], name) for group, name in setting}
    for (group, name), value in setting.items():
        setattr(targets[group], name, value)
    return saved
