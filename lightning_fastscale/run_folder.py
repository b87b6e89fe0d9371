"""The run folder: the checkpoint a run starts from, its log, its loggers, the last line of a failure.

`resolve_resume` picks the checkpoint; `log_to_run_folder` sends Lightning's records and Python's
warnings to Hydra's ``<job>.log`` too; `end_run` turns an exception into its kind's exit status
(`lightning_fastscale.exit_codes`) and one line on stderr.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from hydra.utils import instantiate
from omegaconf import DictConfig

from lightning_fastscale.config_check import ConfigError
from lightning_fastscale.exit_codes import ExitCode, exit_code_for
from lightning_fastscale.faults import checkpoint_reading
from lightning_fastscale.faults.run_folder_lock import LOCK_NAME

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger("lightning_fastscale.train")

__all__ = ["HYDRA_FILES", "RESUME_MODES", "build_logger", "end_run", "finish_wandb", "log_to_run_folder",
           "remove_run_folder_if_unused", "report", "report_metric_locations", "resolve_resume", "run_in_folder"]

# Lightning's loggers keep their own console handler and do not propagate to the root logger
_LIBRARY_LOGGERS = ("lightning.pytorch", "lightning.fabric")
# what a run writes into its folder before training starts: Hydra's config and the run's claim
HYDRA_FILES = frozenset({".hydra", LOCK_NAME})


def _check_output_dir_is_fresh(cfg: DictConfig) -> None:
    """Refuse to write checkpoints into a folder that already holds some."""
    ckpt_cfg = (cfg.get("callbacks") or {}).get("model_checkpoint")
    if not ckpt_cfg or not ckpt_cfg.get("dirpath"):
        return
    dirpath = Path(ckpt_cfg.dirpath)
    existing = sorted(dirpath.glob("*.ckpt")) if dirpath.is_dir() else []
    if existing:
        raise ConfigError(
            f"{dirpath} already holds checkpoints ({existing[0].name}, ...); refusing to overwrite "
            "them. Use a new hydra.run.dir (the default is a fresh timestamped folder), or resume "
            "with ckpt_path=... which writes into a new run folder, or continue this run with resume=auto.",
            key="hydra.run.dir",
        )


RESUME_MODES = ("never", "auto")


def _checkpoint_folders(cfg: DictConfig) -> list[Path]:
    """The folders the configured checkpoint callbacks write into."""
    callbacks = cfg.get("callbacks") or {}
    nodes = [callbacks.get(name) for name in ("model_checkpoint", "last_checkpoint", "periodic_checkpoint", "preemption")]
    return list(dict.fromkeys(Path(node.dirpath) for node in nodes if node and node.get("dirpath")))


def resolve_resume(cfg: DictConfig) -> str | None:
    """The checkpoint this run starts from, following ``resume`` and ``ckpt_path``.

    ``resume=never`` (default): ``ckpt_path`` or none, refusing a folder that holds checkpoints;
    ``resume=auto``: the newest readable checkpoint of the run's folders (`resume_point`), if any.
    """
    mode = cfg.get("resume", "never")
    if mode not in RESUME_MODES:
        raise ConfigError(f"resume={mode!r} is not one of {RESUME_MODES}; use resume=auto to continue a run in its folder",
                          key="resume")
    if mode == "never":
        _check_output_dir_is_fresh(cfg)
        return cfg.get("ckpt_path")
    if cfg.get("ckpt_path"):
        raise ConfigError(
            f"resume=auto and ckpt_path={cfg.ckpt_path} both given; resume=auto picks the newest "
            "checkpoint of the run folder itself: drop one of them",
            key="ckpt_path",
        )
    return checkpoint_reading.resume_point(_checkpoint_folders(cfg))


def build_logger(cfg: DictConfig) -> Any:
    """The configured logger; W&B goes offline (no network at all) without an API key."""
    node = cfg.get("logger")
    if not node:
        return False
    if "WandbLogger" in str(node.get("_target_", "")):
        online = os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "online"
        if not online:
            os.environ["WANDB_MODE"] = "offline"
        return without_unset_anonymous(instantiate(node, offline=True) if not online else instantiate(node))
    return instantiate(node)


def without_unset_anonymous(logger: Any) -> Any:
    """Drop the ``anonymous=None`` that Lightning's ``WandbLogger`` hands to ``wandb.init``.

    wandb >= 0.19 warns whenever it is passed, even as None; left out it keeps the same default.
    """
    init_kwargs = getattr(logger, "_wandb_init", None)
    if isinstance(init_kwargs, dict) and init_kwargs.get("anonymous", False) is None:
        del init_kwargs["anonymous"]
    return logger


def report(line: str) -> None:
    """A summary line, to the console and the run folder's log (Hydra's handlers), else printed."""
    if logging.getLogger().handlers:
        log.info(line)
    else:
        print(line)


def report_metric_locations(trainer: pl.Trainer) -> None:
    """Name where each logger wrote the run's metrics (rank 0)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            report(f"metrics written to {Path(logger.log_dir) / 'metrics.csv'}")
        elif isinstance(logger, TensorBoardLogger):
            report(f"metrics written to {logger.log_dir} (TensorBoard)")
        elif not isinstance(logger, WandbLogger):  # W&B says where when its run finishes
            report(f"metrics written by {type(logger).__name__} to {logger.save_dir}")


