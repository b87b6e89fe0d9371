"""The end-to-end hook check that benchmarks/gpu_check.py runs on a GPU, run here on CPU tensors."""
from __future__ import annotations

import pytest
import torch

from benchmarks.hook_check import check_hooks, check_hooks_on_cuda

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow  # the same equality is checked per algorithm in test_strategy_trainer.py
def test_hooks_train_to_plain_ddp_weights_on_cpu() -> None:
    report = check_hooks("cpu", cases=[("hier", "fp32"), ("torus2d", "fp32"), ("hier", "fp16")], steps=3)
    assert set(report["cases"]) == {"hier:fp32", "torus2d:fp32", "hier:fp16"}
    for name, case in report["cases"].items():
        assert case["ranks_agree"], name
        assert case["rel_error"] <= case["tolerance"], (name, case)
    # the 16-bit wire really was used: its error is far above fp32's summation-order noise
    assert report["cases"]["hier:fp16"]["rel_error"] > 10 * report["cases"]["hier:fp32"]["rel_error"]
    assert report["status"] == "pass"


def test_cuda_check_skips_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = check_hooks_on_cuda()
    assert report["status"] == "skipped" and "CUDA" in report["reason"]
