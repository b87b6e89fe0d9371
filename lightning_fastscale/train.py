"""``fastscale-train``: the Hydra entry point.

Composes ``lightning_fastscale/conf/train.yaml`` (shipped inside the package, found through
Hydra's package search path) with its groups (model, data, optimizer, scheduler, trainer,
strategy, precision, callbacks, logger, experiment, hparams_search), instantiates them with
``hydra.utils.instantiate`` and fits an [`ImageClassifier`][lightning_fastscale.ImageClassifier].
Returns the monitored metric, so sweepers (Optuna) can optimise it.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import LSFEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from omegaconf import DictConfig, OmegaConf

import lightning_fastscale  # noqa: F401  (registers strategies, models and the configs' resolver)

from ._validation import positive_int, positive_number
from .callbacks.bn_span import BNSpan, bn_span_plan
from .config_check import ConfigError, setting_errors, show
from .diagnostics.sweeps import check_objective, objective_value
from .diagnostics.time_to_accuracy import TimeToAccuracy
from .faults import checkpoint_reading
from .faults.atomic_checkpoint_io import AtomicCheckpointIO
from .faults.exact_resume import WorldSizeChangeError
from .faults.run_folder_lock import LOCK_NAME
from .module import ImageClassifier

log = logging.getLogger(__name__)


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def cluster_launches_ranks() -> bool:
    """True when a cluster launcher already started this process as one rank of the job.

    Detected through Lightning's own cluster environments: SLURM's ``srun`` (e.g. the submitit
    launcher with one task per GPU), ``torchrun`` / torchelastic, LSF's ``jsrun``.
    """
    return any(env.detect() for env in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment))


def build_strategy(cfg: DictConfig, devices: Any) -> Any:
    """The strategy the ``strategy`` group describes, or ``"auto"`` (Lightning's default) for an empty node.

    Lightning's default DDP launcher re-executes the script once per extra rank, which does
    not mix with Hydra multirun (each re-executed child would start the whole sweep again).
    Inside a multirun with several devices the strategy is therefore started with the
    ``spawn`` method instead, so each sweep job forks its ranks in-process. Not so when a
    cluster launcher (SLURM, torchrun) already runs one process per rank: there Lightning
    starts no processes, and spawning would multiply the ranks.
    """
    node = cfg.get("strategy")
    if not node:
        return "auto"
    multi_device = devices not in (1, "1", None) and not (isinstance(devices, list) and len(devices) == 1)
    if _is_multirun() and multi_device and not cluster_launches_ranks():
        return instantiate(node, start_method="spawn")
    return instantiate(node)


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
    """Drop the ``anonymous=None`` that Lightning's ``WandbLogger`` always hands to ``wandb.init``.

    wandb >= 0.19 deprecated the setting and warns on every run whenever it is passed at all,
    even as None; left out it keeps wandb's default, which is what None meant.
    """
    init_kwargs = getattr(logger, "_wandb_init", None)
    if isinstance(init_kwargs, dict) and init_kwargs.get("anonymous", False) is None:
        del init_kwargs["anonymous"]
    return logger


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
    folders = []
    for name in ("model_checkpoint", "last_checkpoint", "preemption"):
        node = callbacks.get(name)
        if node and node.get("dirpath"):
            folders.append(Path(node.dirpath))
    return list(dict.fromkeys(folders))


def resolve_resume(cfg: DictConfig) -> str | None:
    """The checkpoint this run starts from, following ``resume`` and ``ckpt_path``.

    ``resume=never`` (the default): a fresh run, or ``ckpt_path``; a run folder that already
    holds checkpoints is refused. ``resume=auto`` (requeued or restarted jobs, with a fixed
    ``hydra.run.dir``): continue from the newest checkpoint in the run's checkpoint folder,
    or start fresh when there is none yet; an incomplete or unreadable file is skipped with a
    warning naming it (see `resume_point`).
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


def build(cfg: DictConfig) -> tuple[pl.LightningDataModule, ImageClassifier, pl.Trainer]:
    """Instantiate the datamodule, module and Trainer that ``cfg`` describes (no fitting).

    Every part is built, and the parts checked against each other (`check_parts`), before
    anything is written or started: a bad setting raises [`ConfigError`][lightning_fastscale.config_check.ConfigError] naming its Hydra
    key, its value and the fix.
    """
    with setting_errors("data", cfg.data):
        datamodule = instantiate(cfg.data)
    num_classes = getattr(datamodule, "num_classes", None)
    if num_classes is None:
        raise ValueError(f"{type(datamodule).__name__} has no num_classes attribute; the classifier needs it")
    with setting_errors("optimizer", cfg.get("optimizer")):
        optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    with setting_errors("scheduler", cfg.get("scheduler")):
        scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    # the one link between groups: the classifier's outputs are the datamodule's classes
    # model.bn_span: BN statistics over that many images, applied by the BNSpan callback
    with setting_errors("model", cfg.model):
        node = OmegaConf.to_container(cfg.model, resolve=True)  # resolved against the whole config
        bn_span = node.pop("bn_span", None)
        module = instantiate(node, num_classes=num_classes, optimizer=optimizer, scheduler=scheduler)
    callbacks = [] if bn_span is None else [BNSpan(bn_span)]
    for name, node in (cfg.get("callbacks") or {}).items():
        if node:
            with setting_errors(f"callbacks.{name}", node):
                callbacks.append(instantiate(node))
    with setting_errors("logger", cfg.get("logger")):
        logger = build_logger(cfg)
    if not logger:  # these only report to a logger, and Lightning refuses them without one
        callbacks = [c for c in callbacks if not isinstance(c, (LearningRateMonitor, ThroughputMonitor))]
    with setting_errors("precision", cfg.get("precision")):
        plugins = [instantiate(cfg.precision)] if cfg.get("precision") else []
    with setting_errors("strategy", cfg.get("strategy")):
        strategy = build_strategy(cfg, cfg.trainer.get("devices"))
    with setting_errors("trainer", cfg.trainer):
        trainer: pl.Trainer = instantiate(
            cfg.trainer,
            strategy=strategy,
            callbacks=callbacks,
            logger=logger,
            # every checkpoint written atomically beside its target (no partial file under a final name)
            plugins=[*plugins, AtomicCheckpointIO()],
        )
    check_parts(cfg, module, trainer)
    if bn_span is not None:  # refused here, with the nearest spans that work
        with setting_errors("model", cfg.model):
            bn_span_plan(bn_span, datamodule.train_batch_size, trainer.num_devices * trainer.num_nodes,
                         getattr(trainer.strategy, "ranks_per_node", None) or trainer.num_devices)
    return datamodule, module, trainer


# -- checks of the built parts against each other, before any side effect ---------------------


def check_parts(cfg: DictConfig, module: ImageClassifier, trainer: pl.Trainer) -> None:
    """What only the built parts together can refuse: raises [`ConfigError`][lightning_fastscale.config_check.ConfigError] by Hydra key.

    The optimizer is built once on a stand-in parameter (torch checks its arguments there), the
    training length is checked against what needs one (an LR schedule), and the strategy's
    settings against the Trainer's devices and nodes.
    """
    if cfg.get("optimizer"):
        with setting_errors("optimizer", cfg.optimizer):
            module.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    # Lightning's Trainer takes 0 without a check, and divides by it at fit.
    with setting_errors("trainer", cfg.trainer):
        positive_int("accumulate_grad_batches", trainer.accumulate_grad_batches,
                     hint="batches per optimizer step; 1 steps every batch")
    _check_training_length(cfg, trainer)
    _check_strategy(cfg, trainer)


def _check_training_length(cfg: DictConfig, trainer: pl.Trainer) -> None:
    if trainer.max_epochs not in (-1, None) or trainer.max_steps != -1:
        return
    needs = [f"scheduler={_choice('scheduler', cfg)}"] if cfg.get("scheduler") else []
    needs += [f"callbacks.{name}" for name, node in (cfg.get("callbacks") or {}).items()
              if node and str(node.get("_target_", "")).endswith(".WarmupDecayLR") and node.get("total_epochs") is None]
    if needs:
        raise ConfigError(
            f"trainer.max_epochs={trainer.max_epochs} with trainer.max_steps=-1 trains without end, but "
            f"{' and '.join(needs)} spread the learning rate over the run's length: set trainer.max_epochs to "
            "a positive number of epochs (or trainer.max_steps), or use scheduler=none",
            key="trainer.max_epochs",
        )


def _check_strategy(cfg: DictConfig, trainer: pl.Trainer) -> None:
    strategy = trainer.strategy
    node = cfg.get("strategy") if isinstance(cfg.get("strategy"), DictConfig) else None
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None) or {}
    if ddp_kwargs.get("bucket_cap_mb") is not None:
        with setting_errors("strategy", node):
            positive_number("bucket_cap_mb", ddp_kwargs["bucket_cap_mb"], hint="DDP's bucket size in MB (25 by default)")
    check_topology = getattr(strategy, "check_topology", None)
    if callable(check_topology):
        try:
            check_topology()
        except ValueError as error:
            ranks_per_node = getattr(strategy, "ranks_per_node", None)
            world = trainer.num_devices * trainer.num_nodes
            raise ConfigError(
                f"strategy.ranks_per_node={show(ranks_per_node)} does not divide the {world} ranks of "
                f"trainer.devices={trainer.num_devices} x trainer.num_nodes={trainer.num_nodes}: every node "
                f"must hold the same number of ranks; set strategy.ranks_per_node to a divisor of {world} or "
                "null (the devices of one machine), or change trainer.devices",
                key="strategy.ranks_per_node",
            ) from error


