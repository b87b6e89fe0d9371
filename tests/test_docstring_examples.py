"""The ``Examples`` blocks of the package, the callbacks and the shared helpers run and print
what they claim."""
from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "lightning_fastscale",
    "lightning_fastscale._validation",
    "lightning_fastscale.callbacks._schedule",
    "lightning_fastscale.callbacks.batch_size_ramp",
    "lightning_fastscale.callbacks.lr_schedule",
    "lightning_fastscale.callbacks.progressive_resizing",
    "lightning_fastscale.callbacks.label_smoothing",
    "lightning_fastscale.param_groups",
    "lightning_fastscale.callbacks.zero_init_residual_bn",
    "lightning_fastscale.callbacks.ghost_batch_norm",
    "lightning_fastscale.diagnostics.step_breakdown",
    "lightning_fastscale.diagnostics.step_timer",
    "lightning_fastscale.diagnostics.step_breakdown_callback",
    "lightning_fastscale.exit_codes",
    "lightning_fastscale.checkpoint_io",
    "lightning_fastscale.run_folder",
    "lightning_fastscale.strategies.planning",
    "lightning_fastscale.strategies.option_checks",
    "lightning_fastscale.strategies.plan_resolution",
    "lightning_fastscale.strategies.node_checks",
    "lightning_fastscale.strategies.plan_report",
    "lightning_fastscale.strategies.topk_residuals",
    "lightning_fastscale.strategies.user_hooks",
    "lightning_fastscale.diagnostics.doctor",
    "lightning_fastscale.diagnostics.doctor_cli",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_pass(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no Examples block"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
