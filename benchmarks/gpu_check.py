"""The prepared device check (the test suite runs on CPU only); prints PASS/FAIL/SKIP lines and a table.

1. communication hooks on CUDA tensors: 4 ranks sharing the one GPU over gloo (NCCL refuses two
   ranks on one device), hierarchical / 2D-torus / flat hooks trained against plain DDP
   (``benchmarks/hook_check.py``, ``check_hooks_on_cuda``);
2. ``LARSMixedPrecision`` on the GPU: 16-mixed and bf16-mixed first step equal to the float64
   formula, an injected inf skips the step (16-mixed: scale halved), the plugin around SGD ==
   the ``LARS`` optimizer over 5 steps, then ``benchmarks/lars_step.py --device cuda --clock
   wall``: targets LARS <= 1.15x and the plugin <= 1.25x torch's foreach SGD step;
3. ResNet-50 training images/s, bf16 autocast, channels-last, cuDNN benchmark mode, synthetic
   data on the device: ``ImageClassifier`` in a Lightning Trainer against a plain loop in the
   style of timm's ``benchmark.py`` (same network factory, batch, optimizer and settings), in
   the same run; target within 5 %;
4. nvJPEG batched decode images/s against one CPU thread of libjpeg-turbo, and their agreement.

Without CUDA every part prints SKIP with the reason and the script exits 0.

    python benchmarks/gpu_check.py                     # under 4 minutes on one GPU
    python benchmarks/gpu_check.py --device cpu --parts lars resnet --model resnet_small \
        --batch 8 --steps 4 --warmup 1 --repeats 3     # the logic, on a CPU
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
from lightning_fastscale.precision import LARS, LARSMixedPrecision

LR, ETA, WD = 0.5, 0.02, 1e-2
failures: list[str] = []
table: list[tuple[str, str, str]] = []
passes = [0]


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if ok:
        passes[0] += 1
    else:
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
    fp32 = all(p.dtype == torch.float32 for p in module.parameters())
    report(
        f"{precision} one step == float64 formula ({device})",
        worst < 1e-5 and module.out_dtypes[0] == half and fp32 and not rec.skipped[0],
        f"max rel err {worst:.1e}, autocast output {module.out_dtypes[0]}",
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
    results = []
    for kind in ("plugin", "lars"):
        net = make_net().to(device)
        adapted, excluded = split_parameters(net)
        groups = [{"params": [p for _, p in adapted]}, {"params": [p for _, p in excluded], "weight_decay": 0.0}]
        kw = dict(lr=0.3, momentum=0.9, nesterov=True, weight_decay=5e-3)
        if kind == "lars":
            opt = LARS(groups, eta=ETA, trust_clip=True, **kw)
        else:
            opt = torch.optim.SGD(groups, **kw)
            plugin = LARSMixedPrecision("32", device, eta=ETA, trust_clip=True)
            plugin.classify(net)
        gen = torch.Generator(device=device).manual_seed(1)
        for _ in range(5):
            for p in net.parameters():
                p.grad = torch.randn(p.shape, generator=gen, device=device)
            opt.step() if kind == "lars" else plugin.lars_step(opt)
        results.append([copy.deepcopy(p.detach()) for p in net.parameters()])
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*results))
    worst = max(float((a - b).abs().max()) for a, b in zip(*results))
    report(f"plugin around SGD == LARS optimizer over 5 steps ({device})", close, f"max abs diff {worst:.1e}")


def check_benchmark(device: str, repeats: int, timeout_s: float = 150.0) -> None:
    out = Path(tempfile.mkdtemp()) / "lars_step.json"
    cmd = [sys.executable, str(Path(__file__).with_name("lars_step.py")), "--device", device, "--clock", "wall",
           "--repeats", str(repeats), "--json", str(out)]
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        report("lars_step.py ran", False, f"still running after {timeout_s} s")
        return
    if proc.returncode != 0:
        report("lars_step.py ran", False, f"exit {proc.returncode}")
        return
    r = json.loads(out.read_text())["results"]
    optimizer = r["lars (ours)"]["ratio"]
    plugin = r["plugin (ours)"]["ratio"]
    timm = min(v["ratio"] for k, v in r.items() if k.startswith("timm_lars"))
    report(f"LARS optimizer step <= 1.15x torch SGD foreach ({device})", optimizer <= 1.15, f"{optimizer:.2f}x")
    report(f"LARS plugin step <= 1.25x torch SGD foreach ({device})", plugin <= 1.25, f"{plugin:.2f}x")
    report(f"LARS optimizer faster than timm Lars ({device})", optimizer < timm, f"{optimizer:.2f}x vs best timm {timm:.2f}x")
    table.append(("LARS optimizer step / torch SGD", f"{optimizer:.2f}x", "<= 1.15x"))
    table.append(("LARS plugin step / torch SGD", f"{plugin:.2f}x", "<= 1.25x"))


def check_lars(device: str, repeats: int) -> None:
    pl.seed_everything(0, verbose=False)
    for precision in ("16-mixed", "bf16-mixed"):
        check_formula(precision, device)
        check_skip(precision, device)
    check_paths(device)
    check_benchmark(device, repeats)


def check_hooks() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hook_check import check_hooks_on_cuda

    result = check_hooks_on_cuda(world_size=4, ranks_per_node=2, timeout_s=150)
    for case, r in result["cases"].items():
        report(f"hook {case} on CUDA tensors == plain DDP (4 ranks, 2 per node, gloo)", r["ok"],
               f"rel error {r['rel_error']:.1e} (tolerance {r['tolerance']:.0e}), ranks agree {r['ranks_agree']}")
        table.append((f"hook {case} vs DDP, relative weight error", f"{r['rel_error']:.1e}", f"<= {r['tolerance']:.0e}"))
    if result["status"] == "skipped":
        skip("hooks on CUDA tensors", result["reason"])


class _SyntheticBatches(torch.utils.data.IterableDataset):
    """The same device-resident batch every step, as timm's benchmark.py feeds its model."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.batch


