"""Large-batch accuracy study: the literature's ablation, at small scale, in one command.

Goyal et al. 2017, You et al. 2017 (LARS), Jia et al. 2018 (Tencent) and Mikami et al. 2018
(Sony) all show the same table: at a batch one to two orders of magnitude larger, plain
linearly-scaled SGD loses accuracy at the same number of epochs, and the recipe (warmup,
LARS, label smoothing, no weight decay on bias/BN, zero-init residual BN, batch-size control)
wins it back. This script reproduces that table on the built-in procedural dataset with a
small ResNet, at a fixed number of epochs. Each arm is a Hydra preset, so any row can be
rerun on its own with ``fastscale-train experiment=convergence_<arm>``:

1. ``convergence_baseline``: batch B0 = 16, SGD, LR picked by a small sweep (``--baseline-lrs``);
2. ``convergence_linear_scaling``: batch 32 x B0 = 512, LR x 32, no warmup;
3. ``convergence_warmup``: + gradual warmup;
4. ``convergence_lars``: + LARS through ``LARSMixedPrecision`` (bf16 autocast on CPU), at
   ``LARS_LR_FACTOR`` = 2 x the baseline's LR (LARS's trust ratio bounds each layer's step);
5. ``convergence_recipe``: + label smoothing, no weight decay on bias/BN, zero-init residual BN;
6. ``convergence_full``: + batch-size ramp 128 -> 256 -> 512 (same final batch);
7. ``convergence_ghost_bn``: + BN statistics over groups of B0 = 16 samples (ghost batch norm),
   as the 32 workers of batch 16 that batch 512 stands for would compute them.

All arms train 16 epochs; warmup lasts 5 epochs, the ramp steps at epochs 6 and 10 (the settings
compared are in benchmarks/README.md).

With 8192 training images the large batch takes 16 optimizer steps per epoch, the regime of
batch 64K on ImageNet (about 20). The sweep runs first; the large-batch arms then scale the
winning LR. Every sample of the procedural dataset is a pure function of (seed, split,
index, resolution), so each worker process renders the splits once and reuses them for all
arms: identical data to ``fastscale-train``, without re-rendering every epoch.

Output (``--output-dir``, default ``benchmarks/results/convergence/``): ``results.csv``,
``results.json`` (rows, per-epoch curves, the sweep, machine load) and ``convergence.png``
(validation top-1 vs epoch per arm). ``--quick`` runs every arm for 2 tiny epochs (a smoke
test, seconds; tests/test_convergence_quick.py). Full study, 2 CPU cores (the LR sweep of four
baseline runs, then six arms), and the seven arms alone at a fixed baseline LR and seed:

    .venv/bin/python benchmarks/convergence.py --jobs 2
    .venv/bin/python benchmarks/convergence.py seed=1 --jobs 2 --baseline-lrs 0.2   # overrides before --baseline-lrs
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "lightning_fastscale" / "conf"

# (arm, experiment preset, what it adds), in the order of the ablation.
ARMS: list[tuple[str, str, str]] = [
    ("1_baseline", "convergence_baseline", "batch B0, tuned SGD LR"),
    ("2_linear_scaling", "convergence_linear_scaling", "32 x B0, LR x 32, no warmup"),
    ("3_warmup", "convergence_warmup", "+ gradual warmup"),
    ("4_lars", "convergence_lars", "+ LARS (bf16 LARSMixedPrecision) at 2x the LR"),
    ("5_recipe", "convergence_recipe", "+ label smoothing, no WD bias/BN, zero-init BN"),
    ("6_full", "convergence_full", "+ batch-size ramp"),
    ("7_ghost_bn", "convergence_ghost_bn", "+ per-worker BN over 16 (ghost BN; full recipe)"),
]
DEFAULT_BASELINE_LRS = (0.05, 0.1, 0.2, 0.4)
# LARS bounds each layer's step by its trust ratio, which is what lets it take a larger global
# LR than plain SGD (You et al. 2017 scale LARS's LR beyond the linear rule). Arms 4-7 run at
# this multiple of the baseline's LR; the settings compared are in benchmarks/README.md.
LARS_LR_FACTOR = 2.0
LARS_ARMS = ("4_lars", "5_recipe", "6_full", "7_ghost_bn")


def arm_lr(arm: str, base_lr: float) -> float:
    """The LR at B0 an arm runs at, given the baseline's (its linear scaling starts from it)."""
    return base_lr * LARS_LR_FACTOR if arm in LARS_ARMS else base_lr


