"""The documentation builds with ``mkdocs build --strict``: a broken link, nav entry or API
reference (a renamed class, a malformed docstring) fails the suite."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

needs_mkdocs = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings_handlers.python")),
    reason="mkdocs, mkdocs-material or mkdocstrings[python] is not installed (pip install '.[docs]')",
)


def nav_files(entries: list) -> list[str]:
    files: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        files.extend(nav_files(value) if isinstance(value, list) else [value])
    return files


def test_every_method_card_is_in_the_nav() -> None:
    # mkdocs only reports pages left out of the nav at INFO level, so check it here
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(nav_files(config["nav"]))
    cards = {f"methods/{p.name}" for p in (ROOT / "docs" / "methods").glob("*.md")}
    assert cards and cards <= listed, f"method cards missing from mkdocs.yml nav: {sorted(cards - listed)}"


@needs_mkdocs
@pytest.mark.timeout(300)
def test_docs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for anchor in ("strategies.HierarchicalAllReduceStrategy", "precision.LARSMixedPrecision",
                   "callbacks.BatchSizeRamp", "planner.CostModelPlanner"):
        assert f'id="lightning_fastscale.{anchor}"' in api, f"{anchor} missing from the API page"
    card = (tmp_path / "site" / "methods" / "lars_mixed_precision" / "index.html").read_text()
    assert "How it is tested" in card


def test_readme_links_resolve() -> None:
    # mkdocs checks the links inside docs/; the README is outside it
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if not t.startswith("http")]
    assert targets, "the README links nothing"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
