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
from pathlib import Path
from typing import Any

import hydra
import torch
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.plugins.environments import LSFEnvironment, SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lightning_fastscale  # noqa: F401  (registers strategies and models)

from . import checkpointing
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
    """Strategy object or name from the ``strategy`` group.

    Lightning's default DDP launcher re-executes the script once per extra rank, which does
    not mix with Hydra multirun (each re-executed child would start the whole sweep again).
    Inside a multirun with several devices the strategy is therefore started with the
    ``spawn`` method instead, so each sweep job forks its ranks in-process. Not so when a
    cluster launcher (SLURM, torchrun) already runs one process per rank: there Lightning
    starts no processes, and spawning would multiply the ranks.
    """
    node = cfg.get("strategy")
    if node is None or (isinstance(node, DictConfig) and not node):
        return "auto"
    if not isinstance(node, DictConfig):
        return node
    multi_device = devices not in (1, "1", None) and not (isinstance(devices, list) and len(devices) == 1)
    spawn = _is_multirun() and multi_device and not cluster_launches_ranks()
    if "_target_" in node:
        if spawn:
            return instantiate(node, start_method="spawn")
        return instantiate(node)
    name = node.get("name", "auto")
    if spawn and name == "ddp":
        return "ddp_spawn"
    return name


def build_precision(cfg: DictConfig) -> tuple[Any, list[Any]]:
    """``(precision_string_or_None, plugins)`` from the ``precision`` group."""
    node = cfg.get("precision")
    if node is None or (isinstance(node, DictConfig) and not node):
        return None, []
    if isinstance(node, DictConfig) and "_target_" in node:
        return None, [instantiate(node)]
    if isinstance(node, DictConfig):
        return node.get("value"), []
    return node, []


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
        raise FileExistsError(
            f"{dirpath} already holds checkpoints ({existing[0].name}, ...); refusing to overwrite "
            "them. Use a new hydra.run.dir (the default is a fresh timestamped folder), or resume "
            "with ckpt_path=... which writes into a new run folder."
        )


RESUME_MODES = ("never", "auto")


def _checkpoint_folders(cfg: DictConfig) -> list[Path]:
    """The folders the configured checkpoint callbacks write into."""
    callbacks = cfg.get("callbacks") or {}
    folders = []
    for name in ("model_checkpoint", "preemption"):
        node = callbacks.get(name)
        if node and node.get("dirpath"):
            folders.append(Path(node.dirpath))
    return list(dict.fromkeys(folders))


def resolve_resume(cfg: DictConfig) -> str | None:
    """The checkpoint this run starts from, following ``resume`` and ``ckpt_path``.

    ``resume=never`` (the default): a fresh run, or ``ckpt_path``; a run folder that already
    holds checkpoints is refused. ``resume=auto`` (requeued or restarted jobs, with a fixed
    ``hydra.run.dir``): continue from the newest checkpoint in the run's checkpoint folder,
    or start fresh when there is none yet; an unreadable newest file is an error naming it.
    """
    mode = cfg.get("resume", "never")
    if mode not in RESUME_MODES:
        raise ValueError(f"resume={mode!r} is not one of {RESUME_MODES}; use resume=auto to continue a run in its folder")
    if mode == "never":
        _check_output_dir_is_fresh(cfg)
        return cfg.get("ckpt_path")
    if cfg.get("ckpt_path"):
        raise ValueError(
            f"resume=auto and ckpt_path={cfg.ckpt_path} both given; resume=auto picks the newest "
            "checkpoint of the run folder itself: drop one of them"
        )
    folders = _checkpoint_folders(cfg)
    newest = checkpointing.newest_checkpoint(folders)
    if newest is None:
        log.info("resume=auto: no checkpoint in %s yet; starting a fresh run", ", ".join(map(str, folders)) or "-")
        return None
    checkpointing.read_checkpoint(newest)  # a truncated newest file stops here, by name
    log.info("resume=auto: continuing from %s", newest)
    return str(newest)


def build(cfg: DictConfig) -> tuple[pl.LightningDataModule, ImageClassifier, pl.Trainer]:
    """Instantiate the datamodule, module and Trainer that ``cfg`` describes (no fitting)."""
    datamodule = instantiate(cfg.data)
    num_classes = getattr(datamodule, "num_classes", None)
    if num_classes is None:
        raise ValueError(f"{type(datamodule).__name__} has no num_classes attribute; the classifier needs it")
    model_cfg = cfg.model
    module = ImageClassifier(
        model=model_cfg.name,
        num_classes=num_classes,
        optimizer=instantiate(cfg.optimizer) if cfg.get("optimizer") else None,
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
        model_kwargs=OmegaConf.to_container(model_cfg.kwargs, resolve=True) if model_cfg.get("kwargs") else {},
        pretrained=model_cfg.get("pretrained", False),
        channels_last=bool(model_cfg.get("channels_last", False)),
        compile=bool(model_cfg.get("compile", False)),
        compile_mode=model_cfg.get("compile_mode"),
    )
    if hasattr(datamodule, "train_batch_size") and hasattr(datamodule, "train_resolution"):
        # one per-device training batch: what the planner profiles backward on (FLOPs or timing)
        side = datamodule.train_resolution
        module.example_input_array = torch.zeros(datamodule.train_batch_size, 3, side, side)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    logger = build_logger(cfg)
    if not logger:  # these only report to a logger, and Lightning refuses them without one
        callbacks = [c for c in callbacks if not isinstance(c, (LearningRateMonitor, ThroughputMonitor))]
    precision, plugins = build_precision(cfg)
    trainer_kwargs: dict[str, Any] = {
        "strategy": build_strategy(cfg, cfg.trainer.get("devices")),
        "callbacks": callbacks,
        "logger": logger,
        "plugins": plugins or None,
    }
    if precision is not None:
        trainer_kwargs["precision"] = precision
    trainer: pl.Trainer = instantiate(cfg.trainer, **trainer_kwargs)
    return datamodule, module, trainer


def train(cfg: DictConfig) -> float | None:
    """Fit the configured model; return the final value of ``cfg.monitor`` (or None)."""
    pl.seed_everything(cfg.seed, workers=True)
    ckpt_path = resolve_resume(cfg)
    datamodule, module, trainer = build(cfg)
    if trainer.logger:
        trainer.logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    finally:
        _finish_wandb(trainer)
    value = trainer.callback_metrics.get(cfg.monitor)
    if value is None:
        log.warning("metric %s was not logged; nothing to return", cfg.monitor)
        return None
    if trainer.is_global_zero:
        print(f"final {cfg.monitor}: {float(value):.4f}")
    return float(value)


def _finish_wandb(trainer: pl.Trainer) -> None:
    from lightning.pytorch.loggers import WandbLogger

    if isinstance(trainer.logger, WandbLogger) and trainer.is_global_zero:
        import wandb

        run = wandb.run
        if run is not None:
            print(f"W&B run written to {Path(run.dir).parent}" + (" (offline)" if run.offline else ""))
        wandb.finish()


@hydra.main(version_base="1.3", config_path="pkg://lightning_fastscale.conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    """Console entry point: ``fastscale-train [group=option ...] [key=value ...] [-m]``."""
    return train(cfg)


if __name__ == "__main__":
    main()
