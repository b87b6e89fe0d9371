"""Step breakdown: the pure summary on synthetic numbers, and real fits with injected bottlenecks.

One-process fits (CPU): the parts add up to the step time measured by an independent callback;
a slow loader is named ``input``; a large model on in-memory data ``compute``. Two ranks (gloo,
one ``run_distributed`` spawn shared by two fits): one rank slowed by an extra delay is named
``straggler`` with its rank; an all-reduce hook whose future completes late is named
``communication``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_fastscale.diagnostics import (
    PHASES,
    RankTotals,
    StepBreakdown,
    StepTimer,
    breakdown_table,
    summarize,
    summarize_steps,
    write_report,
)
from tests.distributed import run_distributed


# -- pure core ---------------------------------------------------------------------------------
def _ranks(*per_rank: dict[str, float], steps: int = 10) -> list[RankTotals]:
    return [RankTotals(r, steps, {k: v * steps for k, v in parts.items()}, samples=32.0 * steps)
            for r, parts in enumerate(per_rank)]


@pytest.mark.parametrize(
    ("parts", "verdict"),
    [
        ({"input": 0.30, "compute": 0.10, "communication": 0.01}, "input"),
        ({"input": 0.01, "compute": 0.30, "communication": 0.05, "optimizer": 0.02}, "compute"),
        ({"input": 0.01, "compute": 0.10, "communication": 0.25}, "communication"),
    ],
)
def test_balanced_ranks_get_the_largest_part(parts, verdict):
    s = summarize(_ranks(parts, parts, parts, parts))
    assert s.bottleneck == verdict
    assert s.straggler_s == 0.0 and s.world_size == 4
    assert s.step_s == pytest.approx(sum(parts.values()))
    assert s.phases["input"] == pytest.approx(parts["input"])
    assert sum(s.shares.values()) == pytest.approx(1.0)
    # 4 ranks x 32 samples per step, over step_s seconds per step
    assert s.samples_per_s == pytest.approx(4 * 32 / s.step_s)


def test_one_slow_rank_is_named_and_its_wait_is_not_communication():
    # rank 2 computes 0.2 s longer; the others wait for it inside their all-reduce
    fast = {"input": 0.01, "compute": 0.10, "communication": 0.22}
    slow = {"input": 0.01, "compute": 0.30, "communication": 0.02}
    s = summarize(_ranks(fast, fast, slow, fast))
    assert s.bottleneck == "straggler"
    assert s.slowest_rank == 2 and s.straggler_phase == "compute"
    assert s.straggler_s == pytest.approx(0.20)
    assert s.straggler_share == pytest.approx(0.20 / 0.33)
    assert s.scores["communication"] == pytest.approx(0.02)
    assert s.phases["communication"] == pytest.approx(0.22)  # the median rank's view, unchanged


def test_summarize_steps_and_table_and_json(tmp_path):
    steps = [[{"input": 0.01, "compute": 0.1, "rest": 0.001}] * 5, [{"input": 0.2, "compute": 0.1}] * 5]
    s = summarize_steps(steps, samples_per_step=[8, 8])
    assert s.bottleneck == "straggler" and s.slowest_rank == 1 and s.straggler_phase == "input"
    assert s.steps == 5
    table = breakdown_table(s)
    assert "| input |" in table and "bottleneck: **straggler**" in table and "rank 1" in table
    first = write_report(tmp_path, s, [s])
    second = write_report(tmp_path, s, [s])  # never overwrites: a new stem
    assert first["json"].name == "step_breakdown.json" and second["json"].name == "step_breakdown-1.json"
    doc = json.loads(first["json"].read_text())
    assert doc["summary"]["bottleneck"] == "straggler" and set(doc["summary"]["phases"]) == set(PHASES)
    assert first["png"].read_bytes()[:4] == b"\x89PNG"


def test_timer_splits_marks_into_parts():
    timer = StepTimer("cpu")
    timer.reset_origin()
    origin = timer._origin_t
    # hand-made time stamps: 5 ms gap of which 3 ms fetch, 10 ms forward, 20 ms backward,
    # 7 ms from the last gradient to the end of backward, 1 ms, 4 ms optimizer
    marks = {"batch_start": 0.005, "before_backward": 0.015, "last_grad": 0.035, "after_backward": 0.042,
             "before_optimizer": 0.043, "end": 0.047}
    timer._times = {k: origin + v for k, v in marks.items()}
    timer.add_input(0.003)
    timer.end_batch(samples=4)
    (step,) = timer.drain()
    expected = {"input": 0.003, "compute": 0.030, "communication": 0.007, "optimizer": 0.004, "rest": 0.003}
    assert step.seconds == pytest.approx(expected, abs=1e-9)
    assert step.total_s == pytest.approx(0.047)


def test_timer_gradient_accumulation_joins_batches():
    timer = StepTimer("cpu")
    timer.reset_origin()
    for stepped in (False, False, True):
        for mark in ("batch_start", "before_backward", "after_backward"):
            timer.mark(mark)
        if stepped:
            timer.mark("before_optimizer")
        timer.end_batch(samples=2, optimizer_stepped=stepped)
    (step,) = timer.drain()
    assert step.samples == 6.0 and timer.steps == 1


# -- one process ---------------------------------------------------------------------------------
class _SlowImages(Dataset):
    """Images that take ``delay`` seconds each to 'decode'."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return torch.full((3, 8, 8), float(i % 7)), i % 4


