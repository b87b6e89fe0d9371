"""Refuse a bad setting of ``fastscale-train`` by its Hydra key, before the run has side effects.

The library's classes validate their own arguments and name them as their signature does
(``bucket_cap_mb=-5 must be ...``); torch's and Lightning's do the same in their words. The
entry point builds every part of the composed config inside `setting_errors`, which turns
such an error into a [`ConfigError`][lightning_fastscale.config_check.ConfigError] naming the Hydra key (``strategy.bucket_cap_mb=-5
must be ...``). ``fastscale-train`` prints a ``ConfigError`` as one line and exits with status 2;
any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig

__all__ = ["ConfigError", "setting_errors", "show", "translate"]

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
    """A setting of the composed config is wrong: the message names its Hydra key, value and fix.

    Raised by ``fastscale-train`` before any side effect (run folder contents, logger, process
    group); its console entry point prints the message as one line, without a traceback.

    Attributes:
        key: the Hydra key, e.g. ``"strategy.bucket_cap_mb"`` (``None`` when no single key is at fault).

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
    nested: list[tuple[str, DictConfig]] = []
    if isinstance(node, DictConfig):
        for key in map(str, node.keys()):
            if key.startswith("_"):  # Hydra's _target_, _partial_
                continue
            try:
                child = node[key]
            except Exception:  # noqa: BLE001 - an interpolation that cannot resolve here
                child = None
            path = f"{prefix}.{key}" if prefix else key
            found[key] = (path, child)
            if isinstance(child, DictConfig):
                nested.append((path, child))
    for path, child in nested:
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


_VALUE = r"""(?:'[^']*'|"[^"]*"|\[[^\]]*\]|[^\s,;:()\[\]`]+)"""
"""A value as a message writes it after ``name=``: quoted, a list, or one word."""


def _mention(leaf: str, assigned: bool) -> str:
    """Regex of ``leaf`` named in a message: ``leaf=value`` (``assigned``), else ``leaf`` alone.

    ``Class.leaf`` counts as ``leaf``. Alone, only a name no prose uses counts: one with an
    underscore or in backquotes (``max_steps``, `` `devices` ``), so ``model`` in "unknown model"
    is not taken for the setting ``model``.
    """
    name = rf"(?<![\w.])(?:\w+\.)?{re.escape(leaf)}"
    if assigned:
        return rf"{name}={_VALUE}"
    if "_" in leaf:
        return rf"{name}(?![\w=])"
    return rf"(?<=`)(?:\w+\.)?{re.escape(leaf)}(?=`)"


def _hydra_literal(written: str) -> str:
    """A Python literal of a message (``True``, ``None``, ``'max-autotune'``) as Hydra writes it."""
    if written in ("True", "False"):
        return written.lower()
    if written == "None":
        return "null"
    if len(written) >= 2 and written[0] == written[-1] and written[0] in "'\"":
        return written[1:-1]
    return written


def translate(error: BaseException, prefix: str, node: Any = None) -> ConfigError:
    """``error`` (a library's refusal of one of its arguments) re-worded with Hydra keys.

    Args:
        error: the exception the library raised (Hydra's instantiation wrapper is looked through).
        prefix: the config group the object was built from, e.g. ``"strategy"``.
        node: that group's config node; the argument named first in the message (as
            ``name=value`` before a bare ``name``) is found among its keys (nested nodes too) and
            replaced by its Hydra key and the configured value, e.g. ``bucket_cap_mb=-5`` (or
            ``HierarchicalAllReduceStrategy.bucket_cap_mb``) by ``strategy.bucket_cap_mb=-5``.
            Other arguments the message names as ``name=value`` get their keys too, their Python
            values written as on the command line (``compile=True`` as ``model.compile=true``).

    Returns:
        A [`ConfigError`][lightning_fastscale.config_check.ConfigError] whose one-line message starts with ``<key>=<value>`` when the
        key is known, else with the group's name.
    """
    error = _root_error(error)
    message = " ".join(str(error).split())  # one line
    leaves = _leaves(node, prefix) if node is not None else {}
    best: tuple[int, str, bool] | None = None
    for assigned in (True, False):
        for leaf in leaves:
            match = re.search(_mention(leaf, assigned), message)
            if match and (best is None or match.start() < best[0]):
                best = (match.start(), leaf, assigned)
        if best is not None:
            break
    fix = ""
    if best is None:
        lowered = message.lower()
        for phrase, leaf, hint in _TORCH_PHRASES:
            if phrase in lowered and leaf in leaves:
                best, fix = (0, leaf, False), hint
                break
    if best is None:
        return ConfigError(f"{prefix}: {message}")
    _, leaf, assigned = best
    key, value = leaves[leaf]
    if assigned:
        message = re.sub(_mention(leaf, True), lambda _: f"{key}={show(value)}", message, count=1)
    elif re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message) is None:
        message = re.sub(rf"(?<![\w.])(?:\w+\.)?{re.escape(leaf)}(?!\w)", key, message, count=1)
    for other, (other_key, _) in leaves.items():
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
def setting_errors(prefix: str, node: Any = None) -> Iterator[None]:
    """Turn a library's refusal of an argument, raised inside the block, into a [`ConfigError`][lightning_fastscale.config_check.ConfigError].

    ``ValueError`` (and Lightning's ``MisconfigurationException``) is the refusal of a value,
    ``FileNotFoundError`` that of a path setting naming no file (``data.root``, ``model.pretrained``); a
    ``TypeError`` counts only when it is about the arguments themselves (an unknown or missing
    keyword), since elsewhere it marks a bug.
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
        raise translate(root, prefix, node) from root
