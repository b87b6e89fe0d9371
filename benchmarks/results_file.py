"""Each benchmark's results file, ``benchmarks/results/<script>.json``: what it measured, the command and when.

README.md and benchmarks/README.md quote these files, and ``tests/test_benchmark_figures.py``
checks the quoted figures against them: a rerun whose numbers change fails that test until the
tables (``tables``, as benchmarks/README.md shows them) and the README are brought up to date.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def add_option(parser: argparse.ArgumentParser, script: str) -> None:
    """``--results PATH`` (default ``benchmarks/results/<script>.json``; ``--results ''`` writes none)."""
    parser.add_argument("--results", default=str(RESULTS / f"{script}.json"),
                        help="write the measurements, the command and the date here ('' for no file)")


def write(path: str | Path, report: Any, tables: list[list[str]] | None = None, page: str | None = None) -> None:
    """Write ``report`` (and the markdown ``tables`` printed, line by line) with the command, UTC date and machine;
    ``page``: where the tables are quoted, if not benchmarks/README.md."""
    if not str(path):
        return
    script = os.path.relpath(sys.argv[0], Path(__file__).resolve().parents[1])
    payload = {
        "source": "measured",
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "tables": tables or [],
        "report": report,
        **({"page": page} if page else {}),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(path)
    print(f"results written to {path}")


class _Tee(io.TextIOBase):
    def __init__(self, out: Any) -> None:
        self.out, self.text = out, []

    def write(self, text: str) -> int:
        self.text.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recording(path: str | Path, report: Any, page: str | None = None) -> Iterator[None]:
    """Print as usual inside the block; then write ``report`` and the markdown tables printed to ``path``."""
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    tables: list[list[str]] = [[]]
    for line in "".join(tee.text).splitlines():
        if line.startswith("|"):
            tables[-1].append(line)
        elif tables[-1]:
            tables.append([])
    write(path, report, [t for t in tables if t], page)


def run(main: Any, script: str, page: str | None = None) -> None:
    """Run a script's ``main()`` (which parses the rest of the command line) and record its tables
    and return value in ``--results`` (default ``benchmarks/results/<script>.json``)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_option(parser, script)
    known, rest = parser.parse_known_args()
    argv, sys.argv = sys.argv, [sys.argv[0], *rest]
    if {"-h", "--help"} & set(rest):
        main()
        return
    report: dict[str, Any] = {}
    with recording(known.results, report, page):
        try:
            report["returned"] = main()
        except SystemExit as end:  # a script's own clean exit still records; a failing one does not
            if end.code not in (0, None):
                raise
        finally:
            sys.argv = argv
