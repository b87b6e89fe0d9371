"""Smoke test of benchmarks/time_to_accuracy.py, so the script cannot rot.

Each arm (plain Lightning, the recipe, large batch without it) trains one tiny epoch in this
process on one rank, on the built-in data and on a JPEG image tree made by the script (the
recipe's streaming conversion included); the curve, step breakdown and result fields are
checked. The pure parts are checked against hand-computed values: the target and time to it
from recorded curves, the speed-up and its spread, the regimes' link-rate interpolation, B0.
The 2-rank run through torchrun and the report (table, figure) is marked slow.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import time_to_accuracy as tta
from lightning_fastscale.emulation.faults import free_port
from tests.distributed import run_node_launches

ROOT = Path(__file__).resolve().parents[1]


def _run(arm: str, seed: int, curve: list[list[float]], steps_per_epoch: int = 10) -> dict:
    points = [{"epoch": i + 1, "step": (i + 1) * steps_per_epoch, "samples": (i + 1) * 640} for i in range(len(curve))]
    return {"arm": arm, "seed": seed, "curve": curve, "points": points, "breakdown": None, "startup_s": 5.0,
            "conversion_s": 0.0, "lr": 0.1, "per_device_batch": 32, "error": None}


def test_target_time_to_target_and_speedup_from_curves():
    runs = {}
    # plain: best 0.81, 0.82, 0.84 -> median 0.82 -> target 0.81, first reached at the second validation
    for seed, best in enumerate((0.80, 0.82, 0.84)):
        runs[f"procedural/record/plain/seed{seed}"] = _run("plain", seed, [[10.0, 0.5], [20.0 + seed, 0.81], [30.0, best]])
    for seed in range(3):
        runs[f"procedural/record/recipe/seed{seed}"] = _run("recipe", seed, [[4.0, 0.6], [8.0 + seed, 0.812]], 2)
    runs["procedural/record/large/seed0"] = _run("large", 0, [[4.0, 0.3], [8.0, 0.5]])
    rows = tta.summarize_runs({"runs": runs, "calibration": {}})
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["plain"]["target"] == pytest.approx(0.81)
    assert by_arm["plain"]["seconds"] == [20.0, 21.0, 22.0]
    assert by_arm["plain"]["median_s"] == 21.0 and by_arm["plain"]["epochs"] == 2 and by_arm["plain"]["steps"] == 20
    assert by_arm["recipe"]["seconds"] == [8.0, 9.0, 10.0] and by_arm["recipe"]["steps"] == 4
    assert by_arm["recipe"]["speedup_vs_plain"] == pytest.approx(21.0 / 9.0)
    assert by_arm["recipe"]["speedup_range"] == pytest.approx([20.0 / 10.0, 22.0 / 8.0])
    assert by_arm["large"]["reached"] == "0/1" and by_arm["large"]["median_s"] is None
    assert by_arm["large"]["speedup_vs_plain"] is None
    # every recipe seed sooner than every plain seed: 9 of 9 pairings, the 1 split in C(6, 3) = 20 that does it
    assert by_arm["recipe"]["sooner_pairs"] == [9.0, 9] and by_arm["recipe"]["rank_sum_p"] == pytest.approx(1 / 20)
    assert by_arm["large"]["sooner_pairs"] == [0.0, 3] and by_arm["large"]["rank_sum_p"] == 1.0
    assert "sooner_pairs" not in by_arm["plain"]
    table = tta.format_table(rows, {"calibration": {"rates_mbit": {"record": 35.0}}})
    assert "record (35 Mbit/s)" in table and "not reached" in table


def test_a_seed_that_misses_the_target_counts_as_infinitely_slow():
    runs = {f"d/one/plain/seed{i}": _run("plain", i, [[10.0 * (i + 1), 0.5], [40.0, best]])
            for i, best in enumerate((0.80, 0.82, 0.75))}  # target 0.79: seed 2 never gets there
    plain = tta.summarize_runs({"runs": runs})[0]
    assert plain["reached"] == "2/3" and plain["seconds"] == [40.0, 40.0, None]
    assert plain["median_s"] == 40.0 and plain["min_s"] == 40.0 and plain["max_s"] is None


def test_seed_pairings_count_a_miss_as_slowest_and_a_tie_as_half():
    # 10 < 20 and 10 < miss; miss against 20 loses; miss against miss ties
    assert tta.sooner_pairs([10.0, None], [20.0, None]) == 2.5
    # of the C(4, 2) = 6 ways to split {10, 20, miss, miss}, 3 give at least 2.5 sooner pairings:
    # {10, 20} (4) and {10, miss} (2.5) with either miss
    assert tta.rank_sum_p([10.0, None], [20.0, None]) == pytest.approx(3 / 6)
    # the measured case of a 5-seed run: one arm seed (79.1 s) slower than one plain seed (78.0 s)
    arm, plain = [79.1, 55.3, 48.0, 58.5, 59.5], [79.3, None, 83.8, 78.0, 90.2]
    assert tta.sooner_pairs(arm, plain) == 24.0
    assert tta.rank_sum_p(arm, plain) == pytest.approx(2 / 252)  # U = 25 or 24: 1 + 1 of C(10, 5) splits


def test_regime_rates_interpolate_the_measured_ratios():
    # exposed communication ~ 1 / rate: ratio = 100 / rate -> 0.5 at 200, 2.5 at 40 Mbit/s
    rates = tta.pick_rates({400.0: 0.25, 100.0: 1.0, 25.0: 4.0})
    assert rates == {"cloud": pytest.approx(200.0, rel=1e-3), "record": pytest.approx(40.0, rel=1e-3)}
    # outside the measured range: extrapolated from the nearest pair
    assert tta.pick_rates({400.0: 1.0, 100.0: 4.0})["cloud"] == pytest.approx(800.0, rel=1e-3)


def test_recipe_ramp_quarters_halves_then_full_batch():
    assert tta.ramp_schedule(21, 32, 16, 2) == {0: 256, 3: 512, 9: 1024}  # v3: 3 / 6 / 12 epochs
    assert tta.ramp_schedule(2, 4, 16, 1) == {0: 32, 1: 64}  # 2 epochs: the half batch replaces the quarter
    assert tta.ramp_schedule(1, 4, 16, 1) == {0: 64}


def test_comm_ratio_is_exposed_communication_over_compute_and_optimizer():
    phases = {"input": 0.01, "compute": 0.03, "communication": 0.06, "optimizer": 0.01, "rest": 0.0}
    assert tta.comm_ratio({"phases": phases}) == pytest.approx(1.5)


def test_b0_is_the_smallest_batch_at_90_percent_of_the_best():
    sizes = dict(tta.QUICK_SIZES)
    result = tta.measure_b0(sizes, [2, 4, 8], rounds=1, min_s=0.01)
    rates = {int(b): r for b, r in result["samples_per_s"].items()}
    best = max(rates.values())
    assert result["b0"] == min(b for b, r in rates.items() if r >= 0.9 * best)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    work = tmp_path_factory.mktemp("tta")
    return work, tta.prepare_data(work / "data", tta.QUICK_SIZES, image_tree=True)


# the wire arms read the data as the plain arm does, so they run on the built-in data only
# topk_momentum needs an inter-node stage, which one process lacks: the quick 2-rank run below trains it
@pytest.mark.parametrize(("arm", "kind"), [(arm, kind) for arm in tta.ARMS for kind in ("procedural", "tree")
                                           if (kind == "procedural" or arm not in tta.WIRE_ARMS)
                                           and arm != "topk_momentum"])
def test_each_arm_trains_one_epoch_and_records_its_curve(data, arm, kind):
    work, paths = data
    run_dir = work / f"{kind}-{arm}"
    spec = {"arm": arm, "seed": 0, "lr": tta.LR_GRID[arm][1], "b0": 4, "k": tta.K, "sizes": tta.QUICK_SIZES,
            "epochs": 1, "data": kind, "data_paths": paths, "machine": "one", "nodes": 1, "ranks_per_node": 1,
            "run_dir": str(run_dir), "result": str(run_dir / "result.json")}
    try:
        result = tta.run_rank(spec)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert result is not None and result["error"] is None
    assert json.loads((run_dir / "result.json").read_text()) == result
    assert len(result["curve"]) == 1 and 0.0 <= result["curve"][0][1] <= 1.0 and result["curve"][0][0] > 0
    # the package's callback gives the curve; the script's own recorder agrees with it
    assert result["curve_source"] == "TimeToAccuracy" and result["time_to_accuracy"]["validations"] == 1
    (seconds, value), (own_seconds, own_value) = result["curve"][0], result["curve_benchmark"][0]
    assert value == pytest.approx(own_value) and abs(seconds - own_seconds) < 0.5
    samples = tta.QUICK_SIZES["train_size"]
    # B0 = 4 here: the wire arms keep the plain arm's batch but for fp16_wire_k2's 2 x B0
    assert result["per_device_batch"] == {"fp16_wire_k2": 8, "recipe": tta.K * 4, "large": tta.K * 4}.get(arm, 4)
    if arm != "recipe":  # the LR scales linearly with the batch; the recipe's has its own test below
        assert result["initial_lr"] == pytest.approx(tta.LR_GRID[arm][1] * result["per_device_batch"] / 4)
    # a wire arm runs the plain arm with the package's strategy set as WIRE_ARMS says, nothing else
    fp16 = {"wire_dtype": "fp16", "topk_ratio": None}
    expected = {"fp16_wire": fp16, "fp16_wire_k2": fp16, "fp16_wire_planned": fp16, "fp16_wire_resizing": fp16,
                "topk": {"wire_dtype": "fp32", "topk_ratio": 0.1}, "powersgd": {"wire_dtype": "fp32", "topk_ratio": None}}
    wire = result["wire"] and {k: result["wire"][k] for k in ("wire_dtype", "topk_ratio")}
    assert wire == expected.get(arm)
    # the resizing arm's one epoch trains at 2/3 of the side (16 px here), rounded to a multiple of 4
    assert result["train_resolutions"] == ([[0, 12]] if arm == "fp16_wire_resizing" else None)
    if arm in tta.WIRE_ARMS:  # the plan the run used: the fixed arms DDP's one 25 MB bucket, the planned its own
        assert ("powerSGD_hook" in result["wire"]["comm_hook"]) == (arm == "powersgd")  # torch's hook, inter-node
        caps = result["wire"]["fusion_plan"]
        assert caps == [25.0] if arm != "fp16_wire_planned" else (caps != [25.0] and all(c > 0 for c in caps))
    # one epoch of full batches (drop_last) on one rank; the recipe's ramp sets its first batch
    first_batch = tta.ramp_schedule(1, 4, tta.K, 1)[0] if arm == "recipe" else result["per_device_batch"]
    assert result["points"][0]["step"] == samples // first_batch
    assert result["breakdown"]["phases"]["compute"] > 0
    assert result["conversion_s"] > 0 if (arm, kind) == ("recipe", "tree") else result["conversion_s"] == 0
    assert (Path(paths["tree"]) / "train").is_dir() and len(list((Path(paths["tree"]) / "val").iterdir())) == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_on_two_ranks_and_report(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "time_to_accuracy.py"), "--quick", "--machines", "one",
           "--seeds", "0", "--output", str(out), "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert sorted(results["runs"]) == [f"procedural/one/{a}/seed0" for a in sorted(tta.ARMS)]
    for r in results["runs"].values():
        assert r["world_size"] == 2 and r["error"] is None and len(r["curve"]) == 1
    # each rank a node: momentum correction between them, the optimizer without a momentum of its own
    assert results["runs"]["procedural/one/topk_momentum/seed0"]["wire"]["topk_momentum"] == 0.9
    done = subprocess.run(cmd + ["--report"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.with_name("r_summary.json").read_text())
    assert [r["arm"] for r in summary] == list(tta.ARMS)
    plain = summary[0]
    assert plain["target"] == pytest.approx(max(v for _, v in results["runs"]["procedural/one/plain/seed0"]["curve"]) - 0.01)
    assert plain["reached"] == "1/1" and not math.isnan(plain["median_s"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _nodes_commands() -> list[str]:
    """The two commands of benchmarks/README.md's "On your own nodes", continuation lines joined."""
    section = (ROOT / "benchmarks" / "README.md").read_text().split("### On your own nodes", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow  # two torchrun launches, three arms: about 20 s
@pytest.mark.timeout(300)
def test_the_documented_command_on_two_launched_nodes_runs_each_arm_on_their_ranks(tmp_path):
    """benchmarks/README.md's command as written, on two torchrun launches of this machine (node
    ranks 0 and 1, one CPU rank each instead of 8), then its report; small-run limits appended."""
    launch, report = _nodes_commands()
    limits = f" --quick --seeds 0 --output {tmp_path / 'r.json'} --work-dir {tmp_path / 'work'}"
    text = re.sub(r"\s+", " ", launch).replace("--nproc_per_node 8", "--nproc_per_node 1")
    text = text.replace("29500", str(free_port())).replace("torchrun ", f"{sys.executable} -m torch.distributed.run ", 1)
    codes, out = run_node_launches(text + limits, ROOT, {**os.environ, "MASTER_HOST": "127.0.0.1",
                                                          "PYTHONWARNINGS": "ignore"}, timeout=240)
    assert codes == [0, 0], out[-6000:]
    results = json.loads((tmp_path / "r.json").read_text())
    arms = ["plain", "fp16_wire", "fp16_wire_planned"]
    assert sorted(results["runs"]) == sorted(f"procedural/launched/{arm}/seed0" for arm in arms)
    for arm in arms:
        run = results["runs"][f"procedural/launched/{arm}/seed0"]
        assert run["world_size"] == 2 and run["error"] is None and len(run["curve"]) == 1
        # 2 ranks: the LR tuned at 2 x B0 is already at this world's global batch
        assert run["lr"] == run["lr_tuned"] == tta.LR_GRID[arm][1]
    # the package's strategy sees the launcher's two nodes: its fp16 wire runs between them
    wire = results["runs"]["procedural/launched/fp16_wire/seed0"]["wire"]
    assert (wire["algorithm"], wire["wire_dtype"], wire["comm_hook"]) == ("hier", "fp16", "hier_hook")
    assert report.startswith("python ")
    done = subprocess.run([sys.executable, *report.split()[1:], "--output", str(tmp_path / "r.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| procedural | launched | plain |" in done.stdout


def test_launched_arms_take_the_launchers_layout_and_scale_the_lr_to_its_world(tmp_path, monkeypatch):
    """2 nodes x 2 ranks (what the 2-launch test above cannot show: one rank per node was the
    emulation's layout too): every arm's spec names the launcher's nodes and ranks per node, keeps
    the process group, and runs at the tuned LR x 4 ranks / 2; the strategy takes that layout."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    specs: list[dict] = []
    monkeypatch.setattr(tta, "run_rank", lambda spec: specs.append(spec))  # a rank that is not global zero
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)
    args = SimpleNamespace(seeds=[0, 1], arms=["plain", "fp16_wire"], data="procedural", output=tmp_path / "r.json",
                           topk_ratio=tta.TOPK_RATIO)

    def spec(arm, seed, lr, machine, tag):
        return {"arm": arm, "seed": seed, "lr": lr, "run_dir": str(tmp_path / f"{arm}-{seed}")}

    tta._run_launched({"runs": {}}, args, spec, {"plain": 0.2, "fp16_wire": 0.1}, dict(tta.EPOCHS))
    assert [(s["seed"], s["arm"]) for s in specs] == [(0, "plain"), (0, "fp16_wire"), (1, "plain"), (1, "fp16_wire")]
    for s in specs:
        assert (s["nodes"], s["ranks_per_node"], s["strategy_ranks_per_node"], s["keep_group"]) == (2, 2, 2, True)
        assert s["lr"] == pytest.approx({"plain": 0.4, "fp16_wire": 0.2}[s["arm"]])
    assert not (tmp_path / "r.json").exists()  # only global rank zero records
    strategy = tta._wire_strategy("fp16_wire", torch.zeros(4, 3, 16, 16), ranks_per_node=2)
    assert strategy.ranks_per_node == 2


def test_launched_runs_alone_and_inside_a_launcher(tmp_path, capsys, monkeypatch):
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    common = ["--quick", "--output", str(tmp_path / "r.json"), "--work-dir", str(tmp_path / "work")]
    with pytest.raises(SystemExit):
        tta.main(["--machines", "launched", "one", *common])
    assert "--machines launched runs alone and without --tune" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tta.main(["--machines", "launched", *common])
    assert "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE not set; start this command with torchrun" in \
        capsys.readouterr().err


def test_recipe_ramp_stages_have_equal_steps_and_warmup_is_a_share_of_them():
    ramp = tta.ramp_schedule(21, 32, 16, 2)
    steps = tta.ramp_steps(ramp, 21, 12288)
    assert steps == [48] * 3 + [24] * 6 + [12] * 12  # 144 steps at each of 256, 512, 1024
    assert tta.warmup_steps(sum(steps)) == 24  # 5/90 of 432
    assert tta.warmup_steps(900) == 50 and tta.warmup_steps(2) == 1  # 0.1 step rounds to 0: at least one


def test_settings_from_carry_an_arms_tuning_only_if_it_is_unchanged():
    meta = tta._meta()
    old = dict(meta, epochs=dict(meta["epochs"], recipe=12), lr_grid=dict(meta["lr_grid"], recipe=[0.2, 0.4, 0.8]))
    assert tta._arm_settings(old, "plain") == tta._arm_settings(meta, "plain")
    assert tta._arm_settings(old, "recipe") != tta._arm_settings(meta, "recipe")
    assert tta._arm_settings(dict(meta, recipe={"lr": "v1"}), "recipe") != tta._arm_settings(meta, "recipe")


def test_recipe_lr_warms_up_and_decays_in_steps_without_a_jump_at_the_ramp(data, tmp_path):
    """Two epochs of the recipe on one rank: global batch 32, then 64 (the ramp's half, then its
    whole): the LR rises linearly from 1/K of the peak (the LR x 32 / (B0 x 1)) over the warmup's
    steps, then follows poly-2 to 0 over the run's optimizer steps, the same per step in both
    epochs (v2 laid the decay out in epochs), and does not jump at the ramp."""
    import lightning.pytorch as pl

    from lightning_fastscale.data import ProceduralDataModule

    _, paths = data
    sizes, b0, lr = tta.QUICK_SIZES, 4, 0.1
    spec = {"sizes": sizes, "b0": b0, "k": tta.K, "epochs": 2, "nodes": 1}
    ramp = tta.ramp_schedule(2, b0, tta.K, 1)
    assert ramp == {0: 32, 1: 64}
    module, callbacks, plugins, strategy = tta._recipe_parts(spec, lr, world=1)

    class Record(pl.Callback):
        lrs: list[float] = []

        def on_train_batch_start(self, trainer, *args) -> None:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    splits = torch.load(paths["tensors"])
    dm = ProceduralDataModule(sizes["num_classes"], 16, 16, sizes["resolution"], batch_size=tta.K * b0,
                              val_batch_size=sizes["val_batch"])
    dm.train_set, dm.val_set = (tta._LoadedSplit(splits[s]["images"], splits[s]["labels"]) for s in ("train", "val"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=[*callbacks, Record()], plugins=plugins,
                         default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    lrs = Record.lrs
    steps = tta.ramp_steps(ramp, 2, sizes["train_size"])
    total = sum(steps)
    assert steps == [8, 4] and len(lrs) == total
    warmup = round(tta.WARMUP_SHARE * total)  # 1 step
    peak = lr * ramp[0] / b0
    expected = [peak * (1 / tta.K + (1 - 1 / tta.K) * n / warmup) if n < warmup
                else peak * (1 - (n - warmup) / (total - warmup)) ** 2 for n in range(total)]
    assert lrs == pytest.approx(expected)
    assert lrs[8] < lrs[7]  # the ramp's step to 2x the batch: no jump up (v1 scaled the LR by 2)


def _topk_tuned_at_defaults(out: Path) -> Path:
    """A results file whose topk LR grid was tuned at the default epochs and ratio (entries without one)."""
    grid = {f"{lr:g}": {"best_top1": 0.5, "error": None, "epochs": tta.EPOCHS["topk"]} for lr in tta.LR_GRID["topk"]}
    tta.save(out, {"calibration": {"b0": 32, "rates_mbit": {"record": 30.0}}, "tuning": {"topk": grid}, "runs": {}})
    return out


def test_epoch_budget_overrides_are_checked_and_need_their_own_tuning(tmp_path, capsys):
    parser = tta.argparse.ArgumentParser()
    assert tta._epoch_overrides(parser, ["topk=17", "plain=3"]) == {"topk": 17, "plain": 3}
    for bad in ("topk=0", "topk", "nope=3", "topk=1.5"):
        with pytest.raises(SystemExit):
            tta._epoch_overrides(parser, [bad])
        assert "--epochs" in capsys.readouterr().err
    # an LR grid tuned at the default budget does not serve another one
    out = _topk_tuned_at_defaults(tmp_path / "r.json")
    with pytest.raises(SystemExit):
        tta.main(["--machines", "record", "--arms", "topk", "--epochs", "topk=17", "--output", str(out)])
    assert "no complete LR grid [0.1, 0.2, 0.4] at 17 epochs" in capsys.readouterr().err


def test_copy_runs_from_copies_the_asked_runs_marked_and_refuses_a_missing_one(tmp_path):
    source, out = tmp_path / "v2.json", tmp_path / "v3.json"
    run = {"arm": "plain", "seed": 0, "curve": [[1.0, 0.5]]}
    tta.save(source, {"calibration": {"b0": 32}, "tuning": {}, "runs": {"procedural/record/plain/seed0": run}})
    args = ["--copy-runs-from", str(source), "--machines", "record", "--arms", "plain", "--output", str(out),
            "--settings-from", str(source)]
    tta.main([*args, "--seeds", "0"])
    assert tta.load(out)["runs"] == {"procedural/record/plain/seed0": dict(run, copied_from="v2.json")}
    with pytest.raises(SystemExit):
        tta.main([*args, "--seeds", "1"])


def test_topk_ratio_sets_the_topk_arms_and_needs_its_own_tuning(tmp_path, capsys):
    arms = tta.wire_arms(0.01)
    assert arms["topk"]["topk_ratio"] == arms["topk_momentum"]["topk_ratio"] == 0.01
    assert arms["fp16_wire"] == tta.WIRE_ARMS["fp16_wire"] and tta.wire_arms() == tta.WIRE_ARMS
    strategy = tta._wire_strategy("topk_momentum", torch.zeros(2, 3, 8, 8), 0.01)
    assert (strategy.topk_ratio, strategy.topk_momentum) == (0.01, 0.9)
    # a grid tuned at the default ratio (entries without one) does not serve another ratio
    out = _topk_tuned_at_defaults(tmp_path / "r.json")
    with pytest.raises(SystemExit):
        tta.main(["--machines", "record", "--arms", "topk", "--topk-ratio", "0.01", "--output", str(out)])
    assert "no complete LR grid [0.1, 0.2, 0.4] at 8 epochs and top-k ratio 0.01" in capsys.readouterr().err
    parser = tta.argparse.ArgumentParser()
    assert tta._tuned_lr(parser, tta.load(out), "topk", tta.EPOCHS["topk"], out) == 0.1  # its own ratio: served


def test_the_powersgd_arm_is_the_package_strategy_with_torchs_hook_at_the_fixed_rank():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    strategy = tta._wire_strategy("powersgd", torch.zeros(2, 3, 8, 8))
    assert strategy.user_hook.hook is powerSGD_hook.powerSGD_hook
    assert (strategy.wire_dtype, strategy.compression) == ("fp32", None)  # the hook alone decides what crosses
    state = strategy.user_hook.state
    assert state.matrix_approximation_rank == tta.POWERSGD_RANK == 4
    # compressed from the second step, with error feedback (torch's default would wait 1,000 steps)
    assert state.start_powerSGD_iter == 2 and state.use_error_feedback and state.process_group is None
    # one state per strategy: each arm starts with empty error-feedback buffers
    assert tta._wire_strategy("powersgd", torch.zeros(2, 3, 8, 8)).user_hook.state is not state
