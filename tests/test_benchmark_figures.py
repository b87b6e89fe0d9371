"""The figures the pages quote match the results files under ``benchmarks/results/``.

Every table a results file holds is shown, row for row, on its page (``benchmarks/README.md``
unless the file names another), and every row of README.md's headline table names a command
whose results file gives the row's figures (derived here from the file, never written twice).
A rerun whose numbers change fails here until the pages follow. Also: the README's layout
names every top-level module and package of ``lightning_fastscale/``.
"""
from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = (ROOT / "README.md").read_text()


def results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def rows(name: str, table: int = 0) -> list[list[str]]:
    """The data rows of a results file's markdown table, cells stripped of bold."""
    lines = results(name)["tables"][table][2:]
    return [[c.strip().replace("**", "") for c in line.strip().strip("|").split("|")] for line in lines]


def row(name: str, first: str, table: int = 0) -> list[str]:
    """The one row whose first cell is ``first``, or else starts with it."""
    table_rows = rows(name, table)
    (found,) = [r for r in table_rows if r[0] == first] or [r for r in table_rows if r[0].startswith(first)]
    return found


def number(cell: str) -> float:
    return float(re.search(r"-?[\d,]*\.?\d+", cell).group().replace(",", ""))


def span(values: list[float], fmt: str = ".2f") -> str:
    low, high = min(values), max(values)
    return f"{low:{fmt}}" if f"{low:{fmt}}" == f"{high:{fmt}}" else f"{low:{fmt}}-{high:{fmt}}"


def time_to_accuracy(machine: str) -> list[str]:
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_summary.json").read_text())}
    plain, recipe = summary[(machine, "plain")], summary[(machine, "recipe")]
    seconds = plain["median_s"] if plain["median_s"] is not None else plain["min_s"]
    best = [100 * b for b in recipe["best_top1"]]
    return [f"{seconds:.0f} s", f"{100 * plain['target']:.1f} %", f"{span(best, '.1f')} %",
            f"{plain['seconds_per_epoch'] / recipe['seconds_per_epoch']:.2f}x"]


def time_to_accuracy_wire() -> list[str]:
    """The wire arms' row: plain, fp16_wire (8 epochs) and topk at 17 epochs, record regime."""
    def arms(name: str) -> dict[str, dict]:
        return {r["arm"]: r for r in json.loads((RESULTS / f"{name}_summary.json").read_text()) if r["machine"] == "record"}
    eight, seventeen = arms("time_to_accuracy_topk"), arms("time_to_accuracy_topk17")
    plain, fp16, topk = eight["plain"], eight["fp16_wire"], seventeen["topk"]
    return [f"plain Lightning {plain['median_s']:.0f} s (median, {plain['reached']} seeds)",
            f"fp16 wire {fp16['median_s']:.0f} s ({fp16['speedup_vs_plain']:.2f}x, the same {fp16['reached']} seeds)",
            f"top-k 10 % over 17 epochs {topk['median_s']:.0f} s ({topk['speedup_vs_plain']:.2f}x, {topk['reached']} seeds)"]


def time_to_accuracy_planned() -> list[str]:
    """The first row: plain, fp16_wire and fp16_wire_planned, arms in turn within each seed, record and cloud."""
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_planned_summary.json").read_text())}
    plain, fp16, planned = (summary[("record", arm)] for arm in ("plain", "fp16_wire", "fp16_wire_planned"))
    per_seed = sorted(p / s for p, s in zip(plain["seconds"], planned["seconds"]) if p and s)
    cloud = {arm: summary[("cloud", arm)] for arm in ("plain", "fp16_wire", "fp16_wire_planned")}
    return [f"plain Lightning {plain['median_s']:.0f} s (median, {plain['reached']} seeds)",
            f"fp16 wire {fp16['median_s']:.0f} s ({fp16['speedup_vs_plain']:.2f}x)",
            f"fp16 wire with the planner's buckets {planned['median_s']:.0f} s ({planned['speedup_vs_plain']:.2f}x; "
            + " and ".join(f"{r:.2f}x" for r in per_seed) + f" on the two seeds that reach it), the same {planned['reached']} seeds",
            f"exposed all-reduce {plain['comm_ratio']:.1f}x its compute", f"Mbit/s: {cloud['plain']['comm_ratio']:.2f}x)",
            f"plain {cloud['plain']['median_s']:.0f} s, fp16 wire {cloud['fp16_wire']['median_s']:.0f} s "
            f"({cloud['fp16_wire']['speedup_vs_plain']:.2f}x), with the planner's buckets "
            f"{cloud['fp16_wire_planned']['median_s']:.0f} s ({cloud['fp16_wire_planned']['speedup_vs_plain']:.2f}x)"]


