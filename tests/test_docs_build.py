"""The documentation builds with ``mkdocs build --strict`` (a broken link, nav entry or API
reference fails the suite), and the built site works in a browser opened from disk, as the README
says (``site/index.html``): headless Chromium renders the home page, a method card and the API
page; navigation links open pages (not directory listings) and no raw reST role is left in the
rendered text. Screenshots land in the test's temporary folder (``DOCS_SCREENSHOTS=DIR`` keeps a
copy)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import matplotlib.image
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"home": "index.html", "card": "methods/lars_mixed_precision.html", "api": "api.html"}
# a reST role that reached the page unrendered, e.g. :class:`Foo` or :py:meth:`bar`
RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|ref|doc):`")
# a markdown cross-reference mkdocstrings did not resolve, e.g. [`Foo`][pkg.Foo]
RAW_XREF = re.compile(r"\]\[[A-Za-z_]\w*(?:\.\w+)+\]")  # "][pkg.Name]": a cross-reference left as text (code like "x[r][i]" is not one)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

needs_mkdocs = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings_handlers.python")),
    reason="mkdocs, mkdocs-material or mkdocstrings[python] is not installed (pip install '.[docs]')",
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (`make setup` installs it: apt-get install chromium)"
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


def test_docstrings_use_markdown_cross_references() -> None:
    # mkdocstrings renders markdown; a reST role in a docstring shows up raw on the API page
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "lightning_fastscale").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if RAW_ROLE.search(line)]
    assert not found, "reST roles in docstrings; write [`Name`][package.path.Name] or `Name`:\n" + "\n".join(found)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@needs_mkdocs
@pytest.mark.timeout(300)
def test_docs_build_strict(site: Path) -> None:
    api = (site / "api.html").read_text()
    for anchor in ("strategies.HierarchicalAllReduceStrategy", "precision.LARSMixedPrecision",
                   "callbacks.BatchSizeRamp", "planner.CostModelPlanner"):
        assert f'id="lightning_fastscale.{anchor}"' in api, f"{anchor} missing from the API page"
    # cross-references between documented objects are links
    assert 'href="#lightning_fastscale.precision.LARSMixedPrecision"' in api
    assert "How it is tested" in (site / PAGES["card"]).read_text()
    # signatures were formatted (a formatter, ruff or black, is installed with the docs extra)
    assert 'class="doc-signature' in api


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.nav: list[str] = []
        self.text: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "a" and "md-nav__link" in (a.get("class") or "") and a.get("href"):
            self.nav.append(a["href"])
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)


def chromium(page: Path, action: str, profile: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--window-size=1280,1600", action, page.as_uri()],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )


@needs_mkdocs
@needs_chromium
@pytest.mark.timeout(300)
def test_site_in_browser(site: Path, tmp_path: Path) -> None:
    runs = {}
    for name, rel in PAGES.items():  # all renders at once, each with a fresh profile
        runs[name, "dom"] = chromium(site / rel, "--dump-dom", Path(tempfile.mkdtemp(dir=tmp_path)))
        runs[name, "png"] = chromium(site / rel, f"--screenshot={tmp_path / name}.png",
                                     Path(tempfile.mkdtemp(dir=tmp_path)))
    out = {key: proc.communicate(timeout=120)[0] for key, proc in runs.items()}
    for key, proc in runs.items():
        assert proc.returncode == 0, f"chromium failed on {key}"
    for name, rel in PAGES.items():
        page = _Links()
        page.feed(out[name, "dom"])
        text = " ".join(page.text)
        assert len(text) > 500, f"{rel}: the browser rendered almost nothing"
        assert not RAW_ROLE.search(text), f"{rel}: raw reST roles: {RAW_ROLE.findall(text)[:5]}"
        assert not RAW_XREF.search(text), f"{rel}: unresolved cross-references: {RAW_XREF.findall(text)[:5]}"
        targets = {urlsplit(href).path for href in page.nav if not urlsplit(href).scheme}
        targets.discard("")  # in-page anchors
        assert len(targets) >= 20, f"{rel}: only {len(targets)} navigation links"
        base = (site / rel).parent
        bad = sorted(t for t in targets if not (base / unquote(t)).resolve().is_file())
        assert not bad, f"{rel}: navigation links that open no page (a directory under file://): {bad}"
    keep = os.environ.get("DOCS_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)

    for name in PAGES:
        png = tmp_path / f"{name}.png"
        pixels = matplotlib.image.imread(png)  # RGB(A) floats in [0, 1]
        assert pixels.shape[:2] == (1600, 1280), f"{png}: {pixels.shape}"
        assert pixels.std() > 0.05, f"{png} is blank"
        if keep:
            shutil.copy(png, Path(keep) / png.name)
    card = _Links()
    card.feed(out["card", "dom"])
    assert "How it is tested" in " ".join(card.text)


def test_readme_links_resolve() -> None:
    # mkdocs checks the links inside docs/; the README is outside it
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if not t.startswith("http")]
    assert targets, "the README links nothing"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