class PrerenderedSplit(Dataset):
    """A :class:`ProceduralShapes` split rendered once into memory.

    The procedural samples are deterministic in (seed, split, index, resolution), so this
    serves exactly the samples the original would, without rendering each epoch again.
    """

    def __init__(self, source: Any) -> None:
        self.resolution = source.resolution
        # in chunks: rendering holds several (batch, R, R) temporaries
        self.images = torch.cat([source.render(list(range(i, min(i + 1024, len(source)))))
                                 for i in range(0, len(source), 1024)])
        self.labels = torch.tensor([source.label(i) for i in range(len(source))])

    def set_resolution(self, resolution: int) -> None:
        """Accept only the rendered resolution (the study uses no progressive resizing)."""
        if resolution != self.resolution:
            raise ValueError(f"pre-rendered at {self.resolution} px; {resolution} px was asked for")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        index = torch.as_tensor(indices)
        return list(zip(self.images[index], self.labels[index].tolist()))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


_RENDERED: dict[tuple, PrerenderedSplit] = {}


def _prerender(datamodule: Any) -> None:
    """Swap the datamodule's procedural splits for rendered copies, shared across arms."""
    for attr in ("train_set", "val_set"):
        ds = getattr(datamodule, attr)
        key = (ds.num_classes, ds.size, ds.resolution, ds.seed, ds.split, ds.noise, ds.clutter, ds.normalize)
        if key not in _RENDERED:
            _RENDERED[key] = PrerenderedSplit(ds)
        setattr(datamodule, attr, _RENDERED[key])


def compose_arm(preset: str, overrides: list[str], output_dir: Path) -> Any:
    """The composed ``fastscale-train experiment=<preset>`` config, ready for ``build``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={preset}", "logger=none", *overrides],
                      return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg


def quick_overrides(preset: str) -> list[str]:
    """Tiny data, model and epochs for the smoke test; same arms and techniques."""
    out = [
        "data.train_size=512", "data.val_size=128", "data.resolution=16",
        "model.model_kwargs.widths=[8,16,32]", "trainer.max_epochs=2",
    ]
    if preset not in ("convergence_baseline", "convergence_linear_scaling"):
        out.append("callbacks.warmup_decay_lr.warmup_epochs=1")
    return out


# --quick ramps within its 2 epochs (set after composing: Hydra overrides merge dicts).
QUICK_RAMP = {0: 256, 1: 512}


def run_arm(job: dict[str, Any]) -> dict[str, Any]:
    """Train one arm; return its row and per-epoch validation curve."""
    import lightning.pytorch as pl

    import lightning_fastscale  # noqa: F401  (registers models)
    from lightning_fastscale.train import build

    torch.set_num_threads(job["threads"])
    out_dir = Path(job["output_dir"]) / "runs" / job["name"]
    cfg = compose_arm(job["preset"], job["overrides"], out_dir)
    if job["quick"] and "batch_size_ramp" in cfg.callbacks:
        cfg.callbacks.batch_size_ramp.schedule = QUICK_RAMP
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, module, trainer = build(cfg)
    _prerender(datamodule)
    curve: list[dict[str, float]] = []
    lrs: list[float] = []

    class _Record(pl.Callback):
        # appended after the preset's callbacks, so it sees the LR WarmupDecayLR set
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
            lrs.append(float(optimizer.param_groups[0]["lr"]))

        def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if not trainer.sanity_checking:
                curve.append({
                    "epoch": trainer.current_epoch + 1,
                    "val_top1": float(trainer.callback_metrics["val/top1"]),
                    "global_batch": int(datamodule.train_batch_size * trainer.accumulate_grad_batches),
                    "steps": int(trainer.global_step),
                })
                _result_path(job).write_text(json.dumps(row(done=False)))
                print(f"[{job['name']}] epoch {curve[-1]['epoch']}: val top-1 {curve[-1]['val_top1']:.4f} "
                      f"(batch {curve[-1]['global_batch']}, step {curve[-1]['steps']}, "
                      f"{time.perf_counter() - start:.0f} s)", flush=True)

    def row(done: bool) -> dict[str, Any]:
        accs = [c["val_top1"] for c in curve]
        return {
            "arm": job["name"],
            "preset": job["preset"],
            "adds": job["adds"],
            "global_batch": curve[-1]["global_batch"] if curve else int(cfg.data.batch_size),
            "steps": int(trainer.global_step),
            "epochs": len(curve),
            "base_lr": float(cfg.optimizer.lr),
            "first_lr": lrs[0] if lrs else float("nan"),
            "peak_lr": max(lrs) if lrs else float("nan"),
            "final_top1": accs[-1] if accs else float("nan"),
            "best_top1": max(accs) if accs else float("nan"),
            "wall_s": time.perf_counter() - start,
            "error": error,
            "done": done,
            "curve": curve,
        }

    trainer.callbacks.append(_Record())
    _result_path(job).parent.mkdir(parents=True, exist_ok=True)
    error = None
    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=datamodule)
    except Exception as exc:  # a diverged arm is a result, not a crash of the study
        error = f"{type(exc).__name__}: {exc}"
    result = row(done=True)
    _result_path(job).write_text(json.dumps(result))
    return result


def run_jobs(jobs: list[dict[str, Any]], workers: int) -> list[dict[str, Any]]:
    """Run arms, ``workers`` at a time, each in its own process (``--worker``).

    A process per arm keeps Hydra and torch state apart, and an arm whose process dies (out
    of memory, killed) becomes a row with an error instead of hanging the study. Each
    process writes ``runs/<arm>/result.json``, after every epoch too, so ``--collect``
    can tabulate a study that was interrupted.
    """
    if workers <= 1:
        return [run_arm(j) for j in jobs]
    pending, running, results = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < workers:
            j = pending.pop(0)
            path = _result_path(j)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            spec = path.with_name("job.json")
            spec.write_text(json.dumps(j))
            running.append((j, subprocess.Popen([sys.executable, __file__, "--worker", str(spec)])))
        time.sleep(1.0)
        for j, proc in list(running):
            if proc.poll() is None:
                continue
            running.remove((j, proc))
            path = _result_path(j)
            row = json.loads(path.read_text()) if path.is_file() else None
            if proc.returncode != 0 or row is None or not row.get("done"):
                row = dict(row or _empty_row(j), error=f"worker exited with code {proc.returncode}")
            results[j["name"]] = row
    return [results[j["name"]] for j in jobs]


def _result_path(job: dict[str, Any]) -> Path:
    return Path(job["output_dir"]) / "runs" / job["name"] / "result.json"


def _empty_row(job: dict[str, Any]) -> dict[str, Any]:
    return {"arm": job["name"], "preset": job["preset"], "adds": job["adds"], "global_batch": 0, "steps": 0,
            "epochs": 0, "base_lr": float("nan"), "first_lr": float("nan"), "peak_lr": float("nan"),
            "final_top1": float("nan"), "best_top1": float("nan"), "wall_s": 0.0, "error": None, "curve": []}


FIELDS = ("arm", "adds", "global_batch", "epochs", "steps", "base_lr", "peak_lr", "final_top1", "best_top1", "wall_s", "error")


def write_outputs(rows: list[dict[str, Any]], sweep: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    """results.csv, results.json and convergence.png under ``out``; print the table."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "baseline_sweep": sweep}, indent=1))
    print(format_table(rows, sweep))
    plot(rows, out / "convergence.png", meta)


