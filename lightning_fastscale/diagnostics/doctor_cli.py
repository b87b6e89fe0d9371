"""``fastscale-doctor``: why is this training job slow, and which setting fixes it (measured).

Takes the same Hydra config and overrides as ``fastscale-train`` (``conf/doctor.yaml`` is
``conf/train.yaml`` plus a ``doctor`` block) and runs under the same launchers: Lightning's own
(``trainer.devices=N``), ``torchrun``, SLURM. It builds the job with
`lightning_fastscale.train.build` and fits it for a few steps with
[`DoctorProbe`][lightning_fastscale.diagnostics.doctor_probe.DoctorProbe], which measures on every rank; the verdict and the fixes come
from [`doctor`][lightning_fastscale.diagnostics.doctor]. ``--verify`` then fits a few steps with each proposed fix and with the
baseline, interleaved, in the same processes (the process group stays up between fits).

``--verify`` and ``--json`` are sugar for the overrides ``doctor.verify=true`` and
``doctor.json=true``: they are rewritten before Hydra parses the command line, so Lightning's
launcher, which re-runs the command line once per extra rank, hands them on.
"""
from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_fastscale.config_check import ConfigError, check_group_names, config_names
from lightning_fastscale.diagnostics.doctor import WINDOWS, Diagnosis, diagnosis_of, verify_fixes
from lightning_fastscale.diagnostics.doctor_probe import DoctorProbe
from lightning_fastscale.diagnostics.doctor_report import dumps, plot_report, render_report
from lightning_fastscale.diagnostics.step_breakdown_callback import StepBreakdown
from lightning_fastscale.train import build

log = logging.getLogger(__name__)

__all__ = ["check_settings", "main", "merge_overrides", "run_doctor"]

FLAGS = {"--verify": "doctor.verify=true", "--json": "doctor.json=true"}

# Callbacks that write checkpoints (the doctor measures, it leaves nothing to resume from), and
# the configured step breakdown (the doctor adds its own, with its warm-up and report folder).
_REPLACED = ("model_checkpoint", "last_checkpoint", "preemption", "step_breakdown")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(base: list[str], fix: list[str], decides: Iterable[str] = ()) -> list[str]:
    """The command line's overrides with a fix's on top.

    A fix's key replaces the same key of ``base``; a fix that switches a config group (e.g.
    ``strategy=hier_ring``) to another option also drops ``base``'s settings inside that group
    (they belong to the old option); ``decides`` names more keys of ``base`` to drop (settings
    the fix leaves at the option's default).

    Examples:
        >>> merge_overrides(["strategy=ddp", "strategy.process_group_backend=gloo", "data.num_workers=0"],
        ...                 ["strategy=hier_ring", "strategy.wire_dtype=bf16"])
        ['data.num_workers=0', 'strategy=hier_ring', 'strategy.wire_dtype=bf16']
        >>> merge_overrides(["strategy=hier_ring", "strategy.algorithm=flat", "strategy.ranks_per_node=1"],
        ...                 ["strategy=hier_ring", "strategy.wire_dtype=bf16"], decides=["strategy.algorithm"])
        ['strategy.ranks_per_node=1', 'strategy=hier_ring', 'strategy.wire_dtype=bf16']
    """
    fix_keys = {_key(o) for o in fix} | set(decides)
    base_values = {_key(o): o.split("=", 1)[-1] for o in base}
    switched = {k for k in fix_keys if "." not in k and any(_key(o) == k and o.split("=", 1)[-1] != base_values.get(k)
                                                             for o in fix)}
    kept = [o for o in base if _key(o) not in fix_keys and _key(o).split(".")[0] not in switched]
    return kept + list(fix)


