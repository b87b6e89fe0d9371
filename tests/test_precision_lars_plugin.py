"""``LARSMixedPrecision`` inside a real Lightning Trainer on the CPU."""
from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from lightning_fastscale.param_groups import split_parameters
from lightning_fastscale.precision import LARS, LARSFabricPrecision, LARSMixedPrecision
from tests.distributed import ReleaseProcessGroup, run_distributed


def textbook(w, g, *, lr, wd, eta, eps, clip):
    """You et al. 2017 for one layer, in float64 with Python floats."""
    w, g = w.double(), g.double()
    wn, gn = math.sqrt(float((w * w).sum())), math.sqrt(float((g * g).sum()))
    local = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
    if clip:
        local = min(local / lr, 1.0)
    return local * (g + wd * w)


def make_net(bn: bool = True) -> nn.Module:
    torch.manual_seed(0)
    mid = [nn.BatchNorm1d(8)] if bn else []
    return nn.Sequential(nn.Linear(4, 8), *mid, nn.ReLU(), nn.Linear(8, 3))


class Tiny(pl.LightningModule):
    """SGD over two groups: adapted (weight decay ``wd``) and bias/norm (no decay)."""

    def __init__(self, net: nn.Module, lr=0.5, momentum=0.9, wd=1e-2, inject: dict | None = None) -> None:
        super().__init__()
        self.net, self.lr, self.momentum, self.wd = net, lr, momentum, wd
        self.inject = inject or {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_after_backward(self) -> None:
        # before the plugin unscales: the scaler must see the bad value too
        if self.trainer.global_step in self.inject:
            self.net[0].weight.grad[0, 0] = self.inject[self.trainer.global_step]

    def configure_optimizers(self):
        adapted, excluded = split_parameters(self.net)
        return torch.optim.SGD(
            [{"params": [p for _, p in adapted]}, {"params": [p for _, p in excluded], "weight_decay": 0.0}],
            lr=self.lr, momentum=self.momentum, weight_decay=self.wd,
        )


def data(n: int = 24, batch: int = 4) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(3)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen))
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False)


def trainer(plugin, tmp_path: Path, **kw) -> pl.Trainer:
    opts = dict(
        accelerator="cpu", devices=1, default_root_dir=str(tmp_path), plugins=[plugin],
    )
    opts.update(kw)
    return pl.Trainer(**opts)


def small_scaler(**kw) -> torch.amp.GradScaler:
    # a start scale low enough that this tiny model never overflows on its own
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, **kw)