def format_table(rows: list[dict[str, Any]], sweep: list[dict[str, Any]]) -> str:
    """Markdown table of the arms, then the baseline LR sweep."""
    lines = ["| arm | adds | global batch | epochs | optimizer steps | LR at B0 | peak LR | final top-1 | best top-1 | wall s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        note = f" ({r['error']})" if r["error"] else ""
        lines.append(f"| {r['arm']} | {r['adds']}{note} | {r['global_batch']} | {r['epochs']} | {r['steps']} | {r['base_lr']:g} | {r.get('peak_lr', float('nan')):.3g} "
                     f"| {100 * r['final_top1']:.2f} | {100 * r['best_top1']:.2f} | {r['wall_s']:.0f} |")
    if sweep:
        lines += ["", "baseline LR sweep (batch B0): " + ", ".join(
            f"lr {s['base_lr']:g}: final {100 * s['final_top1']:.2f}" for s in sweep)]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    """Validation top-1 vs epoch, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for r in rows:
        if r["curve"]:
            ax.plot([c["epoch"] for c in r["curve"]], [100 * c["val_top1"] for c in r["curve"]],
                    marker="o", ms=3, label=f"{r['arm']} (B={r['global_batch']})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation top-1 (%)")
    ax.set_title(f"large-batch ablation, resnet_small, {meta['train_size']} procedural images")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep and the arms (or ``--collect`` finished ones); write and print the results."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, default=REPO / "benchmarks" / "results" / "convergence")
    p.add_argument("--quick", action="store_true", help="tiny smoke test: 2 epochs of 512 images at 16 px")
    p.add_argument("--baseline-lrs", type=float, nargs="+", default=None,
                   help=f"arm-1 LR sweep at batch B0 (default {list(DEFAULT_BASELINE_LRS)}; --quick: the preset's LR); "
                        "the best final top-1 becomes arm 1 and the base of the scaled arms; with a single "
                        "value all seven arms run at once")
    p.add_argument("--sweep-only", action="store_true", help="run only the arm-1 LR sweep")
    p.add_argument("--collect", action="store_true",
                   help="train nothing: tabulate the runs/*/result.json already in --output-dir "
                        "(e.g. a sweep and the arms run by separate invocations, or an interrupted study)")
    p.add_argument("--jobs", type=int, default=2, help="arms trained in parallel, one process each")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every arm (e.g. trainer.max_epochs=4)")
    args = p.parse_args(argv)
    if args.worker is not None:
        return run_arm(json.loads(args.worker.read_text()))
    if args.jobs < 1 or args.threads < 1:
        p.error("--jobs and --threads must be >= 1")

    extra = list(args.overrides)
    lrs = args.baseline_lrs or ([] if args.quick else list(DEFAULT_BASELINE_LRS))

    def job(name: str, preset: str, adds: str, more: list[str]) -> dict[str, Any]:
        ov = (quick_overrides(preset) if args.quick else []) + extra + more
        return {"name": name, "preset": preset, "adds": adds, "overrides": ov,
                "output_dir": str(args.output_dir), "threads": args.threads, "quick": args.quick}

    started = time.perf_counter()
    load_start = os.getloadavg()
    name, preset, adds = ARMS[0]
    sweep_jobs = [job(f"{name}_lr{lr:g}", preset, adds, [f"optimizer.lr={lr}"]) for lr in lrs] or [
        job(name, preset, adds, [])]
    if args.collect:
        sweep, rest = collect(args.output_dir)
    elif len(sweep_jobs) == 1 and not args.sweep_only:
        # nothing to choose: all arms are independent and run side by side
        base = lrs[0] if lrs else float(_preset_value("optimizer.lr", extra))
        results = run_jobs(sweep_jobs + [job(n, pr, a, [f"optimizer.lr={arm_lr(n, base)}"]) for n, pr, a in ARMS[1:]],
                           args.jobs)
        sweep, rest = results[:1], results[1:]
    else:
        sweep = run_jobs(sweep_jobs, min(args.jobs, len(sweep_jobs)))
        rest = []
    best = max(sweep, key=lambda r: (r["error"] is None, r["final_top1"]))
    if not args.sweep_only and not args.collect and not rest:
        rest = run_jobs([job(n, pr, a, [f"optimizer.lr={arm_lr(n, best['base_lr'])}"]) for n, pr, a in ARMS[1:]],
                        args.jobs)
    rows = [dict(best, arm=name), *rest]
    mismatched = sorted({r["base_lr"] for r in rest if r["base_lr"] != arm_lr(r["arm"], best["base_lr"])})
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else f"main({argv})",
        "quick": args.quick,
        "jobs": args.jobs,
        "threads_per_job": args.threads,
        "cpu_count": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "total_wall_s": time.perf_counter() - started,
        "train_size": 512 if args.quick else _preset_value("data.train_size", extra),
        "warning": f"arms 2-7 ran at base LR {mismatched}, not from the sweep's best {best['base_lr']}" if mismatched else None,
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    write_outputs(rows, sweep if len(sweep) > 1 else [], meta, args.output_dir)
    if meta["warning"]:
        print("WARNING:", meta["warning"])
    print(f"{'collected' if args.collect else 'total wall'} {meta['total_wall_s']:.0f} s; load average at start {load_start[0]:.1f}, "
          f"at end {meta['loadavg_end'][0]:.1f} on {meta['cpu_count']} CPUs")
    return {"rows": rows, "sweep": sweep, "meta": meta}


def collect(output_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(baseline sweep rows, rows of arms 2-7)`` from the result files under ``output_dir``."""
    def load(path: Path, arm: str, preset: str, adds: str) -> dict[str, Any]:
        if not path.is_file():
            return _empty_row({"name": arm, "preset": preset, "adds": adds}) | {"error": "not run"}
        r = json.loads(path.read_text())
        if not r.get("done") and not r.get("error"):
            r["error"] = f"unfinished: {r['epochs']} epochs done"
        return r

    runs = output_dir / "runs"
    name, preset, adds = ARMS[0]
    sweep = [load(p / "result.json", p.name, preset, adds) for p in sorted(runs.glob(f"{name}*"), key=_lr_of)]
    if not sweep:
        raise FileNotFoundError(f"no {name}* runs under {runs}; run the study first")
    return sweep, [load(runs / n / "result.json", n, pr, a) for n, pr, a in ARMS[1:]]


def _lr_of(path: Path) -> float:
    tail = path.name.rpartition("_lr")[2]
    return float(tail) if tail.replace(".", "", 1).replace("e-", "", 1).isdigit() else 0.0


def _preset_value(key: str, overrides: list[str]) -> Any:
    for o in overrides:
        if o.startswith(key + "="):
            return o.split("=", 1)[1]
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(CONF / "experiment" / "convergence_baseline.yaml"), key)


if __name__ == "__main__":
    main()