def _for_measuring(cfg: DictConfig, warmup: int, steps: int) -> DictConfig:
    """``cfg`` set up for a short measured fit: no validation, checkpoints, logger or progress bar."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(cfg):
        cfg.trainer.max_steps = warmup + steps
        cfg.trainer.max_epochs = -1
        cfg.trainer.limit_val_batches = 0
        cfg.trainer.num_sanity_val_steps = 0
        cfg.trainer.enable_checkpointing = False
        cfg.trainer.enable_progress_bar = False
        cfg.trainer.enable_model_summary = False
        cfg.logger = None
        for name in _REPLACED:
            if cfg.get("callbacks") and name in cfg.callbacks:
                cfg.callbacks[name] = None
    return cfg


def _fit(cfg: DictConfig, probe: DoctorProbe, warmup: int, steps: int, report_dir: Path, plot: bool) -> DoctorProbe:
    """Build the job of ``cfg`` with `build` and fit it with the probe."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, module, trainer = build(cfg)
    # several windows after the warm-up: their spread tells a clear verdict from a close call
    breakdown = StepBreakdown(every_n_steps=max(1, steps // WINDOWS), dirpath=report_dir, warmup_steps=warmup,
                              plot=plot, print_table=False)
    trainer.callbacks.extend([breakdown, probe])
    trainer.fit(module, datamodule=datamodule)
    return probe


def _compose(overrides: list[str]) -> DictConfig:
    """The config of ``overrides``, found where this job's was (with its ``hydra.searchpath``)."""
    hydra_cfg = HydraConfig.get()
    searchpath = [o for o in hydra_cfg.overrides.hydra if _key(o) == "hydra.searchpath"]
    return compose(config_name=hydra_cfg.job.config_name, overrides=searchpath + overrides)


_AT_LEAST = {"warmup_steps": 0, "steps": 1, "compute_steps": 1, "loader_batches": 1, "allreduce_reps": 1,
             "verify_warmup_steps": 0, "verify_steps": 1, "verify_rounds": 1}


def check_settings(opts: Any) -> None:
    """Refuse a ``doctor`` setting that cannot be measured with, naming it (before any fit).

    Examples:
        >>> check_settings({"steps": 0})
        Traceback (most recent call last):
        ...
        ValueError: doctor.steps=0: must be an integer >= 1
    """
    workers = opts.get("max_workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"doctor.max_workers={workers!r}: must be null (the cores per rank) or an integer >= 0")
    for name, low in _AT_LEAST.items():
        value = opts.get(name, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"doctor.{name}={value!r}: must be an integer >= {low}")


def run_doctor(cfg: DictConfig) -> Diagnosis:
    """Measure the configured job, diagnose it and, with ``doctor.verify``, verify each fix."""
    opts = cfg.doctor
    check_settings(opts)
    probe = DoctorProbe(True, opts.compute_steps, opts.loader_batches, opts.allreduce_reps, opts.get("max_workers"))
    _fit(_for_measuring(cfg, opts.warmup_steps, opts.steps), probe, opts.warmup_steps, opts.steps, _run_dir(), True)
    assert probe.measurements is not None
    diagnosis = diagnosis_of(probe.measurements)
    if opts.verify:
        _verify(cfg, diagnosis)
    return diagnosis


def _verify(cfg: DictConfig, diagnosis: Diagnosis) -> None:
    """Fit the baseline and each fix for a few steps, interleaved ``verify_rounds`` times."""
    opts = cfg.doctor
    base_overrides = list(HydraConfig.get().overrides.task)
    fixes = [f for f in diagnosis.fixes if f.overrides]
    configs = [cfg] + [_compose(merge_overrides(base_overrides, f.overrides, f.decides)) for f in fixes]

    def step_s(run_cfg: DictConfig) -> float:
        probe = _fit(_for_measuring(run_cfg, opts.verify_warmup_steps, opts.verify_steps), DoctorProbe(measure=False),
                     opts.verify_warmup_steps, opts.verify_steps, _run_dir() / "verify", False)
        assert probe.measurements is not None
        return probe.measurements.step_s

    verify_fixes(diagnosis, fixes, [functools.partial(step_s, c) for c in configs], opts.verify_rounds)


def _run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def _write(cfg: DictConfig, diagnosis: Diagnosis) -> None:
    out = _run_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "doctor.json").write_text(dumps(diagnosis))
    plot_report(diagnosis, out / "doctor.png")
    report = render_report(diagnosis) + f"\n\nwritten: {out / 'doctor.json'}, {out / 'doctor.png'}"
    if cfg.doctor.json:
        print(report, file=sys.stderr)
        print(dumps(diagnosis), flush=True)
    else:
        print(report, flush=True)


@hydra.main(version_base="1.3", config_path="pkg://lightning_fastscale.conf", config_name="doctor")
def _hydra_main(cfg: DictConfig) -> Any:
    diagnosis = run_doctor(cfg)
    if _is_global_zero():
        _write(cfg, diagnosis)
    return diagnosis.verdict.bottleneck


def _is_global_zero() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def main() -> None:
    """Console entry point: ``fastscale-doctor [--verify] [--json] [group=option ...] [key=value ...]``."""
    sys.argv = [FLAGS.get(arg, arg) for arg in sys.argv]
    try:
        check_group_names(sys.argv[1:], sorted({*config_names("train"), *config_names("doctor")}))
    except ConfigError as error:
        print(f"fastscale-doctor: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    _hydra_main()


if __name__ == "__main__":
    main()
