"""Initial weights from a local file (a ``state_dict`` or a Lightning checkpoint), for fine-tuning."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

__all__ = ["load_pretrained_weights"]

# ImageClassifier's ``model``, and the prefixes torch.compile / DDP add to names
_PREFIXES = ("model.", "_orig_mod.", "module.")


def _network_state(state: Mapping[str, torch.Tensor], own: set[str]) -> dict[str, torch.Tensor] | None:
    """The part of ``state`` named like ``own``, after removing wrapper prefixes (or None)."""
    if own & state.keys():
        return dict(state)
    for prefix in _PREFIXES:
        # a Lightning checkpoint may hold more than the network beside "model."
        inner = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        found = _network_state(inner, own) if inner else None
        if found is not None:
            return found
    return None


def load_pretrained_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load the weights in ``path`` (a ``state_dict`` or checkpoint) into ``model`` in place and return it.

    Tensors of another shape (a new head) keep their fresh initialisation; ``docs/hydra.md``.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"pretrained={str(path)!r}: no such file; give a state_dict or checkpoint path, "
            "True for the library's weights, or False for random initialisation"
        )
    loaded = torch.load(file, map_location="cpu", weights_only=False)
    if isinstance(loaded, nn.Module):
        loaded = loaded.state_dict()
    if isinstance(loaded, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(loaded.get(key), Mapping):
                loaded = loaded[key]
                break
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"pretrained={str(path)!r} holds no state_dict of tensors")
    own = model.state_dict()
    state = _network_state(loaded, set(own)) or dict(loaded)
    reshaped = sorted(k for k, v in state.items() if k in own and own[k].shape != v.shape)
    state = {k: v for k, v in state.items() if k not in reshaped}
    missing = sorted(set(own) - state.keys() - set(reshaped))
    unexpected = sorted(state.keys() - set(own))
    if missing or unexpected:
        raise ValueError(
            f"pretrained={str(path)!r} does not fit this model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}{' ...' if len(missing) > 5 or len(unexpected) > 5 else ''}; check the model's "
            "name and arguments against the model the weights came from"
        )
    model.load_state_dict(state, strict=False)
    rank_zero_info(
        f"pretrained: loaded {len(state)} tensors from {file}"
        + (f"; kept the fresh initialisation of {', '.join(reshaped)} (shape differs)" if reshaped else "")
    )
    return model