def resizing_rows() -> dict[tuple[str, str], dict]:
    return {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_resizing_summary.json").read_text())}


def slowest(seconds: list[float | None]) -> float:
    return max(float("inf") if s is None else s for s in seconds)


def time_to_accuracy_resizing() -> list[str]:
    """The first row: plain against the fp16 wire with progressive resizing, 5 seeds over the cloud link."""
    summary, rates = resizing_rows(), results("time_to_accuracy_resizing")["calibration"]["rates_mbit"]
    plain, arm = summary[("cloud", "plain")], summary[("cloud", "fp16_wire_resizing")]
    record_plain, record_arm = summary[("record", "plain")], summary[("record", "fp16_wire_resizing")]
    # the row's "every one of its seeds sooner than every plain seed"
    assert slowest(arm["seconds"]) < plain["min_s"] and arm["sooner_pairs"] == [25.0, 25]
    reached_plain = [s for s in plain["seconds"] if s is not None]
    return [f"\"cloud\" link ({rates['cloud']:g} Mbit/s: plain DDP's exposed all-reduce {plain['comm_ratio']:.2f}x its compute)",
            f"to {100 * plain['target']:.1f} %: plain Lightning {plain['median_s']:.0f} s (median, {plain['reached']} seeds)",
            f"fp16 wire + progressive resizing {arm['median_s']:.0f} s (**{arm['speedup_vs_plain']:.2f}x**; every one of its "
            f"seeds, {arm['min_s']:.0f}-{arm['max_s']:.0f} s, sooner than every plain seed, {min(reached_plain):.0f}-"
            f"{max(reached_plain):.0f} s: {arm['sooner_pairs'][0]:g} of {arm['sooner_pairs'][1]} pairings, one-sided "
            f"rank-sum p = {arm['rank_sum_p']:.3f}; {arm['reached']} seeds)",
            f"\"Record\" link ({rates['record']:g} Mbit/s, {record_plain['comm_ratio']:.2f}x, above the regime's 2-3x): "
            f"plain {record_plain['median_s']:.0f} s, this arm {record_arm['median_s']:.0f} s "
            f"({record_arm['speedup_vs_plain']:.2f}x)"]


def time_to_accuracy_powersgd12() -> list[str]:
    """The first row: plain and powersgd over 12 epochs, arms in turn within each seed, record and cloud."""
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_powersgd12_summary.json").read_text())}
    plain, powersgd = summary[("record", "plain")], summary[("record", "powersgd")]
    cloud_plain, cloud_powersgd = summary[("cloud", "plain")], summary[("cloud", "powersgd")]
    per_seed = ", ".join(f"{p / s:.2f}x" for p, s in zip(plain["seconds"], powersgd["seconds"]))
    # the row's "inside the seeds' spread": the cloud median among plain Lightning's own seeds
    assert min(cloud_plain["seconds"]) <= cloud_powersgd["median_s"] <= max(cloud_plain["seconds"])
    return [f"exposed all-reduce {plain['comm_ratio']:.2f}x its compute",
            f"plain Lightning {plain['median_s']:.0f} s (median, {plain['reached']} seeds)",
            f"PowerSGD rank 4 over 12 epochs {powersgd['median_s']:.0f} s (**{powersgd['speedup_vs_plain']:.2f}x**; "
            f"per seed {per_seed}; {powersgd['reached']} seeds)",
            f"Mbit/s: {cloud_plain['comm_ratio']:.2f}x): plain {cloud_plain['median_s']:.0f} s, PowerSGD "
            f"{cloud_powersgd['median_s']:.0f} s ({cloud_powersgd['speedup_vs_plain']:.2f}x"]


def allreduce() -> list[str]:
    hier, torus, fp16 = row("allreduce", "hier@4mb"), row("allreduce", "torus2d@4mb"), row("allreduce", "hier fp16@4mb")
    return [f"{hier[2]}x", f"fp16 wire: {fp16[2]}x", f"{span([number(hier[3]), number(torus[3])], '.0f')} %"]


def train_step_cluster() -> list[str]:
    ring = re.findall(r"[\d.]+", row("train_step_cluster", "hier_ring (4 MiB chunks)")[2])
    return [f"`hier_ring` {span([float(x) for x in ring])}x", f"fp16 wire {row('train_step_cluster', 'hier_torus, wire_dtype=fp16')[2]}x"]


def lars_step() -> list[str]:
    def ratios(of: str, to: str) -> list[float]:
        return [number(a) / number(b) for a, b in zip(row("lars_step", of)[1:4], row("lars_step", to)[1:4])]
    plugin = "`LARSMixedPrecision.lars_step`"
    return [f"`LARS` {span(ratios('`LARS`', 'torch SGD'))}x", f"the plugin around SGD {span(ratios(plugin, 'torch SGD'))}x",
            f"{span(ratios(plugin, 'timm `Lars` (default'))}x of timm `Lars`", "three runs"]


def input_vs_imagefolder() -> list[str]:
    def ratio(first: str) -> str:
        return f"{number(row('input_vs_imagefolder', first)[2]):.1f}x"
    return [f"streaming {ratio('StreamingDataModule, max side 256')} ImageFolder stored at max side 256",
            f"{ratio('StreamingDataModule, max side 320')} at 320", f"{ratio('StreamingDataModule @ source size (max')} at source size",
            f"a full decode alone: {ratio('`decode_jpeg` alone')}", f"DALI CPU {ratio('DALI CPU')}"]


def input_vs_ffcv() -> list[str]:
    def cells(first: str, column: int) -> str:
        return ", ".join(f"{row('input_vs_ffcv', f'{first}, {side}')[column]}x" for side in ("source", "320", "256"))
    return [f"per core {cells('StreamingDataModule', 4)} FFCV", f"ImageFolder in the same run: {cells('StreamingDataModule', 3)}",
            f"(the `num_workers: auto` pick) {cells('StreamingDataModule, no worker, 2 decode threads (background thread)', 7)}",
            f"kernel alone per core {cells('`train_batch`, bytes in memory', 4)}"]


def faults() -> list[str]:
    lost = row("faults", "SIGTERM to rank 1 only (`PreemptionCheckpoint`)")[3]
    return [part for part in ("0 steps redone", "bitwise equal to the uninterrupted run") if part in lost] + ["one checkpoint"]


def emulation_faults() -> list[str]:
    hung = {r[0]: number(r[3]) for r in rows("emulation_faults") if r[1] == "hang rank 1"}
    return [f"{span([v for k, v in hung.items() if k != 'ddp'], '.0f')} s (plain DDP {hung['ddp']:.0f} s)"]


def planner_validation() -> list[str]:
    table = rows("planner_validation")
    errors = [abs(float(e)) for r in table for cell in r[5:8] for e in re.findall(r"\(([-+]\d+)%\)", cell)]
    picks = [number(r[-1]) for r in table]
    assert max(errors) <= 25 and max(picks) <= 1.05, (max(errors), max(picks))
    return [f"{len(table)} cases", "all predictions within 25 %", "every pick within 5 % of the fastest"]


def planner_literature() -> list[str]:
    (tencent,) = [r for r in rows("planner_literature") if r[0] == "tencent_p40_100g" and r[2] == "1024"]
    return [f"predicts {number(tencent[6]):.1f} % (published {number(tencent[5]):.0f} %)"]


def crossover() -> list[str]:
    table = [(int(r[1]), int(r[2]), number(r[6]), number(r[7]), number(r[9])) for r in rows("planner_crossover")]
    wins = [x for gbit, nodes, hier, torus, _ in table if nodes in (4, 8) and gbit <= 100 for x in (hier, torus)]
    assert all(max(h, t) < 1 for gbit, nodes, h, t, _ in table if nodes == 2 or gbit == 400)
    topk = [k for *_, k in table]
    return [f"fp32 two-level: {span(wins)}x on 4-8 nodes up to 100 Gbit/s, none on 2 nodes or at 400 Gbit/s",
            f"top-k 1 %: {min(topk):.1f}-{max(topk):.0f}x"]


def doctor_scenarios() -> list[str]:
    comm, loader = row("doctor_scenarios", "2 emulated nodes"), row("doctor_scenarios", "4 ms sleep per sample")
    return [f"16-bit wire predicted {comm[5]}, measured {comm[6]}", f"2 loader workers predicted {loader[5]}, measured {loader[6]}"]


def convergence() -> list[str]:
    extra = results("convergence")["extra_seeds"]
    def six(arm: str) -> float:
        return statistics.mean([number(c) for c in row("convergence", arm)[6:9]] + extra[arm])
    return [f"full recipe {six('1_baseline') - six('7_ghost_bn'):.1f} points below the baseline (six seeds",
            f"linear scaling alone: {abs(number(row('convergence', '2_linear_scaling')[10])):.0f} below"]


def default_job() -> list[str]:
    report = results("default_job")["report"]
    return [f"val top-1 {report['final_val_top1']:.2f}", f"{report['wall_s'] // 60} min {report['wall_s'] % 60} s"]


# README headline row (by its command) -> the figures its results file gives
HEADLINE: dict[str, Callable[[], list[str]]] = {
    "python benchmarks/time_to_accuracy.py --arms plain fp16_wire_resizing": time_to_accuracy_resizing,
    "python benchmarks/time_to_accuracy.py --arms plain powersgd": time_to_accuracy_powersgd12,
    "python benchmarks/time_to_accuracy.py --arms plain fp16_wire fp16_wire_planned": time_to_accuracy_planned,
    "python benchmarks/time_to_accuracy.py --arms plain fp16_wire topk": time_to_accuracy_wire,
    "python benchmarks/time_to_accuracy.py --machines record": lambda: time_to_accuracy("record"),
    "python benchmarks/time_to_accuracy.py --machines cloud": lambda: time_to_accuracy("cloud"),
    "python benchmarks/time_to_accuracy.py --machines one": lambda: time_to_accuracy("one"),
    "python benchmarks/allreduce.py": allreduce,
    "python benchmarks/train_step_cluster.py": train_step_cluster,
    "python benchmarks/lars_step.py": lars_step,
    "python benchmarks/input_vs_imagefolder.py": input_vs_imagefolder,
    "python benchmarks/input_vs_ffcv.py": input_vs_ffcv,
    "python benchmarks/faults.py": faults,
    "python -m lightning_fastscale.emulation.faults": emulation_faults,
    "python benchmarks/planner_validation.py": planner_validation,
    "python benchmarks/planner_literature.py": planner_literature,
    "fastscale-plan --crossover": crossover,
    "python benchmarks/doctor_scenarios.py": doctor_scenarios,
    "python benchmarks/convergence.py": convergence,
    "make train": default_job,
}


def headline_rows() -> list[tuple[str, str]]:
    """(what and figures, command) of each row of README.md's headline table."""
    section = README.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")][1:]
    return [(f"{cells[0]} | {cells[1]}", cells[2]) for cells in ([c.strip() for c in line.strip("|").split(" | ")] for line in lines)]


def test_every_headline_row_has_a_results_file() -> None:
    rows_ = headline_rows()
    assert len(rows_) >= len(HEADLINE)
    for _, command in rows_:
        assert [key for key in HEADLINE if f"`{key}" in command], f"README headline row without a results file: {command}"


@pytest.mark.parametrize("key", list(HEADLINE))
def test_headline_figures_match_results(key: str) -> None:
    (figures,) = [text for text, command in headline_rows() if f"`{key}" in command]
    for expected in HEADLINE[key]():
        assert expected in figures, f"README.md headline row `{key}` should say {expected!r} (its results file); it says: {figures}"


# the results files the pages quote (time_to_accuracy has its own format, checked below)
QUOTED = ["allreduce", "background_loader", "convergence", "default_job", "doctor_scenarios", "emulation_faults", "faults",
          "input_kernels", "input_vs_ffcv", "input_vs_imagefolder", "lars_step", "lightning_ddp_tests", "planner_crossover", "planner_literature",
          "planner_validation", "step_breakdown_overhead", "streaming_loader", "time_to_accuracy_sweeps", "train_step_cluster", "worker_start"]


@pytest.mark.parametrize("name", QUOTED)
def test_results_file_tables_are_on_their_page(name: str) -> None:
    data = results(name)
    assert data.get("source") and data.get("command") and data.get("date"), f"{name}.json names no source, command and date"
    page = (ROOT / data.get("page", "benchmarks/README.md")).read_text()
    for table in data.get("tables", []):
        for line in table:
            assert line in page, f"{name}.json: this row is not on its page (rerun? update the page's table):\n{line}"


def test_input_pipeline_docs_figures_match_results() -> None:
    page = " ".join((ROOT / "docs" / "input_pipeline.md").read_text().split())

    def per_core(first: str, fmt: str = ".1f") -> str:
        return f"{number(row('input_vs_imagefolder', first)[2]):{fmt}}x"

    epochs = [row("input_vs_ffcv", f"StreamingDataModule, {side}")[3] for side in ("256", "320", "source")]
    for expected in (f"max side 256 gives about {per_core('StreamingDataModule, max side 256')}",
                     f"320 about {per_core('StreamingDataModule, max side 320')}",
                     f"size about {per_core('StreamingDataModule @ source size (max')}",
                     f"decode alone is {per_core('`decode_jpeg` alone')}", f"{epochs[0]}x, {epochs[1]}x and {epochs[2]}x"):
        assert expected in page, f"docs/input_pipeline.md should say {expected!r} (benchmarks/results/input_vs_imagefolder.json, input_vs_ffcv.json)"


def bf16_grad_error() -> list[str]:
    table = rows("bf16_grad_error")
    def percent(prefixes: tuple[str, ...], columns: slice = slice(2, 4), fmt: str = ".0f") -> str:
        values = [100 * float(c) for r in table if r[0].startswith(prefixes) for c in r[columns]]
        return f"{span(values, fmt)} %"
    return [f"{percent(('stem', 'stages.0', 'stages.1'))} in the convolution and BN parameters of the stem and the first two",
            f"{percent(('stages.2',))} in the last stage", f"{percent(('fc',), slice(2, 3), '.1f')} in the classifier"]


def step_breakdown_overhead() -> list[str]:
    (after,) = [r for r in rows("step_breakdown_overhead") if r[:2] == ["after", "a fresh process per fit"]]
    return [f"its own CPU time: about {number(after[3]):.1f} %"]


# results files whose figures a page quotes in its prose: (page, figures)
PROSE: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "bf16_grad_error": ("benchmarks/README.md", bf16_grad_error),
    "step_breakdown_overhead": ("docs/step_breakdown.md", step_breakdown_overhead),
}


