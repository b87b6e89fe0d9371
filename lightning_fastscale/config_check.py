"""Refuse a bad setting of ``fastscale-train`` by its Hydra key, before the run has side effects.

The entry point builds every part of the config inside `setting_errors`, which turns a library's
refusal of an argument (``bucket_cap_mb=-5 must be ...``) into a `ConfigError` naming the Hydra
key (``strategy.bucket_cap_mb=-5 must be ...``), printed as one line with exit status 2.
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import re
from collections.abc import Iterator, Sequence
from importlib.resources import files as package_files
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

__all__ = ["ConfigError", "check_composed", "check_group_names", "check_parts", "config_names", "setting_errors", "show", "taken_by", "translate"]

# torch.optim words its refusals without the argument's name ("Invalid learning rate: -1").
_TORCH_PHRASES: tuple[tuple[str, str, str], ...] = (
    ("learning rate", "lr", "use a learning rate > 0, e.g. 0.1 for SGD at batch 256"),
    ("momentum value", "momentum", "use a momentum in [0, 1), e.g. 0.9"),
    ("weight_decay value", "weight_decay", "use a weight decay >= 0, e.g. 5e-4"),
    ("epsilon value", "eps", "use an epsilon > 0, e.g. 1e-8"),
    ("beta parameter", "betas", "use betas in [0, 1), e.g. [0.9, 0.999]"),
    ("dampening", "dampening", "use a dampening >= 0, or 0 with nesterov"),
)


class ConfigError(ValueError):
    """A setting of the composed config is wrong: the message names its Hydra key (``key``, or None), value and fix.

    Examples:
        >>> raise ConfigError("optimizer.lr=-1: use a learning rate > 0", key="optimizer.lr")
        Traceback (most recent call last):
        ...
        lightning_fastscale.config_check.ConfigError: optimizer.lr=-1: use a learning rate > 0
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


def _leaves(node: Any, prefix: str) -> dict[str, tuple[str, Any]]:
    """Argument name -> (dotted Hydra key, value); the node's own keys before nested ones."""
    found: dict[str, tuple[str, Any]] = {}
    if isinstance(node, DictConfig):
        for key in map(str, node.keys()):
            if key.startswith("_"):  # Hydra's _target_, _partial_
                continue
            try:
                child = node[key]
            except Exception:  # noqa: BLE001 - an interpolation that cannot resolve here
                child = None
            found[key] = (f"{prefix}.{key}" if prefix else key, child)
    for path, child in list(found.values()):
        if isinstance(child, DictConfig):
            for leaf, item in _leaves(child, path).items():
                found.setdefault(leaf, item)
    return found


def show(value: Any) -> str:
    """``value`` as it is written on the Hydra command line (``null``, ``true``, ``[1, 2]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, ListConfig):
        return str(list(value))
    return str(value)


def _root_error(error: BaseException) -> BaseException:
    """The library's own exception under Hydra's ``InstantiationException`` wrapper."""
    from hydra.errors import InstantiationException

    while isinstance(error, InstantiationException) and error.__cause__ is not None:
        error = error.__cause__
    return error


_VALUE = r"""(?:'[^']*'|"[^"]*"|\[[^\]]*\]|[^\s,;:()\[\]`]+)"""  # after ``name=``: quoted, a list, or a word


def _mention(leaf: str, assigned: bool) -> str:
    """Regex of ``leaf`` (or ``Class.leaf``) in a message: as ``leaf=value``, else alone where no prose
    uses it: with an underscore or in backquotes (``model`` in "unknown model" is no setting)."""
    name = rf"(?<![\w.])(?:\w+\.)?{re.escape(leaf)}"
    if assigned:
        return rf"{name}={_VALUE}"
    if "_" in leaf:
        return rf"{name}(?![\w=])"
    return rf"(?<=`)(?:\w+\.)?{re.escape(leaf)}(?=`)"


def _earliest_mention(message: str, names: dict[str, Any], assigned: bool) -> str | None:
    """The name of ``names`` that ``message`` mentions first (as ``name=value`` where ``assigned``)."""
    hits = []
    for leaf in names:
        match = re.search(_mention(leaf, assigned), message)
        if match:
            hits.append((match.start(), leaf))
    return min(hits, key=lambda hit: hit[0])[1] if hits else None


def _hydra_literal(written: str) -> str:
    """A Python literal of a message (``True``, ``None``, ``'max-autotune'``) as Hydra writes it."""
    if written in ("True", "False"):
        return written.lower()
    if written == "None":
        return "null"
    if len(written) >= 2 and written[0] == written[-1] and written[0] in "'\"":
        return written[1:-1]
    return written