def finish_wandb(trainer: pl.Trainer) -> None:
    """Close the W&B run on rank zero, naming where it was written."""
    from lightning.pytorch.loggers import WandbLogger

    if isinstance(trainer.logger, WandbLogger) and trainer.is_global_zero:
        import wandb

        run = wandb.run
        if run is not None:
            report(f"W&B run written to {Path(run.dir).parent}" + (" (offline)" if run.offline else ""))
        wandb.finish()


def log_to_run_folder() -> list[logging.FileHandler]:
    """Send Lightning's log records and Python warnings to the run folder's log file too; returns its handlers.

    Warnings still print to the console; no handler is found when Hydra's job logging is off.
    """
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.propagate:
            continue
        for handler in files:
            if handler not in logger.handlers:
                logger.addHandler(handler)
    if files and not getattr(warnings.showwarning, "_to_run_folder", False):
        shown = warnings.showwarning

        def show_and_keep(message: Any, category: type[Warning], filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
            shown(message, category, filename, lineno, *args, **kwargs)  # the console, as before
            _log_to_file_only(files, logging.WARNING, f"{category.__name__}: {message} ({filename}:{lineno})")

        show_and_keep._to_run_folder = True  # type: ignore[attr-defined]
        warnings.showwarning = show_and_keep
    return files


def _log_to_file_only(files: list[logging.FileHandler], level: int, message: str, exc_info: Any = None) -> None:
    record = log.makeRecord(log.name, level, __file__, 0, message, (), exc_info)
    for handler in files:
        if handler in logging.getLogger().handlers:  # not one closed with a removed run folder
            handler.handle(record)


def remove_run_folder_if_unused(run_dir: Path, log_files: list[logging.FileHandler], log_was_empty: bool) -> bool:
    """Delete ``run_dir`` when it holds only what Hydra wrote for this very run (a refused run's); True if deleted."""
    if not run_dir.is_dir() or not log_was_empty:
        return False
    log_names = {Path(h.baseFilename).name for h in log_files if Path(h.baseFilename).parent == run_dir}
    if any(entry.name not in HYDRA_FILES | log_names for entry in run_dir.iterdir()):
        return False
    for handler in log_files:  # nothing may log into the removed folder afterwards
        for logger in (logging.getLogger(), *map(logging.getLogger, _LIBRARY_LOGGERS)):
            logger.removeHandler(handler)
        handler.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return not run_dir.exists()


def log_is_empty(files: list[logging.FileHandler]) -> bool:
    """Whether the run folder's log files hold nothing yet (this run has written no line)."""
    return all(os.path.getsize(h.baseFilename) == 0 for h in files if os.path.exists(h.baseFilename))


def end_run(error: BaseException, files: list[logging.FileHandler], log_was_empty: bool, run_dir: Path | None,
            program: str = "fastscale-train") -> NoReturn:
    """Raise ``SystemExit`` for ``error``: its kind's status (a bug: 1, traceback in the log) and one line on stderr.

    A bad setting (exit 2) removes a run folder holding only Hydra's files.
    """
    code = exit_code_for(error)
    message = " ".join(str(error).split()) or type(error).__name__
    _log_to_file_only(files, logging.ERROR, f"{program} failed", exc_info=(type(error), error, error.__traceback__))
    where = ""
    if run_dir is not None and code is ExitCode.BAD_SETTING and remove_run_folder_if_unused(run_dir, files, log_was_empty):
        where = f" (nothing was written: run folder {run_dir} removed)"
    elif files:
        where = f" (log: {files[0].baseFilename})"
    elif run_dir is not None:
        where = f" (run folder: {run_dir})"
    if code is None:
        kind, status = f"a bug ({type(error).__name__}), not retryable", 1
    else:
        kind, status = f"{code.name.lower().replace('_', ' ')}, {'retryable' if code.retryable else 'not retryable'}", int(code)
    if code is ExitCode.BAD_SETTING:
        print(f"{program}: error: {message}{where}", file=sys.stderr)
    else:
        print(f"{program}: error [exit {status}: {kind}]: {type(error).__name__}: {message}{where}", file=sys.stderr)
    raise SystemExit(status) from None


def run_in_folder(job: Callable[[], Any], reraise: bool = False) -> Any:
    """Run ``job`` logging to the run folder; a failure ends the process (`end_run`) unless ``reraise``
    (a Hydra multirun, whose sweep goes on) or ``HYDRA_FULL_ERROR=1`` (the traceback wanted)."""
    from hydra.core.hydra_config import HydraConfig

    files = log_to_run_folder()
    log_was_empty = log_is_empty(files)
    try:
        return job()
    except Exception as error:
        if reraise or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        end_run(error, files, log_was_empty, Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None)