@pytest.mark.parametrize("name", list(PROSE))
def test_prose_figures_match_results(name: str) -> None:
    page, figures = PROSE[name]
    text = " ".join((ROOT / page).read_text().split())
    assert results(name).get("command")
    for expected in figures():
        assert expected in text, f"{page} should say {expected!r} ({name}.json)"


@pytest.mark.parametrize("name", ["time_to_accuracy", "time_to_accuracy_tree", "time_to_accuracy_v2", "time_to_accuracy_v3",
                                  "time_to_accuracy_topk", "time_to_accuracy_topk17", "time_to_accuracy_planned",
                                  "time_to_accuracy_topk_momentum", "time_to_accuracy_recalibrated",
                                  "time_to_accuracy_powersgd", "time_to_accuracy_powersgd12", "time_to_accuracy_powersgd10",
                                  "time_to_accuracy_resizing", "time_to_accuracy_resizing160"])
def test_time_to_accuracy_table_is_on_the_benchmarks_page(name: str) -> None:
    page = (ROOT / "benchmarks" / "README.md").read_text()
    table = [line for line in (RESULTS / f"{name}.md").read_text().splitlines() if line.startswith("| ")]
    assert table and all(line in page for line in table)


def test_time_to_accuracy_topk1_figures_are_on_the_benchmarks_page() -> None:
    """The 1 % exploration (no plain arm, so no table): each arm's tuning and best top-1 per seed."""
    data = json.loads((RESULTS / "time_to_accuracy_topk1.json").read_text())
    page = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    best = {arm: [100 * max(v for _, v in data["runs"][f"procedural/one/{arm}/seed{seed}"]["curve"]) for seed in range(3)]
            for arm in ("topk", "topk_momentum")}
    for arm, values in best.items():
        assert data["meta"]["wire_arms"][arm]["topk_ratio"] == 0.01
        assert f"{arm} " + " / ".join(f"{v:.1f}" for v in values) + " %" in page
    for arm in ("topk", "topk_momentum"):
        for lr, entry in data["tuning"][arm].items():
            assert f"{lr}: " in page and f"{100 * entry['best_top1']:.1f} %" in page
    medians = [statistics.median(best[arm]) for arm in ("topk", "topk_momentum")]
    assert f"Medians {medians[0]:.1f} against {medians[1]:.1f} %" in page