def check_resnet(device: str, model_name: str, batch_size: int, steps: int, warmup: int) -> None:
    """images/s of ImageClassifier + Trainer and of a plain loop, bf16 autocast, channels-last."""
    import time

    from lightning_fastscale.models import create_model
    from lightning_fastscale.module import ImageClassifier, default_optimizer

    torch.backends.cudnn.benchmark = True
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, 224, 224, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch_size,), generator=gen).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    # the plain loop (timm benchmark.py's TrainBenchmarkRunner, in outline)
    torch.manual_seed(0)
    net = create_model(model_name, 1000).to(device).to(memory_format=torch.channels_last).train()
    opt = default_optimizer(net.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for step in range(warmup + steps):
        if step == warmup:
            sync()
            t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    plain = steps * batch_size / (time.perf_counter() - t0)
    del net, opt

    class Clock(Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == warmup - 1:
                sync()
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module) -> None:
            sync()
            self.t1 = time.perf_counter()

    torch.manual_seed(0)
    module = ImageClassifier(model_name, num_classes=1000, channels_last=True)
    clock = Clock()
    loader = torch.utils.data.DataLoader(_SyntheticBatches((x, y), warmup + steps), batch_size=None)
    pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision="bf16-mixed", benchmark=True,
        max_steps=warmup + steps, callbacks=[clock], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tempfile.mkdtemp(),
    ).fit(module, loader)
    lightning = steps * batch_size / (clock.t1 - clock.t0)
    ratio = lightning / plain
    report(f"{model_name} bf16 ImageClassifier+Trainer within 5 % of the plain loop ({device})", ratio >= 0.95,
           f"{lightning:.4g} vs {plain:.4g} images/s ({ratio:.3f}x), batch {batch_size}, {steps} timed steps")
    table.append((f"{model_name} bf16 images/s, plain loop", f"{plain:.4g}", ""))
    table.append((f"{model_name} bf16 images/s, ImageClassifier + Trainer", f"{lightning:.4g}", f"{ratio:.3f}x, >= 0.95x"))


