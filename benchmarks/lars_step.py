"""Time one optimizer step over ResNet-50's parameters: LARS variants against torch SGD.

ResNet-50 (torchvision, random init, no download): 161 parameter tensors, 25.6M values, with
random gradients. Every variant gets the same two parameter groups from the shared rule
(weights with weight decay and LARS; bias/BN with neither), momentum 0.9, weight decay 5e-5.

    variant            what runs
    torch_sgd_foreach  torch.optim.SGD(foreach=True)                      (the baseline)
    lars (ours)        lightning_fastscale.precision.LARS (gradients left unchanged)
    plugin (ours)      LARSMixedPrecision.lars_step around torch SGD foreach: non-finite
                       check, then SGD.step with the rescale and SGD's update in one pass
    timm_lars          timm.optim.Lars with its default (foreach=None: per-tensor loop on CPU)
    timm_lars_foreach  timm.optim.Lars(foreach=True)

Variants run round-robin within each repeat, the order rotated from repeat to repeat, so that
load on the machine and what the previous variant left in memory hit them alike; the table gives medians and the ratio to the baseline's median, all from one process.
``--against REV`` adds ``lars`` and ``plugin`` as of git revision REV (its ``precision/`` and
``param_groups.py`` imported under another name), for a before/after table from one process,
and the median over repeats of each repeat's ratio ours / REV.

    python benchmarks/lars_step.py --repeats 15 --threads 1 [--clock process|wall] [--device cpu|cuda] [--against REV]
"""
from __future__ import annotations

import argparse
import atexit
import copy
import importlib
import io
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import results_file
import timm.optim
import torch
import torchvision

import lightning_fastscale.precision
from lightning_fastscale.param_groups import split_parameters

LR, MOMENTUM, WD, ETA = 0.1, 0.9, 5e-5, 1e-3


def precision_at(rev: str) -> ModuleType:
    """``lightning_fastscale.precision`` as of git revision ``rev``, importable next to today's."""
    root = Path(__file__).resolve().parents[1]
    paths = ["lightning_fastscale/precision", "lightning_fastscale/param_groups.py"]
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, *paths], check=True, capture_output=True).stdout
    where = Path(tempfile.mkdtemp(prefix="lars_step_"))
    atexit.register(shutil.rmtree, where, True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    (where / "lightning_fastscale" / "__init__.py").touch()
    (where / "lightning_fastscale").rename(where / "lightning_fastscale_before")
    sys.path.insert(0, str(where))
    return importlib.import_module("lightning_fastscale_before.precision")


def setup(device: str, against: str | None = None) -> tuple[dict[str, Callable[[], None]], dict]:
    """Build each variant's model copy, gradients and optimizer; return step callables."""
    base = torchvision.models.resnet50(weights=None)
    adapted, excluded = split_parameters(base)
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in base.named_parameters()}
    info = {
        "tensors": len(grads),
        "values": sum(g.numel() for g in grads.values()),
        "adapted_tensors": len(adapted),
        "adapted_values": sum(p.numel() for _, p in adapted),
    }

    def clone() -> tuple[torch.nn.Module, list[torch.Tensor], list[torch.Tensor]]:
        net = copy.deepcopy(base).to(device)
        for n, p in net.named_parameters():
            p.grad = grads[n].to(device)
        a, e = split_parameters(net)
        return net, [p for _, p in a], [p for _, p in e]

    steps: dict[str, Callable[[], None]] = {}

    _, a, e = clone()
    sgd = torch.optim.SGD(
        [{"params": a}, {"params": e, "weight_decay": 0.0}], lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=True
    )
    steps["torch_sgd_foreach"] = sgd.step

    restores = []
    versions = {"ours": lightning_fastscale.precision}
    if against:
        versions[against] = precision_at(against)
    for version, precision in versions.items():
        _, a, e = clone()
        lars = precision.LARS(
            [{"params": a}, {"params": e, "weight_decay": 0.0, "lars": False}],
            lr=LR, momentum=MOMENTUM, weight_decay=WD, eta=ETA,
        )
        steps[f"lars ({version})"] = lars.step

        # the plugin's own step code (non-finite check, LARS, SGD), without a Trainer
        net, a, e = clone()
        inner = torch.optim.SGD(
            [{"params": a}, {"params": e, "weight_decay": 0.0}], lr=LR, momentum=MOMENTUM, weight_decay=WD,
            foreach=True,
        )
        plugin = precision.LARSMixedPrecision("32", device.split(":")[0], eta=ETA)
        plugin.classify(net)
        steps[f"plugin ({version})"] = lambda plugin=plugin, inner=inner: plugin.lars_step(inner)
        all_grads = [p.grad for p in net.parameters()]
        restores.append((all_grads, [g.clone() for g in all_grads]))

    def restore() -> None:  # outside the timed region: the plugins rescale gradients in place
        for grads, saved in restores:
            torch._foreach_copy_(grads, saved)

    steps["_restore_plugin_grads"] = restore

    for name, foreach in (("timm_lars", {}), ("timm_lars_foreach", {"foreach": True})):
        _, a, e = clone()
        # timm adapts every parameter of a group with weight decay != 0 (or always_adapt)
        try:
            opt = timm.optim.Lars(
                [{"params": a, "always_adapt": True}, {"params": e, "weight_decay": 0.0}],
                lr=LR, momentum=MOMENTUM, weight_decay=WD, trust_coeff=ETA, **foreach,
            )
        except TypeError:  # timm releases before its foreach option
            print(f"{name}: skipped, timm {timm.__version__} has no Lars(foreach=...)")
            continue
        steps[name] = opt.step
    return steps, info


def main() -> None:
    """Parse arguments, time every variant round-robin, print the table (and JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--clock", choices=("process", "wall"), default="process",
        help="process: CPU time of this process (robust to other jobs on a shared machine; "
        "use with --threads 1); wall: perf_counter (use on a quiet machine or with CUDA)",
    )
    results_file.add_option(ap, "lars_step")
    ap.add_argument("--against", default=None, help="also time LARS and the plugin as of this git revision")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, info = setup(args.device, args.against)
    restore = steps.pop("_restore_plugin_grads")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for rep in range(args.warmup + args.repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each variant at each position
            step = steps[name]
            restore()
            sync()
            t0 = clock()
            step()
            sync()
            if rep >= args.warmup:
                times[name].append(clock() - t0)
    base = statistics.median(times["torch_sgd_foreach"])
    print(
        f"ResNet-50: {info['tensors']} tensors, {info['values'] / 1e6:.2f}M values "
        f"({info['adapted_tensors']} tensors / {info['adapted_values'] / 1e6:.2f}M adapted by LARS); "
        f"device {args.device}, {torch.get_num_threads()} threads, {args.clock} clock, {args.repeats} repeats, "
        f"torch {torch.__version__}"
    )
    print("| variant | median ms | min ms | ratio to torch SGD foreach |")
    print("|---|---|---|---|")
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_s": med, "min_s": min(ts), "ratio": med / base}
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {med / base:.2f}x |")
    paired = {}
    if args.against:  # within a repeat both versions saw the same load: the ratio of the pair is steadier
        print(f"\n| variant | median of per-repeat ratios ours / {args.against} |\n|---|---|")
        for kind in ("lars", "plugin"):
            ours, before = times[f"{kind} (ours)"], times[f"{kind} ({args.against})"]
            paired[kind] = statistics.median(a / b for a, b in zip(ours, before))
            print(f"| {kind} | {paired[kind]:.3f} |")
    results_file.write(args.results, {"info": info, "args": vars(args), "results": rows, "paired": paired})


if __name__ == "__main__":
    main()