def test_time_to_accuracy_v3_figures_are_on_the_benchmarks_page() -> None:
    """Recipe v3's target, seeds at it and best top-1 per seed, as its README section words them."""
    summary = {r["arm"]: r for r in json.loads((RESULTS / "time_to_accuracy_v3_summary.json").read_text())}
    recipe = summary["recipe"]
    reached, seeds = recipe["reached"].split("/")
    page = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    for expected in (f"Target {100 * recipe['target']:.2f} %", f"recipe v3 reached it in {reached} of {seeds} seeds",
                     "best top-1 " + " / ".join(f"{100 * b:.1f}" for b in recipe["best_top1"]) + " %"):
        assert expected in page, f"benchmarks/README.md should say {expected!r} (time_to_accuracy_v3_summary.json)"


def time_to_accuracy_tree() -> list[str]:
    """The image tree's figures as docs/time_to_accuracy.md words them."""
    summary = {r["arm"]: r for r in json.loads((RESULTS / "time_to_accuracy_tree_summary.json").read_text())}
    figures = [f"target {100 * summary['plain']['target']:.1f} %",
               f"offline conversion {summary['recipe']['conversion_s']:.1f} s"]
    for arm, r in summary.items():
        median = f", median {r['median_s']:.0f} s" if r["median_s"] is not None else ""
        figures.append(f"{arm}: {r['reached']} seeds at the target{median}, best top-1 "
                       f"{span([100 * b for b in r['best_top1']], '.1f')} %")
    return figures


