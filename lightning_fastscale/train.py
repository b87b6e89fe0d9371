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
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import LSFEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from omegaconf import DictConfig, OmegaConf

import lightning_fastscale  # noqa: F401  (registers strategies, models and the configs' resolver)

from .callbacks.bn_span import BNSpan, bn_span_plan
from .config_check import ConfigError, check_composed, check_group_names, check_parts, config_names, setting_errors
from .diagnostics.sweeps import check_objective, objective_value
from .diagnostics.time_to_accuracy import TimeToAccuracy
from .faults import checkpoint_reading
from .faults.atomic_checkpoint_io import AtomicCheckpointIO
from .faults.exact_resume import WorldSizeChangeError
from .module import ImageClassifier
from .run_log import end_run, finish_wandb, log_is_empty, log_to_run_folder, report, report_metric_locations

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


def taken_by(node: DictConfig, links: dict[str, Any]) -> dict[str, Any]:
    """The ``links`` the class of ``node`` accepts (all of them if it takes ``**kwargs``); refuses a missing ``num_classes``."""
    import inspect

    from hydra.utils import get_method

    params = inspect.signature(get_method(node._target_)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = dict(links)
    else:
        accepted = {k: v for k, v in links.items() if k in params and k not in node}
    if "num_classes" in accepted and accepted["num_classes"] is None:
        raise ConfigError(f"model={node._target_} takes num_classes, but the datamodule has no num_classes "
                          "attribute: give model.num_classes=<classes> or add the attribute", key="model.num_classes")
    return {k: v for k, v in accepted.items() if v is not None or k != "num_classes"}


def build(cfg: DictConfig) -> tuple[pl.LightningDataModule, ImageClassifier, pl.Trainer]:
    """Instantiate the datamodule, module and Trainer that ``cfg`` describes (no fitting).

    Every part is built, and the parts checked against each other (`check_parts`), before
    anything is written or started: a bad setting raises [`ConfigError`][lightning_fastscale.config_check.ConfigError] naming its Hydra
    key, its value and the fix.
    """
    check_composed(cfg)
    with setting_errors("data", cfg.data):
        datamodule = instantiate(cfg.data)
    # the links between groups, passed to the model where its class takes them (a user's own
    # module given by _target_ may take none): the classifier's outputs are the data's classes
    links = {"num_classes": getattr(datamodule, "num_classes", None)}
    with setting_errors("optimizer", cfg.get("optimizer")):
        optimizer = instantiate(cfg.optimizer) if cfg.get("optimizer") else None
    with setting_errors("scheduler", cfg.get("scheduler")):
        scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    links.update(optimizer=optimizer, scheduler=scheduler)
    # model.bn_span: BN statistics over that many images, applied by the BNSpan callback (not a
    # model argument); the node is resolved against the whole config before it leaves
    bn_span = cfg.model.get("bn_span")
    with setting_errors("model", cfg.model):
        node = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
        node.pop("bn_span", None)
        module = instantiate(node, **taken_by(node, links))
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
    check_parts(cfg, module, trainer, datamodule)
    if bn_span is not None:  # refused here, with the nearest spans that work
        with setting_errors("model", cfg.model):
            bn_span_plan(bn_span, datamodule.train_batch_size, trainer.num_devices * trainer.num_nodes,
                         getattr(trainer.strategy, "ranks_per_node", None) or trainer.num_devices)
    return datamodule, module, trainer


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
        finish_wandb(trainer)
    value = trainer.callback_metrics.get(cfg.monitor)
    if value is None:
        log.warning("metric %s was not logged; nothing to return", cfg.monitor)
        return None
    if trainer.is_global_zero:
        report(f"final {cfg.monitor}: {float(value):.4f}")
    return objective_value(cfg, trainer, float(value))


# -- the console entry point: the run folder's log, each failure one line and its exit status ---


@hydra.main(version_base="1.3", config_path="pkg://lightning_fastscale.conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    files = log_to_run_folder()
    log_was_empty = log_is_empty(files)
    try:
        return train(cfg)
    except Exception as error:
        if _is_multirun() or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        end_run(error, files, log_was_empty, Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None)


def main() -> float | None:
    """Console entry point: ``fastscale-train [group=option ...] [key=value ...] [-m]``.

    A misspelt group is refused before Hydra starts. A failure ends the process with one line
    on stderr (the run folder's log keeps the traceback) and the exit status of its kind
    (`lightning_fastscale.exit_codes`): 2 for a wrong setting, the run folder removed if nothing
    was written to it. ``HYDRA_FULL_ERROR=1`` shows the traceback instead.
    """
    try:
        check_group_names(sys.argv[1:], config_names())
    except ConfigError as error:
        print(f"fastscale-train: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return _hydra_main()


if __name__ == "__main__":
    main()
