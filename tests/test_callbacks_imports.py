"""The callback modules import each other without a cycle (function-level imports included),
and the shared schedule helpers live in one private module that the schedules use."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_fastscale" / "callbacks"
PREFIX = "lightning_fastscale.callbacks."


def imported_siblings(path: Path) -> set[str]:
    """Modules of ``lightning_fastscale.callbacks`` that ``path`` imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            name = node.module if node.level == 0 else PREFIX + node.module
            if name.startswith(PREFIX):
                found.add(name.removeprefix(PREFIX).split(".")[0])
    return found


def test_callback_modules_import_without_a_cycle() -> None:
    graph = {p.stem: imported_siblings(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert graph["lr_schedule"] >= {"_schedule"} and "lr_schedule" not in graph["batch_size_ramp"]

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        for nxt in graph.get(module, ()):
            visit(nxt, (*path, module))

    for module in graph:
        visit(module, ())


def test_schedules_share_the_private_helpers() -> None:
    for module in ("batch_size_ramp", "progressive_resizing", "lr_schedule"):
        assert "_schedule" in imported_siblings(PACKAGE / f"{module}.py"), module
