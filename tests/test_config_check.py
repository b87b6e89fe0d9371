"""``config_check.translate``: a library's refusal, worded with its own argument names, named by Hydra key."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lightning_fastscale.config_check import ConfigError, setting_errors, translate

MODEL = OmegaConf.create({
    "_target_": "lightning_fastscale.ImageClassifier", "model": "alexnet_bn",
    "model_kwargs": {"dropout": 1.0}, "compile": False, "compile_mode": "max-autotune",
})


@pytest.mark.parametrize(
    ("message", "key", "expected"),
    [
        # name=value: the Hydra key with the configured value, other name=value with Hydra literals
        ("compile_mode='max-autotune' has no effect without compile=True", "model.compile_mode",
         "model.compile_mode=max-autotune has no effect without model.compile=true"),
        # a nested key; Class.name counts as name
        ("AlexNetBN.dropout=1.0 must be in [0, 1)", "model.model_kwargs.dropout",
         "model.model_kwargs.dropout=1.0 must be in [0, 1)"),
        # name=value is preferred to an earlier bare mention
        ("compile_mode is checked: compile=False", "model.compile", "model.compile=false: compile_mode is checked: model.compile=false"),
        # a bare name only with an underscore or in backquotes, never a prose word
        ("`compile` needs torch 2", "model.compile", "model.compile=false: `model.compile` needs torch 2"),
        ("unknown model 'x'", None, "model: unknown model 'x'"),
    ],
)
def test_translate_names_the_hydra_key(message, key, expected):
    error = translate(ValueError(message), "model", MODEL)
    assert (error.key, str(error)) == (key, expected)


def test_torch_phrases_name_the_setting_and_the_fix():
    optimizer = OmegaConf.create({"_target_": "torch.optim.SGD", "lr": -1})
    error = translate(ValueError("Invalid learning rate: -1"), "optimizer", optimizer)
    assert error.key == "optimizer.lr" and str(error).startswith("optimizer.lr=-1: Invalid learning rate: -1; use a")


def test_setting_errors_turns_refusals_into_config_errors_and_keeps_bugs():
    with pytest.raises(ConfigError, match=r"^model.compile_mode=max-autotune is bad$"):
        with setting_errors("model", MODEL):
            raise ValueError("compile_mode='max-autotune' is bad")
    with pytest.raises(ConfigError, match=r"^model: no such file"):
        with setting_errors("model", MODEL):
            raise FileNotFoundError("no such file")
    with pytest.raises(TypeError, match="unsupported operand"):  # a bug keeps its type and traceback
        with setting_errors("model", MODEL):
            raise TypeError("unsupported operand type(s)")
