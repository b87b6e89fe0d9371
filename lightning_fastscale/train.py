"""``fastscale-train``: the Hydra entry point.

Composes ``lightning_fastscale/conf/train.yaml`` with its groups, instantiates them and fits an
[`ImageClassifier`][lightning_fastscale.ImageClassifier]; returns the monitored metric for sweepers.
The checks are in `lightning_fastscale.config_check`, the run folder in `lightning_fastscale.run_folder`.
"""
from __future__ import annotations

import logging
import sys
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

from . import config_check, run_folder
from .callbacks.bn_span import BNSpan
from .config_check import ConfigError, setting_errors
from .diagnostics.sweeps import check_objective, objective_value
from .diagnostics.time_to_accuracy import TimeToAccuracy
from .faults.atomic_checkpoint_io import AtomicCheckpointIO
from .faults.exact_resume import WorldSizeChangeError
from .module import ImageClassifier

log = logging.getLogger(__name__)


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def cluster_launches_ranks() -> bool:
    """True when a cluster launcher (SLURM's ``srun``, ``torchrun``, LSF's ``jsrun``) started this process as one rank."""
    return any(env.detect() for env in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment))


def build_strategy(cfg: DictConfig, devices: Any) -> Any:
    """The strategy the ``strategy`` group describes, or ``"auto"`` (Lightning's default) for an empty node.

    In a multirun on several devices the ranks are spawned, unless a cluster launcher runs them:
    Lightning's launcher re-executes the script, and each child would start the whole sweep again.
    """
    node = cfg.get("strategy")
    if not node:
        return "auto"
    multi_device = devices not in (1, "1", None) and not (isinstance(devices, list) and len(devices) == 1)
    if _is_multirun() and multi_device and not cluster_launches_ranks():
        return instantiate(node, start_method="spawn")
    return instantiate(node)


def build(cfg: DictConfig) -> tuple[pl.LightningDataModule, ImageClassifier, pl.Trainer]:
    """Instantiate the datamodule, module and Trainer that ``cfg`` describes (no fitting).

    Every part is built and checked (`check_parts`) before anything is written or started: a bad
    setting raises a `ConfigError` naming its Hydra key, its value and the fix.
    """
    config_check.check_composed(cfg)
    with setting_errors("data", cfg.data):
        datamodule = instantiate(cfg.data)
    # the links between groups, passed to the model where its class takes them (a user's own
    # module given by _target_ may take none): the classifier's outputs are the data's classes
    links = {"num_classes": getattr(datamodule, "num_classes", None)}
    for group in ("optimizer", "scheduler"):
        with setting_errors(group, cfg.get(group)):
            links[group] = instantiate(cfg[group]) if cfg.get(group) else None
    # model.bn_span: BN statistics over that many images, applied by the BNSpan callback (not a
    # model argument); the node is resolved against the whole config before it leaves
    bn_span = cfg.model.get("bn_span")
    with setting_errors("model", cfg.model):
        node = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
        node.pop("bn_span", None)
        module = instantiate(node, **config_check.taken_by(node, links))
    callbacks = [] if bn_span is None else [BNSpan(bn_span)]
    for name, node in (cfg.get("callbacks") or {}).items():
        if node:
            with setting_errors(f"callbacks.{name}", node):
                callbacks.append(instantiate(node))
    with setting_errors("logger", cfg.get("logger")):
        logger = run_folder.build_logger(cfg)
    if not logger:  # these only report to a logger, and Lightning refuses them without one
        callbacks = [c for c in callbacks if not isinstance(c, (LearningRateMonitor, ThroughputMonitor))]
    with setting_errors("precision", cfg.get("precision")):
        plugins = [instantiate(cfg.precision)] if cfg.get("precision") else []
    with setting_errors("strategy", cfg.get("strategy")):
        strategy = build_strategy(cfg, cfg.trainer.get("devices"))
    with setting_errors("trainer", cfg.trainer):
        # every checkpoint written atomically beside its target (no partial file under a final name)
        trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=logger,
                                          plugins=[*plugins, AtomicCheckpointIO()])
    config_check.check_parts(cfg, module, trainer, datamodule)
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
    ckpt_path = run_folder.resolve_resume(cfg)
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
        run_folder.report_metric_locations(trainer)
        run_folder.finish_wandb(trainer)
    value = trainer.callback_metrics.get(cfg.monitor)
    if value is None:
        log.warning("metric %s was not logged; nothing to return", cfg.monitor)
        return None
    if trainer.is_global_zero:
        run_folder.report(f"final {cfg.monitor}: {float(value):.4f}")
    return objective_value(cfg, trainer, float(value))


@hydra.main(version_base="1.3", config_path="pkg://lightning_fastscale.conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    return run_folder.run_in_folder(lambda: train(cfg), reraise=_is_multirun())


def main() -> float | None:
    """Console entry point: ``fastscale-train [group=option ...] [key=value ...] [-m]``.

    A misspelt group is refused before Hydra starts; a failure ends with one line on stderr and its
    kind's exit status (`run_folder.end_run`); ``HYDRA_FULL_ERROR=1`` shows the traceback instead.
    """
    try:
        config_check.check_group_names(sys.argv[1:], config_check.config_names())
    except ConfigError as error:
        print(f"fastscale-train: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return _hydra_main()


if __name__ == "__main__":
    main()