def _choice(group: str, cfg: DictConfig) -> str:
    """The option chosen for ``group`` (``cosine`` for ``scheduler=cosine``), as the user wrote it."""
    if HydraConfig.initialized():
        chosen = HydraConfig.get().runtime.choices.get(group)
        if chosen:
            return str(chosen)
    return str(cfg[group].get("_target_", "?")).rsplit(".", 1)[-1]


# -- the run's summary: samples/s, where the metrics went -----------------------------------------


def _report(line: str) -> None:
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
            _report(f"metrics written to {Path(logger.log_dir) / 'metrics.csv'}")
        elif isinstance(logger, TensorBoardLogger):
            _report(f"metrics written to {logger.log_dir} (TensorBoard)")
        elif not isinstance(logger, WandbLogger):  # W&B says where when its run finishes
            _report(f"metrics written by {type(logger).__name__} to {logger.save_dir}")


def train(cfg: DictConfig) -> float | None:
    """Fit the configured model; return the final value of ``cfg.monitor`` (or None), or with
    ``objective.name=time_to_target`` (``hparams_search=time_to_target``) the time to the target.

    Raises:
        ConfigError: a setting is wrong; raised before the logger, the process group or any
            file of the run is started.
    """
    check_objective(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    ckpt_path = resolve_resume(cfg)
    datamodule, module, trainer = build(cfg)
    if trainer.logger:
        trainer.logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    for callback in trainer.callbacks:  # time to accuracy counts the ranks' launch and process group too
        if isinstance(callback, TimeToAccuracy):
            callback.start()
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except WorldSizeChangeError as error:  # refused at the restore, before the first step
        raise ConfigError(f"ckpt_path={ckpt_path}: " + error.advice(
            "trainer.devices x trainer.num_nodes", "callbacks.exact_resume.allow_world_size_change=true")) from error
    finally:
        report_metric_locations(trainer)
        _finish_wandb(trainer)
    value = trainer.callback_metrics.get(cfg.monitor)
    if value is None:
        log.warning("metric %s was not logged; nothing to return", cfg.monitor)
        return None
    if trainer.is_global_zero:
        _report(f"final {cfg.monitor}: {float(value):.4f}")
    return objective_value(cfg, trainer, float(value))


def _finish_wandb(trainer: pl.Trainer) -> None:
    from lightning.pytorch.loggers import WandbLogger

    if isinstance(trainer.logger, WandbLogger) and trainer.is_global_zero:
        import wandb

        run = wandb.run
        if run is not None:
            _report(f"W&B run written to {Path(run.dir).parent}" + (" (offline)" if run.offline else ""))
        wandb.finish()


# -- the console entry point: the run folder's log, user errors in one line -----------------------

_LIBRARY_LOGGERS = ("lightning.pytorch", "lightning.fabric")
"""Lightning's loggers keep their own console handler and do not propagate to the root logger."""

HYDRA_FILES = frozenset({".hydra", LOCK_NAME})
"""What a run writes into its folder before training starts: Hydra's config and the run's claim."""


def log_to_run_folder() -> list[logging.FileHandler]:
    """Send Lightning's log records to the run folder's log file too (Hydra's ``<job>.log``).

    Hydra writes the root logger to the console and to the run folder's ``<job name>.log``; the
    package's loggers propagate there, Lightning's do not (they print through their own handler),
    so without this their lines (the strategy's plan, devices, checkpoint notes) never reach the
    file. Python warnings still print as before and are written to the file too. Returns the file handlers found (none when Hydra's job logging is off).
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
    """Delete ``run_dir`` when it holds only what Hydra wrote for this very run; True if deleted.

    A run refused for a bad setting has written nothing; its timestamped folder (Hydra's
    ``.hydra/`` and an empty-at-start log) would only clutter ``outputs/``. A folder holding
    anything else, or a log with lines from an earlier run, is left as it is.
    """
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


@hydra.main(version_base="1.3", config_path="pkg://lightning_fastscale.conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Console entry point: ``fastscale-train [group=option ...] [key=value ...] [-m]``.

    A [`ConfigError`][lightning_fastscale.config_check.ConfigError] (a wrong setting) ends the run with its one-line message on stderr
    and exit status 2, the run folder removed if nothing was written to it; set
    ``HYDRA_FULL_ERROR=1`` to see its traceback. Any other error keeps its traceback, which also
    goes to the run folder's log.
    """
    files = log_to_run_folder()
    log_was_empty = all(os.path.getsize(h.baseFilename) == 0 for h in files if os.path.exists(h.baseFilename))
    try:
        return train(cfg)
    except ConfigError as error:
        if _is_multirun() or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _log_to_file_only(files, logging.ERROR, f"fastscale-train: {error}")
        where = ""
        if HydraConfig.initialized():
            run_dir = Path(HydraConfig.get().runtime.output_dir)
            if remove_run_folder_if_unused(run_dir, files, log_was_empty):
                where = f" (nothing was written: run folder {run_dir} removed)"
            else:
                where = f" (run folder: {run_dir})"
        print(f"fastscale-train: error: {error}{where}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception:
        _log_to_file_only(files, logging.ERROR, "fastscale-train failed", exc_info=sys.exc_info())
        raise


if __name__ == "__main__":
    main()