class _Net(pl.LightningModule):
    def __init__(self, in_features: int = 192, width: int = 16, depth: int = 1, delay_rank: int | None = None,
                 delay: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, width)]
        for _ in range(depth - 1):
            layers += [nn.ReLU(), nn.Linear(width, width)]
        self.net = nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 4))
        self.delay_rank, self.delay = delay_rank, delay

    def training_step(self, batch, batch_idx):
        if self.delay_rank == self.global_rank:
            time.sleep(self.delay)  # an injected straggler: this rank's forward is slower
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _StepEnds(pl.Callback):
    """Independent clock: the time at each training batch end."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.t.append(time.perf_counter())


def _fit(model, loader, tmp_path, **kw) -> tuple[StepBreakdown, _StepEnds]:
    breakdown, ends = StepBreakdown(every_n_steps=3, dirpath=tmp_path), _StepEnds()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, default_root_dir=tmp_path,
                         callbacks=[breakdown, ends], **kw)
    trainer.fit(model, loader)
    return breakdown, ends


def test_slow_loader_is_input_and_parts_add_up_to_the_step(tmp_path):
    loader = DataLoader(_SlowImages(8 * 8, delay=0.004), batch_size=8)  # ~32 ms per batch, 0 workers
    breakdown, ends = _fit(_Net(), loader, tmp_path)
    s = breakdown.summary
    assert s.bottleneck == "input", breakdown_table(s)
    assert s.steps == 7  # 8 steps, the first is warm-up
    # the parts of steps 1..7 against the independent clock from the end of step 0 to step 7
    measured = ends.t[-1] - ends.t[0]
    assert s.step_s * s.steps == pytest.approx(measured, rel=0.05)
    assert s.phases["input"] >= 0.8 * 8 * 0.004  # at least most of the sleeping is seen as input
    assert s.images_per_s == pytest.approx(s.samples_per_s) and s.samples_per_s == pytest.approx(8 / s.step_s)
    doc = json.loads((tmp_path / "step_breakdown.json").read_text())
    assert doc["summary"]["bottleneck"] == "input" and [w["last_step"] for w in doc["windows"]] == [2, 5, 7]
    assert (tmp_path / "step_breakdown.png").exists() and (tmp_path / "step_breakdown.md").exists()


class _SlowValidation(_Net):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.1)


class _ValidationClock(_StepEnds):
    def on_validation_start(self, *args) -> None:
        self.val_start = time.perf_counter()

    def on_validation_end(self, *args) -> None:
        self.val_s = time.perf_counter() - self.val_start


def test_validation_inside_an_epoch_is_not_part_of_a_step(tmp_path):
    data = TensorDataset(torch.randn(8 * 8, 3, 8, 8), torch.randint(0, 4, (8 * 8,)))
    loader = DataLoader(data, batch_size=8)
    breakdown, clock = StepBreakdown(every_n_steps=3, dirpath=tmp_path, print_table=False), _ValidationClock()
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, default_root_dir=tmp_path, callbacks=[breakdown, clock],
                         val_check_interval=4, limit_val_batches=3)
    trainer.fit(_SlowValidation(), loader, loader)
    s = breakdown.summary
    assert s.steps == 7 and clock.val_s >= 0.3  # one validation, after step 3 (steps 0-7)
    # steps 1..7 by the independent clock, less the validation between steps 3 and 4
    assert s.step_s * s.steps == pytest.approx(clock.t[-1] - clock.t[0] - clock.val_s, abs=0.03)


def test_large_model_on_fast_data_is_compute(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(6 * 128, 512), torch.randint(0, 4, (6 * 128,)))
    model = _Net(in_features=512, width=1024, depth=3)
    breakdown, _ = _fit(model, DataLoader(data, batch_size=128), tmp_path)
    assert breakdown.summary.bottleneck == "compute", breakdown_table(breakdown.summary)
    assert breakdown.summary.shares["compute"] > 0.5


def test_fabric_api_slow_loader_is_input_and_adds_up(tmp_path):
    from lightning.fabric import Fabric

    from lightning_fastscale.diagnostics import FabricStepBreakdown

    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    batches = iter(fabric.setup_dataloaders(DataLoader(_SlowImages(8 * 7, delay=0.004), batch_size=8)))
    breakdown = FabricStepBreakdown(fabric, model, every_n_steps=3)
    clock = [time.perf_counter()]
    for _ in range(7):
        with breakdown.phase("input"):
            x, y = next(batches)
        with breakdown.phase("compute"):
            fabric.backward(nn.functional.cross_entropy(model(x), y))
        with breakdown.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        breakdown.step_end(samples=len(x))
        clock.append(time.perf_counter())
    s = breakdown.finish()
    assert s.bottleneck == "input", breakdown_table(s)
    assert s.steps == 6 and [w.last_step for w in breakdown.windows] == [2, 5, 6]
    # steps 1..6 (after the warm-up step) against the loop's own clock; the gather of a window
    # happens inside step_end, after the step's end mark, and goes to the next step's rest
    assert s.step_s * s.steps == pytest.approx(clock[-1] - clock[1], rel=0.05)
    assert s.phases["compute"] > 0 and s.samples_per_s == pytest.approx(8 / s.step_s)
    paths = breakdown.save(tmp_path)
    assert json.loads(paths["json"].read_text())["summary"]["bottleneck"] == "input"


# -- two ranks -----------------------------------------------------------------------------------
COMM_DELAY = 0.15


def late_allreduce_hook(state, bucket):  # no annotations: DDP checks them as objects
    """DDP's all-reduce whose future completes ``COMM_DELAY`` seconds late: a slow link."""
    work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)

    def late(fut):
        time.sleep(COMM_DELAY)
        return fut.value()[0]

    return work.get_future().then(late)