def test_time_to_accuracy_tree_figures_are_on_the_docs_page() -> None:
    page = " ".join((ROOT / "docs" / "time_to_accuracy.md").read_text().split())
    for expected in time_to_accuracy_tree():
        assert expected in page, f"docs/time_to_accuracy.md should say {expected!r} (time_to_accuracy_tree_summary.json)"


def test_readme_layout_names_every_top_level_module() -> None:
    layout = README.split("## Layout", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"^  (\S+?)/?\s", layout, re.MULTILINE))
    package = ROOT / "lightning_fastscale"
    tree = {p.name for p in package.iterdir() if (p.suffix == ".py" or (p / "__init__.py").is_file() or p.name == "conf")}
    assert tree - named == set(), f"README layout omits {sorted(tree - named)}"
    assert named - tree == set(), f"README layout names what the package lacks: {sorted(named - tree)}"


def test_time_to_accuracy_planned_figures_are_on_the_docs_page() -> None:
    """The planner's-buckets run as docs/time_to_accuracy.md words it."""
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_planned_summary.json").read_text())}
    plain, fp16, planned = (summary[("record", arm)] for arm in ("plain", "fp16_wire", "fp16_wire_planned"))
    cloud_fp16, cloud_planned = summary[("cloud", "fp16_wire")], summary[("cloud", "fp16_wire_planned")]
    page = " ".join((ROOT / "docs" / "time_to_accuracy.md").read_text().split())
    for expected in (f"{planned['speedup_vs_plain']:.2f}x sooner ({planned['median_s']:.0f} s against {plain['median_s']:.0f} s",
                     f"the fp16 wire in one bucket {fp16['speedup_vs_plain']:.2f}x in that run",
                     f"({cloud_planned['speedup_vs_plain']:.2f}x against {cloud_fp16['speedup_vs_plain']:.2f}x)"):
        assert expected in page, f"docs/time_to_accuracy.md should say {expected!r} (time_to_accuracy_planned_summary.json)"


