"""``benchmarks/gpu_check.py`` without a GPU: every CUDA part is skipped with its reason, exit 0."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path needs a machine without CUDA")
def test_skips_every_cuda_part_cleanly(monkeypatch, capsys) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr("sys.argv", [str(SCRIPT)])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    skips = [line for line in lines if line.startswith("SKIP ")]
    assert len(skips) == 4 and all(line.endswith("CUDA is not available") for line in skips)
    assert not any(line.startswith(("PASS ", "FAIL ")) for line in lines)
    assert "0 PASS, 0 FAIL, 4 SKIP" in lines[-1]
