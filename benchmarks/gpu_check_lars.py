"""CUDA check of ``LARSMixedPrecision`` (the test suite runs on CPU only); prints PASS/FAIL lines.

1. 16-mixed and bf16-mixed in a Trainer on one GPU: the first step equals You et al.'s
   formula computed in float64 from the gradients the plugin saw, through the fused SGD
   path (gradients left unchanged);
2. an inf injected at step 1 skips that step (weights unchanged; 16-mixed: scale halved);
3. fused path == generic path (SGD subclass) over 5 steps on CUDA tensors;
4. ``benchmarks/lars_step.py --device cuda --clock wall``; target: plugin_fused <= 1.25x
   torch SGD and faster than timm's Lars.

    python benchmarks/gpu_check_lars.py            # about a minute on one GPU
    python benchmarks/gpu_check_lars.py --device cpu --repeats 3   # dry run of the logic
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F

from lightning_fastscale.param_groups import split_parameters
from lightning_fastscale.precision import LARSMixedPrecision

LR, ETA, WD = 0.5, 0.02, 1e-2
failures: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


class Module(pl.LightningModule):
    def __init__(self, inject: dict | None = None) -> None:
        super().__init__()
        self.net, self.inject, self.out_dtypes = make_net(), inject or {}, []

    def training_step(self, batch, batch_idx):
        out = self.net(batch[0])
        self.out_dtypes.append(out.dtype)
        return F.cross_entropy(out.float(), batch[1])

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.inject:
            self.net[0].weight.grad[0, 0] = self.inject[self.trainer.global_step]

    def configure_optimizers(self):
        adapted, excluded = split_parameters(self.net)
        return torch.optim.SGD(
            [{"params": [p for _, p in adapted]}, {"params": [p for _, p in excluded], "weight_decay": 0.0}],
            lr=LR, momentum=0.9, weight_decay=WD,
        )


class Recorder(Callback):
    def __init__(self) -> None:
        self.before, self.after, self.grads, self.grads_after, self.skipped = [], [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append([p.detach().clone() for p in pl_module.parameters()])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append([p.detach().clone() for p in pl_module.parameters()])
        self.grads_after.append([p.grad.detach().clone() for p in pl_module.parameters()])
        self.skipped.append(trainer.precision_plugin.last_step_skipped)


def fit(precision: str, device: str, steps: int, inject: dict | None = None):
    gen = torch.Generator().manual_seed(3)
    n = 8 * steps
    ds = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen))
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10) if precision == "16-mixed" else None
    plugin = LARSMixedPrecision(precision, device, eta=ETA, scaler=scaler)
    module, rec = Module(inject), Recorder()
    pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=steps, plugins=[plugin], callbacks=[rec],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
    ).fit(module, torch.utils.data.DataLoader(ds, batch_size=8))
    return module, plugin, rec, scaler


def check_formula(precision: str, device: str) -> None:
    module, plugin, rec, _ = fit(precision, device, steps=1)
    half = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}[precision]
    adapted = {id(p) for _, p in split_parameters(module.net)[0]}
    worst = 0.0
    for p, w0, w1, g in zip(module.parameters(), rec.before[0], rec.after[0], rec.grads[0]):
        w, g64 = w0.double(), g.double()
        if id(p) in adapted:
            wn, gn = float(w.norm()), float(g64.norm())
            ratio = ETA * wn / (gn + WD * wn + 1e-8) if wn > 0 and gn > 0 else 1.0
            expected = w - LR * ratio * (g64 + WD * w)
        else:
            expected = w - LR * g64
        err = float(((w1.double() - expected).abs() / (expected.abs() + 1e-6)).max())
        worst = max(worst, err)
    unchanged = all(torch.equal(a, b) for a, b in zip(rec.grads[0], rec.grads_after[0]))
    fp32 = all(p.dtype == torch.float32 for p in module.parameters())
    report(
        f"{precision} one step == float64 formula ({device})",
        worst < 1e-5 and module.out_dtypes[0] == half and fp32 and unchanged and not rec.skipped[0],
        f"max rel err {worst:.1e}, autocast output {module.out_dtypes[0]}, fused path {unchanged}",
    )


def check_skip(precision: str, device: str) -> None:
    module, plugin, rec, scaler = fit(precision, device, steps=3, inject={1: math.inf})
    still = all(torch.equal(a, b) for a, b in zip(rec.before[1], rec.after[1]))
    moved = not torch.equal(rec.before[2][0], rec.after[2][0])
    scale_ok = scaler is None or scaler.get_scale() == 2.0**9
    report(
        f"{precision} injected inf skips the step ({device})",
        rec.skipped == [False, True, False] and plugin.skipped_steps == 1 and still and moved and scale_ok,
        f"skipped {rec.skipped}, scale {scaler.get_scale() if scaler else None}",
    )


def check_paths(device: str) -> None:
    class SubSGD(torch.optim.SGD):
        pass

    results = []
    for cls in (torch.optim.SGD, SubSGD):
        net = make_net().to(device)
        adapted, excluded = split_parameters(net)
        opt = cls(
            [{"params": [p for _, p in adapted]}, {"params": [p for _, p in excluded], "weight_decay": 0.0}],
            lr=0.3, momentum=0.9, nesterov=True, weight_decay=5e-3,
        )
        plugin = LARSMixedPrecision("32", device, eta=ETA, trust_clip=True)
        plugin.classify(net)
        gen = torch.Generator(device=device).manual_seed(1)
        for _ in range(5):
            for p in net.parameters():
                p.grad = torch.randn(p.shape, generator=gen, device=device)
            plugin.lars_step(opt)
        results.append([copy.deepcopy(p.detach()) for p in net.parameters()])
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*results))
    worst = max(float((a - b).abs().max()) for a, b in zip(*results))
    report(f"fused path == generic path over 5 steps ({device})", close, f"max abs diff {worst:.1e}")


def check_benchmark(device: str, repeats: int) -> None:
    out = Path(tempfile.mkdtemp()) / "lars_step.json"
    cmd = [sys.executable, str(Path(__file__).with_name("lars_step.py")), "--device", device, "--clock", "wall",
           "--repeats", str(repeats), "--json", str(out)]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, timeout=150)
    if proc.returncode != 0:
        report("benchmark ran", False, f"exit {proc.returncode}")
        return
    r = json.loads(out.read_text())["results"]
    fused = r["plugin_fused (ours)"]["ratio"]
    timm = min(v["ratio"] for k, v in r.items() if k.startswith("timm_lars"))
    report(f"plugin_fused <= 1.25x torch SGD ({device})", fused <= 1.25, f"{fused:.2f}x")
    report(f"plugin_fused faster than timm Lars ({device})", fused < timm, f"{fused:.2f}x vs best timm {timm:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        report("CUDA available", False)
        sys.exit(1)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, lightning {pl.__version__}, device {name}", flush=True)
    pl.seed_everything(0, verbose=False)
    for precision in ("16-mixed", "bf16-mixed"):
        check_formula(precision, args.device)
        check_skip(precision, args.device)
    check_paths(args.device)
    check_benchmark(args.device, args.repeats)
    print("ALL PASS" if not failures else f"FAILED: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
