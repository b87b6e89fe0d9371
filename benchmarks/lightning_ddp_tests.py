"""Run Lightning's own DDP strategy tests with ``DDPStrategy`` replaced by the hierarchical strategy.

Needs a git checkout of Lightning (github.com/Lightning-AI/pytorch-lightning). The script copies
``tests/tests_<suite>/{__init__,conftest}.py``, ``helpers/`` and ``strategies/test_ddp*.py`` (and
the few modules those import) at ``--ref`` out of it (``git archive``) into a temporary folder.
In ``--mode hier`` it rewrites the tests' ``DDPStrategy`` import to a subclass of
``HierarchicalAllReduceStrategy`` (``--suite pytorch``, the Trainer's) or of
``FabricHierarchicalAllReduceStrategy`` (``--suite fabric``) with one rank per emulated node
(``ranks_per_node=1``, so with two processes the hierarchical hook is really installed), and
points Lightning's registered DDP names (``"ddp"``, ``"ddp_spawn"``, ...) at that class.
``--mode lightning`` runs the same copy unchanged, the baseline. Nothing of Lightning's is kept
in this repository. Prints each test's outcome and the counts; results are in
benchmarks/README.md.

    python benchmarks/lightning_ddp_tests.py --lightning-repo PATH --ref 2.6.5 --mode lightning
    python benchmarks/lightning_ddp_tests.py --lightning-repo PATH --ref 2.6.5 --mode hier
    python benchmarks/lightning_ddp_tests.py --lightning-repo PATH --ref 2.6.5 --mode hier --suite fabric
"""
from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

SUITES = {
    # suite: (Lightning package, its registry, our class, extra test modules the DDP tests import)
    "pytorch": ("lightning.pytorch.strategies", "StrategyRegistry", "HierarchicalAllReduceStrategy", ()),
    "fabric": ("lightning.fabric.strategies", "STRATEGY_REGISTRY", "FabricHierarchicalAllReduceStrategy",
               ("test_fabric.py", "strategies/test_single_device.py")),
}

SUBSTITUTE = '''"""DDPStrategy for Lightning's tests: {ours}, one rank per emulated node."""
from {package} import DDPStrategy as _LightningDDPStrategy
from {package} import {registry} as _registry

from lightning_fastscale.strategies import {ours}


class DDPStrategy({ours}):
    def __init__(self, ranks_per_node=1, **kwargs):
        super().__init__(ranks_per_node=ranks_per_node, **kwargs)


for _entry in _registry.values():  # "ddp", "ddp_spawn", "ddp_fork", ... -> the substitute
    if _entry["strategy"] is _LightningDDPStrategy:
        _entry["strategy"] = DDPStrategy
'''


def _members(repo: Path, ref: str, suite: str) -> list[str]:
    listing = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "-r", "--name-only", ref, f"tests/tests_{suite}"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    extra = "|".join(re.escape(m) for m in SUITES[suite][3])
    keep = re.compile(
        rf"tests/tests_{suite}/(__init__\.py|conftest\.py|helpers/.*|strategies/test_ddp[^/]*\.py{'|' + extra if extra else ''})$")
    return [m for m in listing if keep.match(m)] + ["pyproject.toml"]


def make_copy(repo: Path, ref: str, mode: str, dest: Path, suite: str = "pytorch") -> list[Path]:
    """Extract the tests at ``ref`` into ``dest`` and patch them for ``mode``; return the test files."""
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", ref, *_members(repo, ref, suite)],
        check=True, capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    root = dest / f"tests/tests_{suite}"
    tests = sorted((root / "strategies").glob("test_ddp*.py"))
    (root / "strategies/__init__.py").touch()
    if mode == "hier":
        package, registry, ours, _ = SUITES[suite]
        (dest / "tests/_fastscale_substitute.py").write_text(
            SUBSTITUTE.format(package=package, registry=registry, ours=ours))
        conftest = root / "conftest.py"
        conftest.write_text("import _fastscale_substitute  # noqa: F401\n" + conftest.read_text())
        pattern = re.compile(rf"^from {re.escape(package)} import DDPStrategy$", re.MULTILINE)
        for test in tests:
            if "DDPStrategy" not in test.read_text():
                continue  # uses the registered names only
            text, count = pattern.subn("from _fastscale_substitute import DDPStrategy", test.read_text())
            if not count:
                raise SystemExit(f"{test.name}: the DDPStrategy import to replace was not found")
            test.write_text(text)
    return tests


def run(repo: Path, ref: str, mode: str, pytest_args: list[str], package_root: Path,
        suite: str = "pytorch") -> dict[str, str]:
    """Run the copied tests; return test id -> passed / failed / skipped."""
    with tempfile.TemporaryDirectory(prefix=f"lightning-ddp-{mode}-") as tmp:
        root = Path(tmp)
        tests = make_copy(repo, ref, mode, root, suite)
        report = root / "report.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(package_root), os.environ.get("PYTHONPATH", "")]))
        subprocess.run(
            [sys.executable, "-m", "pytest", "-c", str(root / "pyproject.toml"), "--rootdir", str(root),
             "-p", "no:cacheprovider", f"--junitxml={report}", "-q",
             *[str(t.relative_to(root / "tests")) for t in tests], *pytest_args],
            cwd=root / "tests", env=env, check=False,
        )
        outcomes: dict[str, str] = {}
        for case in ET.parse(report).iter("testcase"):
            kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            outcomes[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed", "error": "failed"}.get(
                kind, kind)
        return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightning-repo", type=Path, required=True, help="a git checkout of Lightning")
    parser.add_argument("--ref", default="2.6.5", help="tag or commit of the tests (default 2.6.5)")
    parser.add_argument("--mode", choices=["lightning", "hier"], default="hier")
    parser.add_argument("--suite", choices=list(SUITES), default="pytorch",
                        help="Lightning's Trainer tests (tests_pytorch) or Fabric's (tests_fabric)")
    parser.add_argument("--package-root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="where lightning_fastscale is imported from (default: this checkout)")
    args, pytest_args = parser.parse_known_args()
    outcomes = run(args.lightning_repo, args.ref, args.mode, pytest_args, args.package_root, args.suite)
    for test, outcome in sorted(outcomes.items()):
        print(f"{outcome:8} {test}")
    ran = {t: o for t, o in outcomes.items() if o != "skipped"}
    passed = sum(o == "passed" for o in ran.values())
    print(f"{args.suite} {args.mode} @ {args.ref}: {passed} of {len(ran)} run passed, "
          f"{len(outcomes) - len(ran)} skipped (need CUDA / standalone / older torch)")


if __name__ == "__main__":
    import results_file

    results_file.run(main, "lightning_ddp_tests")