def translate(error: BaseException, prefix: str, node: Any = None, also: dict[str, Any] | None = None) -> ConfigError:
    """``error`` (a library's refusal of one of its arguments, raised building group ``prefix``) re-worded with Hydra keys.

    The argument the message names first (``name=value`` before a bare ``name``) is looked up in
    ``node`` (nested keys too) and written as its Hydra key and configured value
    (``bucket_cap_mb=-5`` as ``strategy.bucket_cap_mb=-5``); other ``name=value`` get their keys,
    in Hydra's literals. ``also``: more groups the message may name (``{"trainer": cfg.trainer}``).
    Without a known key the message starts with the group's name.
    """
    error = _root_error(error)
    message = " ".join(str(error).split())  # one line
    leaves = _leaves(node, prefix) if node is not None else {}
    others = dict(leaves)
    for group, extra in (also or {}).items():
        for leaf, item in _leaves(extra, group).items():
            others.setdefault(leaf, item)
    best: tuple[str, bool] | None = None
    # name=value first, and the group's own keys before `also`'s
    for assigned in (True, False):
        for names in (leaves, others):
            leaf = _earliest_mention(message, names, assigned)
            if leaf is not None:
                best, leaves = (leaf, assigned), names
                break
        if best is not None:
            break
    fix = ""
    if best is None:
        lowered = message.lower()
        for phrase, leaf, hint in _TORCH_PHRASES:
            if phrase in lowered and leaf in leaves:
                best, fix = (leaf, False), hint
                break
    if best is None:
        return ConfigError(f"{prefix}: {message}")
    leaf, assigned = best
    key, value = leaves[leaf]
    if assigned:
        message = re.sub(_mention(leaf, True), lambda _: f"{key}={show(value)}", message, count=1)
    elif re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message) is None:
        message = re.sub(rf"(?<![\w.])(?:\w+\.)?{re.escape(leaf)}(?!\w)", key, message, count=1)
    for other, (other_key, _) in others.items():
        if other != leaf:
            message = re.sub(
                rf"(?<![\w.])(?:\w+\.)?{re.escape(other)}=({_VALUE})",
                lambda m, k=other_key: f"{k}={_hydra_literal(m.group(1))}", message,
            )
    if not message.startswith(f"{key}="):
        message = f"{key}={show(value)}: {message}"
    if fix:
        message = f"{message}; {fix}"
    return ConfigError(message, key=key)


@contextlib.contextmanager
def setting_errors(prefix: str, node: Any = None, also: dict[str, Any] | None = None) -> Iterator[None]:
    """Turn a library's refusal of an argument, raised inside the block, into a `ConfigError` (see `translate`).

    Refusals: ``ValueError``, ``MisconfigurationException``, ``FileNotFoundError`` (a path naming
    no file), and a ``TypeError`` about the arguments themselves; any other error is a bug.
    """
    try:
        yield
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - re-raised unchanged unless it is a refusal
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        root = _root_error(error)
        is_refusal = isinstance(root, (ValueError, MisconfigurationException, FileNotFoundError)) or (
            isinstance(root, TypeError) and re.search(r"argument|takes \d+ positional", str(root)) is not None
        )
        if not is_refusal:
            raise
        raise translate(root, prefix, node, also) from root