class Recorder(Callback):
    """Weights, momentum, gradients (as LARS receives them), scale and skip flag per step."""

    def __init__(self) -> None:
        self.before, self.after, self.grads, self.momentum, self.scale, self.skipped = [], [], [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append([p.detach().clone() for p in pl_module.parameters()])
        opt = trainer.optimizers[0]
        self.momentum.append([opt.state[p]["momentum_buffer"].clone() for p in pl_module.parameters() if p in opt.state])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        self.after.append([p.detach().clone() for p in pl_module.parameters()])
        self.scale.append(plugin.scaler.get_scale() if plugin.scaler is not None else None)
        self.skipped.append(plugin.last_step_skipped)


def reference_grads(net: nn.Module, batch) -> list[torch.Tensor]:
    """fp32 gradients of the first step, computed outside Lightning and the plugin."""
    net = copy.deepcopy(net).train()
    x, y = batch
    F.cross_entropy(net(x), y).backward()
    return [p.grad for p in net.parameters()]


@pytest.mark.parametrize(
    "precision, wd, clip, rtol, atol, clip_val",
    [
        ("32", 1e-2, False, 1e-5, 1e-7, None),
        ("32", 0.0, True, 1e-5, 1e-7, None),
        ("32", 5e-2, True, 1e-5, 1e-7, None),
        # gradient clipping by total norm happens on the unscaled gradients, before LARS
        ("32", 5e-2, False, 1e-5, 1e-7, 0.05),
        # fp16 compute: gradients carry fp16 rounding (~1e-4 absolute here)
        ("16-mixed", 1e-2, False, 2e-2, 1e-4, None),
    ],
)
def test_one_step_equals_textbook_formula(tmp_path, precision, wd, clip, rtol, atol, clip_val) -> None:
    """First step, momentum SGD (buffer = first update): w1 = w0 - lr * g', g' from the
    formula on gradients computed independently in fp32. Under 16-mixed the plugin scales
    the loss by 2^8: using loss-scaled gradients in the ratio (apex #1030) would fail here."""
    net = make_net()
    lr, eta = 0.5, 0.02
    ref = reference_grads(net, next(iter(data())))
    w0 = [p.detach().clone() for p in net.parameters()]
    plugin = LARSMixedPrecision(precision, "cpu", eta=eta, trust_clip=clip, scaler=small_scaler() if precision == "16-mixed" else None)
    rec = Recorder()
    trainer(plugin, tmp_path, max_steps=1, callbacks=[rec], gradient_clip_val=clip_val).fit(Tiny(net, lr=lr, wd=wd), data())
    assert plugin.skipped_steps == 0
    adapted = {id(p) for _, p in split_parameters(net)[0]}
    for g, seen in zip(ref, rec.grads[0]):
        torch.testing.assert_close(seen, g, rtol=rtol, atol=atol * 10)  # hooks see unscaled gradients
    if clip_val is not None:
        total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in ref))
        assert total > clip_val  # the clipping is active
        ref = [g * (clip_val / (total + 1e-6)) for g in ref]
    for p, w, g in zip(net.parameters(), w0, ref):
        if id(p) in adapted:
            update = textbook(w, g, lr=lr, wd=wd, eta=eta, eps=1e-8, clip=clip)
        else:
            update = g.double()  # excluded: plain SGD, group weight decay 0
        torch.testing.assert_close(p.detach().double(), w.double() - lr * update, rtol=rtol, atol=atol)


@pytest.mark.parametrize("precision, bad", [("16-mixed", math.inf), ("bf16-mixed", math.nan), ("32", -math.inf)])
def test_non_finite_gradient_skips_the_step(tmp_path, precision, bad) -> None:
    plugin = LARSMixedPrecision(precision, "cpu", scaler=small_scaler() if precision == "16-mixed" else None)
    rec = Recorder()
    net = make_net()
    trainer(plugin, tmp_path, max_steps=4, callbacks=[rec]).fit(Tiny(net, inject={2: bad}), data())
    assert rec.skipped == [False, False, True, False]
    assert plugin.skipped_steps == 1
    for step in range(4):
        moved = [not torch.equal(a, b) for a, b in zip(rec.before[step], rec.after[step])]
        # (the bias before BN has a zero gradient in fp32, so not every tensor moves)
        assert not any(moved) if step == 2 else moved[0] and moved[-1], (step, moved)
    # momentum untouched by the skipped step: what step 3 starts from is what step 2 started from
    assert all(torch.equal(a, b) for a, b in zip(rec.momentum[2], rec.momentum[3]))
    assert len(rec.momentum[2]) == len(list(net.parameters()))
    if precision == "16-mixed":
        assert rec.scale[2] == rec.scale[1] * 0.5
        assert rec.scale[3] == rec.scale[2]


def test_skip_count_is_logged(tmp_path) -> None:
    plugin = LARSMixedPrecision("16-mixed", "cpu", scaler=small_scaler())
    tr = trainer(plugin, tmp_path, max_steps=3)
    tr.fit(Tiny(make_net(), inject={1: math.inf}), data())
    assert float(tr.callback_metrics["lars/skipped_steps"]) == 1.0
    assert float(tr.callback_metrics["lars/loss_scale"]) == 2.0**7