def _jpeg_batch(count: int, height: int = 375, width: int = 500, seed: int = 0) -> list[torch.Tensor]:
    """``count`` ImageNet-sized JPEGs (quality 90) with texture and noise, encoded on the CPU."""
    from torchvision.io import encode_jpeg

    g = torch.Generator().manual_seed(seed)
    images = []
    for _ in range(count):
        coarse = torch.rand(3, height // 16, width // 16, generator=g)
        smooth = F.interpolate(coarse[None], size=(height, width), mode="bilinear", align_corners=False)[0]
        noisy = (smooth * 200 + torch.rand(3, height, width, generator=g) * 55).clamp(0, 255)
        images.append(encode_jpeg(noisy.to(torch.uint8), quality=90))
    return images


def check_decode(batch: int = 64, rounds: int = 5) -> None:
    """Batched nvJPEG decode (``decode_jpeg_batch_on_device``) vs libjpeg-turbo on one CPU thread."""
    import time

    from lightning_fastscale.data.jpeg_decode import decode_jpeg_batch_on_device, decode_rgb

    datas = _jpeg_batch(batch)
    cpu = [decode_rgb(d) for d in datas]
    gpu = decode_jpeg_batch_on_device(datas)  # warm-up (nvJPEG handles, allocations)
    worst = max((a.float() - b.cpu().float()).abs().mean().item() for a, b in zip(cpu, gpu))
    report("nvJPEG decode agrees with the CPU decode", worst < 2.0, f"worst mean |diff| {worst:.3f} levels")
    times = {"cpu": [], "gpu": []}
    for _ in range(rounds):
        start = time.perf_counter()
        for d in datas:
            decode_rgb(d)
        times["cpu"].append(time.perf_counter() - start)
        torch.cuda.synchronize()
        start = time.perf_counter()
        decode_jpeg_batch_on_device(datas)
        torch.cuda.synchronize()
        times["gpu"].append(time.perf_counter() - start)
    cpu_rate, gpu_rate = (batch / sorted(t)[len(t) // 2] for t in (times["cpu"], times["gpu"]))
    table.append(("JPEG decode images/s, CPU (one core)", f"{cpu_rate:.4g}", "500x375, quality 90"))
    table.append(("JPEG decode images/s, nvJPEG batch", f"{gpu_rate:.4g}", f"{gpu_rate / cpu_rate:.2f}x CPU"))


def skip(name: str, reason: str) -> None:
    print(f"SKIP {name}: {reason}", flush=True)
    table.append((name, "skipped", reason))


PARTS = ("hooks", "lars", "resnet", "decode")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--repeats", type=int, default=30, help="lars_step.py repeats")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30, help="timed training steps per side")
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "no CUDA device"
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {name}", flush=True)
    missing = "CUDA is not available" if args.device == "cuda" and not cuda else None
    for part in args.parts:
        if part in ("hooks", "decode") and not cuda:
            skip({"hooks": "hooks on CUDA tensors", "decode": "nvJPEG decode"}[part], "CUDA is not available")
        elif part in ("lars", "resnet") and missing:
            skip({"lars": "LARS on the device", "resnet": f"{args.model} bf16 training images/s"}[part], missing)
        elif part == "hooks":
            check_hooks()
        elif part == "lars":
            check_lars(args.device, args.repeats)
        elif part == "resnet":
            check_resnet(args.device, args.model, args.batch, args.steps, args.warmup)
        else:
            check_decode()
    print("| check | value | target |")
    print("|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    skipped = sum(1 for row in table if row[1] == "skipped")
    print(f"{passes[0]} PASS, {len(failures)} FAIL, {skipped} SKIP" + (f": failed {failures}" if failures else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    import results_file

    results_file.run(main, "gpu_check")