def config_names(config: str = "train") -> list[str]:
    """The top-level names a ``fastscale-train`` override may set: the config groups, the keys of
    ``<config>.yaml`` and those a global preset adds (``objective`` of ``hparams_search=time_to_target``)."""
    conf = package_files("lightning_fastscale.conf")
    groups = [p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")]
    files = [conf / f"{config}.yaml"] + [f for g in groups for f in (conf / g).glob("*.yaml")
                                         if f.read_text().startswith("# @package _global_")]
    keys = [str(k) for f in files for k in (OmegaConf.create(f.read_text()) or {}) if k != "defaults"]
    return sorted({*groups, *keys})


def check_group_names(overrides: Sequence[str], known: Sequence[str]) -> None:
    """Refuse an override whose top-level name is no group or key (``precison=...``), naming the nearest.

    Hydra's own message would advise ``+precison=...``, an unused setting; ``+``/``~`` overrides,
    flags and ``hydra.*`` are left to Hydra.
    """
    for override in overrides:
        if override.startswith(("-", "+", "~")) or "=" not in override:
            continue
        name = re.split(r"[.@/]", override.split("=", 1)[0], maxsplit=1)[0]
        if name in known or name == "hydra":
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        fix = f"did you mean {override.replace(name, near[0], 1)}?" if near else f"the names are: {', '.join(sorted(known))}"
        raise ConfigError(f"{name}: no config group or key of that name ({override}); {fix}", key=name)


def check_composed(cfg: DictConfig) -> None:
    """What the composed config alone shows: values left missing (``???``) and numbers given as text."""
    groups = [g for g in map(str, cfg) if g != "hydra" and not OmegaConf.is_interpolation(cfg, g)]
    # unresolved: an interpolation may need Hydra's runtime (``${hydra:job.name}``)
    missing = _missing({g: OmegaConf.to_container(cfg, resolve=False)[g] for g in groups}, "")
    if missing:
        raise ConfigError(
            f"{missing[0]} has no value (??? in its config): give it on the command line, e.g. "
            f"{missing[0]}=<value>" + (f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""),
            key=missing[0],
        )
    for group in groups:
        if not OmegaConf.is_missing(cfg, group) and isinstance(cfg[group], DictConfig):
            _check_number_types(group, cfg[group])


def _missing(node: Any, prefix: str) -> list[str]:
    if node == "???":
        return [prefix]
    if isinstance(node, dict):
        return [k for key, child in node.items() for k in _missing(child, f"{prefix}.{key}" if prefix else str(key))]
    return []


def _check_number_types(prefix: str, node: DictConfig) -> None:
    """An argument whose default is a number (not a bool) given a value that is not one (``optimizer.lr=abc``)."""
    from hydra.utils import get_method

    target = node.get("_target_") if "_target_" in node else None
    if isinstance(target, str):
        try:
            params = inspect.signature(get_method(target)).parameters
        except (ImportError, ValueError, TypeError):  # not found here: instantiate names it
            params = {}
        for name, param in params.items():
            default = param.default
            if (name not in node or isinstance(default, bool) or not isinstance(default, (int, float))
                    or OmegaConf.is_interpolation(node, name)):
                continue
            value = node[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{prefix}.{name}={show(value)} is not a number; give a number, e.g. "
                                  f"{prefix}.{name}={default}", key=f"{prefix}.{name}")
    for key, child in node.items():
        if isinstance(child, DictConfig) and not str(key).startswith("_"):
            _check_number_types(f"{prefix}.{key}", child)


def taken_by(node: DictConfig, links: dict[str, Any]) -> dict[str, Any]:
    """The ``links`` the class of ``node`` accepts (all of them if it takes ``**kwargs``); refuses a missing ``num_classes``."""
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


def check_parts(cfg: DictConfig, module: Any, trainer: pl.Trainer, datamodule: Any = None) -> None:
    """What only the built parts together can refuse (a `ConfigError` by Hydra key); warns about fp16 on a CPU.

    The optimizer on a stand-in parameter, clipping and accumulation, the training length an LR
    schedule needs, each recipe callback's ``check_trainer``, one batch of data, the strategy
    against the devices and nodes, and ``model.bn_span``.
    """
    import torch

    from lightning_fastscale._validation import positive_int

    optimizer = None
    if cfg.get("optimizer") and hasattr(module, "optimizer_factory"):  # a module of the user's own makes its own
        with setting_errors("optimizer", cfg.optimizer):
            optimizer = module.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    # Lightning's Trainer takes 0 without a check, and divides by it at fit.
    with setting_errors("trainer", cfg.trainer):
        positive_int("accumulate_grad_batches", trainer.accumulate_grad_batches,
                     hint="batches per optimizer step; 1 steps every batch")
    clip = trainer.gradient_clip_val
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise ConfigError(f"trainer.gradient_clip_val={show(clip)} must be a number >= 0 (the largest gradient "
                          "norm); 0 or null: no clipping", key="trainer.gradient_clip_val")
    _check_training_length(cfg, trainer)
    _check_recipe(cfg, trainer)
    if datamodule is not None:
        _check_one_batch(cfg, datamodule, trainer)
    _check_strategy(cfg, trainer)
    _check_topk_momentum(cfg, trainer, optimizer)
    _warn_fp16_on_cpu(cfg, trainer)
    bn_span = (cfg.get("model") or {}).get("bn_span")
    if bn_span is not None and datamodule is not None:  # refused with the nearest spans that work
        from lightning_fastscale.callbacks.bn_span import bn_span_plan

        with setting_errors("model", cfg.model):
            bn_span_plan(bn_span, datamodule.train_batch_size, trainer.num_devices * trainer.num_nodes,
                         getattr(trainer.strategy, "ranks_per_node", None) or trainer.num_devices)


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


def _check_recipe(cfg: DictConfig, trainer: pl.Trainer) -> None:
    """Each configured callback's ``check_trainer`` (the recipe's schedules against the Trainer), all refusals at once."""
    by_class = {str(node.get("_target_", "")).rsplit(".", 1)[-1]: (name, node)
                for name, node in (cfg.get("callbacks") or {}).items() if node}
    errors: list[ConfigError] = []
    for callback in trainer.callbacks:
        check = getattr(callback, "check_trainer", None)
        if not callable(check) or type(callback).__name__ not in by_class:
            continue
        name, node = by_class[type(callback).__name__]
        try:
            with setting_errors(f"callbacks.{name}", node, also={"trainer": cfg.trainer}):
                check(trainer)
        except ConfigError as error:
            errors.append(error)
    if errors:
        raise ConfigError("; ".join(map(str, errors)), key=errors[0].key)


def _check_one_batch(cfg: DictConfig, datamodule: Any, trainer: pl.Trainer) -> None:
    """Refuse a training set smaller than one batch per rank (a run that trains nothing and exits 0)."""
    train_set = getattr(datamodule, "train_set", None)
    batch = getattr(datamodule, "train_batch_size", None)
    if train_set is None or not isinstance(batch, int) or not hasattr(train_set, "__len__"):
        return  # the datamodule knows its size only at setup (a folder, a stream)
    if any(type(c).__name__ == "BatchSizeRamp" for c in trainer.callbacks):
        batch = -(-batch // trainer.world_size)  # the ramp's data.batch_size is the global batch
    per_rank = len(train_set) // trainer.world_size
    if per_rank < batch:
        key = "data.train_size" if "train_size" in cfg.data else "data.batch_size"
        raise ConfigError(
            f"{key}={show(cfg.data.get(key.split('.')[1]))}: {len(train_set)} training samples give "
            f"{per_rank} per rank on {trainer.world_size} rank(s), less than one batch of "
            f"data.batch_size={batch} (the last incomplete batch is dropped, so nothing would train); "
            "raise data.train_size or lower data.batch_size", key=key)


def _check_strategy(cfg: DictConfig, trainer: pl.Trainer) -> None:
    from lightning_fastscale._validation import positive_number

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


def _check_topk_momentum(cfg: DictConfig, trainer: pl.Trainer, optimizer: Any) -> None:
    """``strategy.topk_momentum`` moves the optimizer's momentum into the top-k stage between nodes:
    refuse a run with no such stage (one node) and an optimizer that keeps a momentum of its own."""
    from lightning_fastscale.strategies.option_checks import check_topk_momentum_stage, optimizer_momentum

    strategy = trainer.strategy
    topk_momentum = getattr(strategy, "topk_momentum", 0.0)
    if not topk_momentum:
        return
    with setting_errors("strategy", cfg.get("strategy")):
        check_topk_momentum_stage(topk_momentum, strategy.check_topology().num_nodes, strategy.algorithm)
    held = None if optimizer is None else optimizer_momentum(optimizer)
    if held is None:
        return
    group = optimizer.param_groups[held[0]]
    fix = ("optimizer.momentum=0" + (" optimizer.nesterov=false" if group.get("nesterov") else "")
           if "momentum" in group else "an optimizer without momentum (optimizer=sgd optimizer.momentum=0)")
    raise ConfigError(
        f"strategy.topk_momentum={show(topk_momentum)} moves the momentum into the top-k stage (momentum "
        f"correction), but the optimizer keeps its own ({held[1]}): set {fix} (and optimizer.weight_decay "
        f"x {1 / (1 - topk_momentum):g} for the same decay), or strategy.topk_momentum=0", key="strategy.topk_momentum")


def _warn_fp16_on_cpu(cfg: DictConfig, trainer: pl.Trainer) -> None:
    """fp16 on a CPU is emulated (tens of times slower than bf16); allowed, since the loss scaler's CPU path is tested with it."""
    from lightning.pytorch.accelerators import CPUAccelerator

    if isinstance(trainer.accelerator, CPUAccelerator) and str(trainer.precision).startswith("16"):
        if cfg.get("precision"):
            choice = f"precision={_choice('precision', cfg)}"
        else:
            choice = f"trainer.precision={trainer.precision}"
        bf16 = choice.replace("fp16", "bf16") if "fp16" in choice else "precision=bf16_mixed"
        log.warning("%s on a CPU: fp16 runs emulated there, many times slower than bf16; use %s", choice, bf16)


def _choice(group: str, cfg: DictConfig) -> str:
    """The option chosen for ``group`` (``cosine`` for ``scheduler=cosine``), as the user wrote it."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        chosen = HydraConfig.get().runtime.choices.get(group)
        if chosen:
            return str(chosen)
    return str(cfg[group].get("_target_", "?")).rsplit(".", 1)[-1]