def test_tiny_weights_fp16_master_update_is_not_lost(tmp_path) -> None:
    """Jia et al. 2018: LARS on fp16 weights loses its updates. Tiny weights (~1e-3) and
    gradients (~1e-8): in plain fp16 the gradient underflows to zero and, even given the
    right update, w - lr*g' rounds back to w. With fp16 compute, loss scaling and fp32
    master weights the update is applied and equals the formula."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        lin.weight.uniform_(0.5e-3, 1.5e-3)
    c = 1e-9
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    lr, eta = 0.1, 1e-3

    class TinyWeights(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = copy.deepcopy(lin)

        def training_step(self, batch, batch_idx):
            return (self.lin(batch[0]).float() * c).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.0)

    # exact gradient: dL/dW[i, j] = c * sum_b x[b, j]
    g_true = (c * x.double().sum(0)).expand(16, 16)
    w0 = lin.weight.detach().clone()
    update = -lr * textbook(w0, g_true, lr=lr, wd=0.0, eta=eta, eps=1e-8, clip=False)

    # the naive fp16 path: the gradient underflows ...
    half = copy.deepcopy(lin).half()
    (half(x.half()).float() * c).sum().backward()
    assert torch.count_nonzero(half.weight.grad) == 0
    # ... and even the right update vanishes when added to fp16 weights
    w16 = w0.half()
    unchanged = (w16 + update.half()) == w16
    assert unchanged.float().mean() > 0.9

    module = TinyWeights()
    plugin = LARSMixedPrecision("16-mixed", "cpu", eta=eta, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    trainer(plugin, tmp_path, max_steps=1).fit(module, loader)
    assert plugin.skipped_steps == 0
    delta = module.lin.weight.detach().double() - w0.double()
    assert torch.count_nonzero(delta) == delta.numel()
    torch.testing.assert_close(delta, update, rtol=1e-2, atol=0)


def run_resumable(tmp_path, precision, max_steps, ckpt_path=None, callbacks=()):
    """Tiny with trust_clip, an inf at step 1 and (16-mixed) a scaler growing every 2 steps."""
    scaler = small_scaler(growth_interval=2) if precision == "16-mixed" else None
    plugin = LARSMixedPrecision(precision, "cpu", trust_clip=True, scaler=scaler)
    module = Tiny(make_net(), inject={1: math.inf})
    tr = trainer(plugin, tmp_path, max_steps=max_steps, callbacks=list(callbacks), enable_checkpointing=True)
    tr.fit(module, data(n=12), ckpt_path=ckpt_path)
    return module, plugin, tr


def assert_same_run(a, b) -> None:
    (mod_a, plugin_a, tr_a), (mod_b, plugin_b, tr_b) = a, b
    assert tr_a.global_step == tr_b.global_step == 6
    assert plugin_a.skipped_steps == plugin_b.skipped_steps == 1
    assert (plugin_a.scaler is None and plugin_b.scaler is None) or (
        plugin_a.scaler.get_scale() == plugin_b.scaler.get_scale())
    for x, y in zip(mod_a.parameters(), mod_b.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        # atol: the bias before BN has a gradient that is 0 up to rounding, so its momentum is noise
        torch.testing.assert_close(tr_a.optimizers[0].state[x]["momentum_buffer"],
                                   tr_b.optimizers[0].state[y]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_resume_equals_uninterrupted(tmp_path) -> None:
    """Weights, momentum, loss scale and the skip counter after save/resume/continue equal
    those of one run. The scaler grows every 2 steps and one step is skipped, so a lost
    scaler state or counter shows."""
    # step 3 is the last batch of epoch 0: the data position is unambiguous on resume (a plain
    # DataLoader cannot resume inside an epoch; Lightning restarts that epoch)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full = run_resumable(tmp_path, "16-mixed", 6, callbacks=[ckpt])
    mid = tmp_path / "ckpt" / "step=3.ckpt"
    state = torch.load(mid, weights_only=False)["LARSMixedPrecision"]
    assert state["skipped_steps"] == 1 and state["scaler"]["scale"] != 2.0**8
    assert_same_run(run_resumable(tmp_path, "16-mixed", 6, ckpt_path=str(mid)), full)


@pytest.mark.parametrize("precision, name", [("16-mixed", "lars_16mixed_step3.ckpt"), ("32-true", "lars_32true_step3.ckpt")])
def test_checkpoint_of_the_previous_class_layout_resumes(tmp_path, precision, name) -> None:
    """``tests/data/lars_*_step3.ckpt`` were written by the plugin's earlier layout (state under
    ``LARSAutocastPrecision`` / ``LARSFP32Precision``, 3 steps of ``run_resumable``): resuming
    from them restores the counter and the loss scale and lands where one run of 6 steps does."""
    fixture = Path(__file__).parent / "data" / name
    assert {"LARSAutocastPrecision", "LARSFP32Precision"} & set(torch.load(fixture, weights_only=False))
    full = run_resumable(tmp_path, precision, 6)
    assert_same_run(run_resumable(tmp_path, precision, 6, ckpt_path=str(fixture)), full)


def test_fabric_state_of_the_previous_layout_loads() -> None:
    """``tests/data/lars_fabric_16mixed_step3.pt``: the Fabric plugin's state (scaler and counters)
    and the SGD state, written by the earlier layout after 3 steps with one skipped."""
    state = torch.load(Path(__file__).parent / "data" / "lars_fabric_16mixed_step3.pt", weights_only=False)
    plugin = LARSFabricPrecision("16-mixed", "cpu", scaler=small_scaler(growth_interval=2))
    plugin.load_state_dict(state["precision"])
    assert plugin.skipped_steps == 1 and plugin.consecutive_skipped_steps == 0 and not plugin.last_step_skipped
    assert plugin.scaler.get_scale() == 2.0**7 and plugin.state_dict() == state["precision"]
    module = Tiny(make_net())
    module.net.load_state_dict(state["model"])
    opt = module.configure_optimizers()
    opt.load_state_dict(state["optimizer"])
    assert all("momentum_buffer" in opt.state[p] for p in module.net.parameters())


def test_gradient_accumulation_equals_large_batch(tmp_path) -> None:
    """Two accumulated batches of 4 take the same LARS steps as batches of 8 (no BN)."""
    results = []
    for batch, accumulate in ((8, 1), (4, 2)):
        module = Tiny(make_net(bn=False), wd=1e-3)
        plugin = LARSMixedPrecision("32", "cpu", eta=0.01)
        trainer(plugin, tmp_path, max_steps=3, accumulate_grad_batches=accumulate).fit(module, data(batch=batch))
        results.append([p.detach().clone() for p in module.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision="16-mixed", eta=-0.001), "eta"),
        (dict(precision="8-mixed"), "precision='8-mixed'"),
        (dict(precision="bf16-mixed", eps=-1.0), "eps"),
        (dict(precision="32", scaler=torch.amp.GradScaler("cpu")), "scaler"),
        (dict(precision="32", device="tpu"), "device"),
        (dict(precision="32", exclude=[""]), "pattern"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        LARSMixedPrecision(**{"device": "cpu", **kwargs})


def test_excluding_every_parameter_fails_before_training(tmp_path) -> None:
    module = Tiny(make_net())
    w0 = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=r"exclude all .* parameters"):
        trainer(LARSMixedPrecision("32", "cpu", exclude=["net.*"]), tmp_path, max_steps=1).fit(module, data())
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), w0))


def test_half_weights_adamw_and_double_lars_are_refused(tmp_path) -> None:
    module = Tiny(make_net())
    module.half()
    with pytest.raises(ValueError, match="fp32 master weights"):
        trainer(LARSMixedPrecision("16-mixed", "cpu"), tmp_path, max_steps=1).fit(module, data())

    class WithAdamW(Tiny):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), weight_decay=0.01)

    with pytest.raises(ValueError, match="decoupled"):
        trainer(LARSMixedPrecision("32", "cpu"), tmp_path, max_steps=1).fit(WithAdamW(make_net()), data())

    class WithLARS(Tiny):
        def configure_optimizers(self):
            return LARS(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="second time"):
        trainer(LARSMixedPrecision("32", "cpu"), tmp_path, max_steps=1).fit(WithLARS(make_net()), data())


class LastRankInjected(Tiny):
    """Puts a bad value into the last rank's gradient only, after DDP's all-reduce: the other ranks stay finite."""

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.inject and self.global_rank == self.trainer.world_size - 1:
            self.net[0].weight.grad[0, 0] = self.inject[self.trainer.global_step]


class RankInjected(LastRankInjected):
    """`LastRankInjected` with a global batch laid out as one process's."""

    def train_dataloader(self):
        # rank r gets samples r, r+2, ...: step k's global batch is samples 8k..8k+7 on both layouts
        loader = data(batch=8 // self.trainer.world_size)
        sampler = torch.utils.data.DistributedSampler(
            loader.dataset, self.trainer.world_size, self.global_rank, shuffle=False
        )
        return torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)


