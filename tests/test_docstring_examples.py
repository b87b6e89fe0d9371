"""Every ``Examples`` block of the package runs and prints what it claims: each module whose
source holds a ``>>>`` line is collected, so a new example cannot go unrun."""
from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import lightning_fastscale

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(lightning_fastscale.__path__, "lightning_fastscale.")
    if ">>>" in Path(importlib.util.find_spec(info.name).origin).read_text()
) + ["lightning_fastscale"]


def test_the_collection_finds_the_examples() -> None:
    assert {"lightning_fastscale.data.transforms", "lightning_fastscale.faults.run_folder_lock",
            "lightning_fastscale.precision.lars"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_pass(name: str) -> None:
    finder = doctest.DocTestFinder()
    module = importlib.import_module(name)
    examples = sum(len(t.examples) for t in finder.find(module))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert examples > 0, f"{name} has a >>> line that doctest does not collect (outside a docstring?)"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