class _LateAllReduceDDP(DDPStrategy):
    """DDP with :func:`late_allreduce_hook` (Lightning registers ``ddp_comm_hook`` only on CUDA)."""

    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(None, late_allreduce_hook)


def _two_rank_worker(rank: int, world_size: int, tmp: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(7 * 8, 3, 8, 8), torch.randint(0, 4, (7 * 8,)))
    out = {}
    cases = {
        "straggler": (_Net(delay_rank=1, delay=0.12), DDPStrategy()),
        "communication": (_Net(), _LateAllReduceDDP()),
    }
    for name, (model, strategy) in cases.items():
        breakdown = StepBreakdown(every_n_steps=3, dirpath=Path(tmp) / name, print_table=False)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                             default_root_dir=Path(tmp) / name,
                             callbacks=[breakdown], use_distributed_sampler=False)
        trainer.fit(model, DataLoader(data, batch_size=8))
        out[name] = breakdown.summary.to_dict() if breakdown.summary else None
    return out


@pytest.mark.slow  # two rank processes, about 12 s
def test_two_ranks_straggler_and_communication(tmp_path):
    results = run_distributed(_two_rank_worker, 2, str(tmp_path), timeout=240)
    for case in ("straggler", "communication"):
        # every rank gathered the same windows, so every rank holds the same summary
        assert results[0][case] == results[1][case]
    s = results[0]["straggler"]
    assert s["bottleneck"] == "straggler" and s["slowest_rank"] == 1, s
    assert s["straggler_phase"] == "compute" and s["straggler_s"] >= 0.8 * 0.12
    # rank 0 waits for rank 1 inside backward's all-reduce
    assert s["per_rank"][0]["phases"]["communication"] >= 0.8 * 0.12
    c = results[0]["communication"]
    assert c["bottleneck"] == "communication", c
    assert c["phases"]["communication"] >= 0.8 * COMM_DELAY
    assert c["phases"]["compute"] < COMM_DELAY  # the late future is not counted as backward
    assert json.loads((tmp_path / "communication" / "step_breakdown.json").read_text())["summary"] == c


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: records the fake GPU clock, completes on request."""

    clock = 0.0

    def __init__(self) -> None:
        self.t = _FakeEvent.clock
        self.done = False

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return (other.t - self.t) * 1e3  # milliseconds, as CUDA events report

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_timer_on_cuda_reads_events_lazily_and_uses_the_gpu_timeline(monkeypatch):
    monkeypatch.setattr(StepTimer, "_event", lambda self: _FakeEvent())
    timer = StepTimer("cpu")
    timer.cuda = True  # what StepTimer("cuda") sets on a GPU machine
    param = nn.Parameter(torch.ones(2))
    timer.attach([param])

    def at(t: float) -> None:
        _FakeEvent.clock = t

    at(0.0), timer.reset_origin()
    at(0.010), timer.mark("batch_start")
    at(0.030), timer.mark("before_backward")
    at(0.050), (param * 2).sum().backward()  # the gradient hook records the last_grad event
    at(0.070), timer.mark("after_backward")
    at(0.071), timer.mark("before_optimizer")
    at(0.075), timer.mark("end")
    timer.add_input(0.004)  # host fetch time: caps the GPU's 10 ms gap as input
    timer.end_batch(samples=1)
    assert timer.drain() == []  # the end event has not completed: nothing is read, nothing waits
    (step,) = timer.drain(block=True)
    expected = {"input": 0.004, "compute": 0.040, "communication": 0.020, "optimizer": 0.004, "rest": 0.007}
    assert step.seconds == pytest.approx(expected, abs=1e-9)


def _hier_worker(rank: int, world_size: int, tmp: str) -> dict | None:
    from lightning_fastscale.strategies import HierarchicalAllReduceStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(7 * 8, 3, 8, 8), torch.randint(0, 4, (7 * 8,)))
    # 2 emulated nodes of 1 rank: the late hook is the inter-node stage, run on the strategy's
    # communication thread
    strategy = HierarchicalAllReduceStrategy(algorithm="hier", ranks_per_node=1, ddp_comm_hook=late_allreduce_hook)
    breakdown = StepBreakdown(every_n_steps=3, dirpath=Path(tmp), print_table=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, default_root_dir=tmp,
                         callbacks=[breakdown], use_distributed_sampler=False)
    trainer.fit(_Net(), DataLoader(data, batch_size=8))
    return breakdown.summary.to_dict() if breakdown.summary else None


@pytest.mark.slow
def test_hier_ring_late_inter_node_stage_is_communication(tmp_path):
    c, _ = run_distributed(_hier_worker, 2, str(tmp_path), timeout=240)
    assert c["bottleneck"] == "communication", c
    assert c["phases"]["communication"] >= 0.8 * COMM_DELAY and c["phases"]["compute"] < COMM_DELAY


def _plain_trainer_worker(rank: int, world_size: int, tmp: str) -> dict:
    """A plain ``pl.Trainer`` with Lightning's defaults and ``StepBreakdown()`` without arguments."""
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * 8, 3, 8, 8), torch.randint(0, 4, (4 * 8,)))
    breakdown = StepBreakdown()
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=1, default_root_dir=tmp, callbacks=[breakdown])
    trainer.fit(_Net(), DataLoader(data, batch_size=8))
    return {"paths": {k: str(v) for k, v in breakdown.paths.items()}, "log_dir": trainer.log_dir,
            "steps": breakdown.summary.steps if breakdown.summary else None}


def test_no_argument_step_breakdown_on_a_plain_two_rank_trainer(tmp_path):
    """The report folder is resolved on every rank (``trainer.log_dir`` is a collective)."""
    r0, r1 = run_distributed(_plain_trainer_worker, 2, str(tmp_path), timeout=180)
    assert r0["steps"] == r1["steps"] == 1  # 2 steps per rank, the first is warm-up
    report = Path(r0["paths"]["json"])
    assert report.parent == Path(r0["log_dir"]) and report.is_relative_to(tmp_path)
    assert json.loads(report.read_text())["summary"]["steps"] == 1
    assert r1["paths"] == {}  # only rank zero writes