def test_ddp_two_processes_equals_single_process(tmp_path) -> None:
    """2 CPU processes x batch 4 (gloo DDP) take the same LARS steps as one process x batch 8,
    including a step skipped because one rank alone saw an inf (no BN: batch statistics
    would differ by design)."""
    results = []
    for devices, strategy in ((1, "auto"), (2, "ddp_spawn")):
        module = RankInjected(make_net(bn=False), wd=1e-3, inject={1: math.inf})
        plugin = LARSMixedPrecision("32", "cpu", eta=0.01)
        tr = trainer(plugin, tmp_path, max_steps=3, devices=devices, strategy=strategy, use_distributed_sampler=False,
                     callbacks=[ReleaseProcessGroup()])
        tr.fit(module)
        results.append([p.detach().clone() for p in module.parameters()])
    start = [p.detach() for p in make_net(bn=False).parameters()]
    assert not torch.equal(results[0][0], start[0])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class ScalerRecorder(Callback):
    """The loss scaler's state and the skip decision after every step, on this rank."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        self.steps.append({**plugin.scaler.state_dict(), "skipped": plugin.last_step_skipped})


def _scaler_on_rank(rank: int, world_size: int, tmp: str) -> list[dict]:
    """A plain 16-mixed Trainer on 2 gloo ranks; only the last rank sees an inf, at step 1."""
    os.environ["LOCAL_RANK"] = str(rank)  # the Trainer joins this process group instead of launching
    recorder = ScalerRecorder()
    plugin = LARSMixedPrecision("16-mixed", "cpu", scaler=small_scaler(growth_interval=2))
    module = LastRankInjected(make_net(bn=False), inject={1: math.inf})
    pl.Trainer(accelerator="cpu", devices=world_size, max_steps=4, default_root_dir=tmp, plugins=[plugin],
               callbacks=[recorder]).fit(module, data(n=32, batch=4))
    return recorder.steps


@pytest.mark.slow  # two rank processes, about 11 s
def test_every_rank_backs_off_when_one_rank_overflows(tmp_path) -> None:
    """A non-finite gradient on rank 1 alone: both ranks skip, halve the scale and restart the growth
    count; the finite steps after it then grow the scale on both (growth interval 2)."""
    r0, r1 = run_distributed(_scaler_on_rank, 2, str(tmp_path), timeout=180)
    assert r0 == r1
    assert [(s["scale"], s["_growth_tracker"], s["skipped"]) for s in r0] == [
        (2.0**8, 1, False), (2.0**7, 0, True), (2.0**7, 1, False), (2.0**8, 0, False)]
