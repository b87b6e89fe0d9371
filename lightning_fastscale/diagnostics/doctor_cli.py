"""``fastscale-doctor``: why is this training job slow, and which setting fixes it (measured).

Builds the job of ``fastscale-train``'s config with `lightning_fastscale.train.build` and fits it
for a few steps with [`DoctorProbe`][lightning_fastscale.diagnostics.doctor_probe.DoctorProbe];
``--verify`` then fits the baseline and each fix, interleaved, in the same processes. ``--verify``
and ``--json`` are rewritten to overrides before Hydra reads the command line (``docs/doctor.md``).
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
from lightning_fastscale.diagnostics.doctor import Diagnosis, Measurements, diagnosis_of, verify_fixes
from lightning_fastscale.diagnostics.doctor_probe import DoctorProbe, measured_fit
from lightning_fastscale.diagnostics.doctor_report import dumps, plot_report, render_report
from lightning_fastscale.train import build

log = logging.getLogger(__name__)

__all__ = ["check_settings", "main", "merge_overrides", "run_doctor"]

FLAGS = {"--verify": "doctor.verify=true", "--json": "doctor.json=true"}

# Callbacks that write checkpoints (the doctor measures, it leaves nothing to resume from), and
# the configured step breakdown (the doctor adds its own, with its warm-up and report folder).
_REPLACED = ("model_checkpoint", "last_checkpoint", "periodic_checkpoint", "preemption", "step_breakdown")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(base: list[str], fix: list[str], decides: Iterable[str] = ()) -> list[str]:
    """The command line's overrides with a fix's on top.

    A fix's key replaces the same key of ``base``; switching a group to another option drops
    ``base``'s settings inside it; ``decides`` names more keys of ``base`` to drop.

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
    switched = {_key(o) for o in fix if "." not in _key(o) and o.split("=", 1)[-1] != base_values.get(_key(o))}
    kept = [o for o in base if _key(o) not in fix_keys and _key(o).split(".")[0] not in switched]
    return kept + list(fix)


def _fit(cfg: DictConfig, probe: DoctorProbe, warmup: int, steps: int, report_dir: Path, plot: bool) -> Measurements:
    """Build the job of ``cfg`` without validation, checkpoints, logger or progress bar, and fit it with the probe."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(cfg):
        cfg.trainer.update(max_steps=warmup + steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
                           enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        cfg.logger = None
        for name in _REPLACED:
            if cfg.get("callbacks") and name in cfg.callbacks:
                cfg.callbacks[name] = None
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, module, trainer = build(cfg)
    return measured_fit(trainer, module, datamodule, probe, warmup, steps, report_dir, plot)


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
    diagnosis = diagnosis_of(_fit(cfg, probe, opts.warmup_steps, opts.steps, _run_dir(), True))
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
        return _fit(run_cfg, DoctorProbe(measure=False), opts.verify_warmup_steps, opts.verify_steps,
                    _run_dir() / "verify", False).step_s

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
    import torch.distributed as dist

    diagnosis = run_doctor(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write(cfg, diagnosis)
    return diagnosis.verdict.bottleneck


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