def test_time_to_accuracy_recalibrated_figures_are_on_both_pages() -> None:
    """The planner's-buckets run on the recalibrated regimes, as docs/time_to_accuracy.md and benchmarks/README.md word it."""
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_recalibrated_summary.json").read_text())}
    plain, fp16, planned = (summary[("record", arm)] for arm in ("plain", "fp16_wire", "fp16_wire_planned"))
    sooner = f"{planned['speedup_vs_plain']:.2f}x sooner than plain Lightning (median {planned['median_s']:.0f} s against " \
             f"{plain['median_s']:.0f} s)"
    for page in ("docs/time_to_accuracy.md", "benchmarks/README.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert sooner in text, f"{page} should say {sooner!r} (time_to_accuracy_recalibrated_summary.json)"
        assert f"{plain['comm_ratio']:.2f}x" in text
    readme = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    assert f"fp16_wire {fp16['speedup_vs_plain']:.2f}x" in readme


def test_time_to_accuracy_powersgd_figures_are_on_both_pages() -> None:
    """PowerSGD over 12 epochs against plain Lightning, as docs/time_to_accuracy.md and benchmarks/README.md word it."""
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_powersgd12_summary.json").read_text())}
    plain, powersgd = summary[("record", "plain")], summary[("record", "powersgd")]
    cloud_plain, cloud_powersgd = summary[("cloud", "plain")], summary[("cloud", "powersgd")]
    sooner = f"{powersgd['speedup_vs_plain']:.2f}x sooner than plain Lightning (median {powersgd['median_s']:.0f} s " \
             f"against {plain['median_s']:.0f} s, {powersgd['reached']} seeds against {plain['reached']}"
    cloud = f"{cloud_powersgd['median_s']:.0f} s against plain Lightning's {cloud_plain['median_s']:.0f} s"
    for page in ("docs/time_to_accuracy.md", "benchmarks/README.md"):
        text = " ".join((ROOT / page).read_text().split())
        for expected in (sooner, cloud):
            assert expected in text, f"{page} should say {expected!r} (time_to_accuracy_powersgd12_summary.json)"


def test_time_to_accuracy_powersgd10_figures_are_on_both_pages() -> None:
    """PowerSGD over 10 epochs, as benchmarks/README.md and docs/time_to_accuracy.md word it."""
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_powersgd10_summary.json").read_text())}
    plain, powersgd = summary[("record", "plain")], summary[("record", "powersgd")]
    cloud_plain, cloud_powersgd = summary[("cloud", "plain")], summary[("cloud", "powersgd")]
    per_seed = [p / s for p, s in zip(cloud_plain["seconds"], cloud_powersgd["seconds"])]
    gained = cloud_plain["median_s"] - cloud_powersgd["median_s"]
    # "each seed sooner ... but by less than the seeds' spread"
    assert all(r > 1 for r in per_seed)
    assert gained < max(cloud_plain["seconds"]) - min(cloud_plain["seconds"])
    assert gained < max(cloud_powersgd["seconds"]) - min(cloud_powersgd["seconds"])
    phases = cloud_plain["step_phases_s"]
    free_wire = sum(phases.values()) / (sum(phases.values()) - phases["communication"])
    readme = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    for expected in (f"**Record regime: {powersgd['speedup_vs_plain']:.2f}x sooner than plain Lightning** (median "
                     f"{powersgd['median_s']:.0f} s against {plain['median_s']:.0f} s, {powersgd['reached']} seeds",
                     f"**Cloud regime: {cloud_powersgd['speedup_vs_plain']:.2f}x** (median {cloud_powersgd['median_s']:.0f} s "
                     f"against {cloud_plain['median_s']:.0f} s; per seed " + ", ".join(f"{r:.2f}x" for r in per_seed[:-1])
                     + f" and {per_seed[-1]:.2f}x)", f"the {gained:.0f} s gained",
                     f"at most {free_wire:.2f}x faster"):
        assert expected in readme, f"benchmarks/README.md should say {expected!r} (time_to_accuracy_powersgd10_summary.json)"
    docs = " ".join((ROOT / "docs" / "time_to_accuracy.md").read_text().split())
    for expected in (f"{powersgd['speedup_vs_plain']:.2f}x sooner over the record link, and "
                     f"{cloud_powersgd['speedup_vs_plain']:.2f}x over the cloud link ({cloud_powersgd['median_s']:.0f} s "
                     f"against {cloud_plain['median_s']:.0f} s)",):
        assert expected in docs, f"docs/time_to_accuracy.md should say {expected!r} (time_to_accuracy_powersgd10_summary.json)"


def test_time_to_accuracy_resizing_figures_are_on_the_pages() -> None:
    """The fp16 wire with progressive resizing, as benchmarks/README.md, docs/time_to_accuracy.md and the method card word it."""
    summary = resizing_rows()
    plain, arm = summary[("cloud", "plain")], summary[("cloud", "fp16_wire_resizing")]
    record_plain, record_arm = summary[("record", "plain")], summary[("record", "fp16_wire_resizing")]
    first = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_resizing160_summary.json").read_text())}
    first_plain, first_arm = first[("cloud", "plain")], first[("cloud", "fp16_wire_resizing")]
    per_seed = [p / a for p, a in zip(plain["seconds"], arm["seconds"]) if p is not None]
    phases = {name: (plain["step_phases_s"][name], arm["step_phases_s"][name]) for name in ("communication", "compute")}
    per_epoch = plain["seconds_per_epoch"] / arm["seconds_per_epoch"]
    above = [a - p for p, a in zip(plain["best_top1"], arm["best_top1"])]
    # the prose's "every one of its seeds sooner than every plain seed", and the one pairing the first run lost
    assert slowest(arm["seconds"]) < plain["min_s"] and first_arm["sooner_pairs"] == [24.0, 25]
    assert plain["epochs"] == arm["epochs"] == 7 and min(above) > 0
    readme = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
    for expected in (f"1.41x sooner than plain Lightning** (median {arm['median_s']:.0f} s against {plain['median_s']:.0f} s, "
                     f"{arm['reached']} seeds against {plain['reached']}; per seed " + ", ".join(f"{r:.2f}x" for r in per_seed[:-1])
                     + f" and {per_seed[-1]:.2f}x where plain reached it)",
                     f"{arm['sooner_pairs'][0]:g} of the {arm['sooner_pairs'][1]} pairings, exact one-sided rank-sum p = "
                     f"{arm['rank_sum_p']:.3f}; the slowest against the fastest is {plain['min_s'] / arm['max_s']:.2f}x",
                     f"per epoch {per_epoch:.2f}x faster", f"from {1e3 * phases['communication'][0]:.1f} to "
                     f"{1e3 * phases['communication'][1]:.1f} ms per step", f"compute from {1e3 * phases['compute'][0]:.1f} to "
                     f"{1e3 * phases['compute'][1]:.1f} ms", f"ends {100 * min(above):.1f}-{100 * max(above):.1f} points above",
                     f"**Record regime: {record_arm['speedup_vs_plain']:.2f}x** (median {record_arm['median_s']:.0f} s against "
                     f"{record_plain['median_s']:.0f} s", f"{record_plain['comm_ratio']:.2f}x its compute in these runs",
                     f"{first_arm['speedup_vs_plain']:.2f}x ({first_arm['median_s']:.0f} s against {first_plain['median_s']:.0f} s), "
                     f"{first_arm['sooner_pairs'][0]:g} of 25 pairings (p = {first_arm['rank_sum_p']:.3f})"):
        assert expected in readme, f"benchmarks/README.md should say {expected!r} (time_to_accuracy_resizing*_summary.json)"
    docs = " ".join((ROOT / "docs" / "time_to_accuracy.md").read_text().split())
    for expected in (f"{arm['speedup_vs_plain']:.2f}x sooner than plain Lightning over the cloud link (median {arm['median_s']:.0f} s "
                     f"against {plain['median_s']:.0f} s)", f"({arm['sooner_pairs'][0]:g} of {arm['sooner_pairs'][1]} pairings, "
                     f"one-sided rank-sum p = {arm['rank_sum_p']:.3f})", f"were {per_epoch:.2f}x faster",
                     f"crossing at the same epoch {arm['epochs']} and ending higher ({span([100 * b for b in arm['best_top1']], '.1f')} % "
                     f"against {span([100 * b for b in plain['best_top1']], '.1f')} %)",
                     f"exposed all-reduce from {1e3 * phases['communication'][0]:.1f} to {1e3 * phases['communication'][1]:.1f} ms",
                     f"compute from {1e3 * phases['compute'][0]:.1f} to {1e3 * phases['compute'][1]:.1f} ms",
                     f"it gave {record_arm['speedup_vs_plain']:.2f}x", f"exposed all-reduce {record_plain['comm_ratio']:.2f}x its compute"):
        assert expected in docs, f"docs/time_to_accuracy.md should say {expected!r} (time_to_accuracy_resizing_summary.json)"
    card = " ".join((ROOT / "docs" / "methods" / "progressive_resizing.md").read_text().split())
    for expected in (f"compute fell from {1e3 * phases['compute'][0]:.1f} to {1e3 * phases['compute'][1]:.1f} ms per step",
                     f"ended {100 * min(above):.1f}-{100 * max(above):.1f} points above",
                     f"at the same epoch as plain Lightning ({plain['epochs']:.0f})",
                     f"reached the target {arm['speedup_vs_plain']:.2f}x sooner"):
        assert expected in card, f"docs/methods/progressive_resizing.md should say {expected!r} (time_to_accuracy_resizing_summary.json)"


def test_doctor_docs_compressed_wire_figures_match_results() -> None:
    """docs/doctor.md's compressed-wire bound against what PowerSGD measured, both regimes of the 12-epoch run."""
    summary = {(r["machine"], r["arm"]): r for r in json.loads((RESULTS / "time_to_accuracy_powersgd12_summary.json").read_text())}
    page = " ".join((ROOT / "docs" / "doctor.md").read_text().split())
    for machine in ("record", "cloud"):
        plain, powersgd = summary[(machine, "plain")], summary[(machine, "powersgd")]
        step = sum(plain["step_phases_s"].values())
        bound = step / (step - plain["step_phases_s"]["communication"])
        per_epoch = plain["seconds_per_epoch"] / powersgd["seconds_per_epoch"]
        expected = (f"{bound:.2f}x for plain Lightning's step over the {machine} link, where PowerSGD's epochs ran "
                    f"{per_epoch:.2f}x faster and it reached the target {powersgd['speedup_vs_plain']:.2f}x sooner")
        assert expected in page, f"docs/doctor.md should say {expected!r} (time_to_accuracy_powersgd12_summary.json)"


def test_doctor_docs_smaller_images_figures_match_results() -> None:
    """docs/doctor.md's smaller-images bound against what the resizing arm measured over the cloud link."""
    from lightning_fastscale.diagnostics.doctor import Measurements, smaller_images_bound

    summary = resizing_rows()
    plain, arm = summary[("cloud", "plain")], summary[("cloud", "fp16_wire_resizing")]
    step_parts = Measurements(parts=[plain["step_phases_s"]], batch_size=32)
    at_two_thirds = smaller_images_bound(step_parts, initial_scale=2 / 3)
    step = sum(plain["step_phases_s"].values())
    saved = plain["step_phases_s"]["compute"] - arm["step_phases_s"]["compute"]
    page = " ".join((ROOT / "docs" / "doctor.md").read_text().split())
    for expected in (f"`smaller images: ... at most {smaller_images_bound(step_parts):.2f}x faster per step over a run here`",
                     f"the bound at the arm's initial scale of 2/3 was {at_two_thirds:.2f}x, and the arm's compute fell by "
                     f"{1e3 * saved:.1f} ms per step of the {1e3 * (step - step / at_two_thirds):.1f} ms the bound allows",
                     f"reached the target {arm['speedup_vs_plain']:.2f}x sooner than plain Lightning"):
        assert expected in page, f"docs/doctor.md should say {expected!r} (time_to_accuracy_resizing_summary.json)"


def test_sweep_docs_figures_match_results() -> None:
    page = " ".join((ROOT / "docs" / "time_to_accuracy.md").read_text().split())
    returned = results("time_to_accuracy_sweeps")["report"]["returned"]
    grid = [r["seconds"] for r in returned["grid"]]
    assert f"{min(grid):.1f} to {max(grid):.1f} s, a {max(grid) / min(grid) - 1:.0%} spread".replace("%", " %") in page
    assert f"Optuna's best value is the first row's {returned['search_best']['best_value']:.1f} s" in page
