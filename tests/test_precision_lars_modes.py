"""``LARSMixedPrecision``'s compute modes: fp32 never under autocast, bf16 under it, one class
for every mode, and ``@override`` on every method that overrides Lightning's or torch's."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.nn import functional as F

from lightning_fastscale.precision import LARSFabricPrecision, LARSMixedPrecision
from tests.test_precision_lars_plugin import Tiny, data, make_net, trainer


class DtypeProbe(Tiny):
    """Records the dtype of the first layer's output and whether autocast was on."""

    def __init__(self) -> None:
        super().__init__(make_net())
        self.seen: list[tuple[torch.dtype, bool]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.net[0](x)
        self.seen.append((hidden.dtype, torch.is_autocast_enabled("cpu")))
        return F.cross_entropy(self.net[1:](hidden).float(), y)


@contextlib.contextmanager
def forward_context_builds_autocast():
    """Lightning's development branch: ``MixedPrecision.forward_context`` makes the autocast
    itself instead of asking ``autocast_context_manager`` (which the old fp32 mode overrode)."""

    @contextlib.contextmanager
    def forward_context(self):
        with torch.autocast(self.device, dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.half):
            yield

    original = MixedPrecision.forward_context
    MixedPrecision.forward_context = forward_context
    try:
        yield
    finally:
        MixedPrecision.forward_context = original


@pytest.mark.parametrize("future_lightning", [False, True], ids=["installed", "forward_context_autocast"])
@pytest.mark.parametrize(
    "precision, dtype, autocast",
    [("32-true", torch.float32, False), ("32", torch.float32, False), ("bf16-mixed", torch.bfloat16, True)],
)
def test_activations_dtype(tmp_path, precision, dtype, autocast, future_lightning) -> None:
    module = DtypeProbe()
    plugin = LARSMixedPrecision(precision, "cpu")
    ctx = forward_context_builds_autocast() if future_lightning else contextlib.nullcontext()
    with ctx:
        trainer(plugin, tmp_path, max_steps=2).fit(module, data())
    assert module.seen == [(dtype, autocast)] * 2
    assert all(p.dtype == torch.float32 for p in module.parameters())  # master weights stay fp32


def test_one_class_for_every_mode() -> None:
    for precision, scaled in (("32-true", False), ("16-mixed", True), ("bf16-mixed", False)):
        plugin = LARSMixedPrecision(precision, "cpu", eta=0.01)
        assert type(plugin) is LARSMixedPrecision and isinstance(plugin, MixedPrecision)
        assert plugin.precision == precision and plugin.eta == 0.01 and (plugin.scaler is not None) == scaled


def test_pickles_as_its_own_class() -> None:
    """``ddp_spawn`` pickles the plugin."""
    import pickle

    for precision in ("32-true", "16-mixed"):
        plugin = LARSMixedPrecision(precision, "cpu", eta=0.02)
        copy = pickle.loads(pickle.dumps(plugin))
        assert type(copy) is type(plugin) and copy.precision == plugin.precision and copy.eta == 0.02


@pytest.mark.parametrize("cls", [LARSMixedPrecision, LARSFabricPrecision])
def test_every_override_is_marked(cls) -> None:
    """A method that replaces one of a Lightning/torch base class carries ``@override``."""
    ours = [c for c in cls.__mro__ if c.__module__.startswith("lightning_fastscale")]
    bases = [c for c in cls.__mro__ if not c.__module__.startswith("lightning_fastscale") and c is not object]
    unmarked = []
    for c in ours:
        for name, member in vars(c).items():
            if name.startswith("__") or not inspect.isfunction(member):
                continue
            if any(name in vars(b) for b in bases) and not getattr(member, "__override__", False):
                unmarked.append(f"{c.__name__}.{name}")
    assert not unmarked


def test_lightning_cli_builds_each_mode() -> None:
    """jsonargparse (LightningCLI's parser) reads the plugin's options and builds it."""
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--plugin", type=Precision)
    for precision in ("32-true", "bf16-mixed"):
        cfg = parser.parse_args([
            "--plugin=lightning_fastscale.precision.LARSMixedPrecision", f"--plugin.precision={precision}",
            "--plugin.device=cpu", "--plugin.eta=0.01", "--plugin.exclude=[fc.*]",
        ])
        plugin = parser.instantiate(cfg).plugin if hasattr(parser, "instantiate") else parser.instantiate_classes(cfg).plugin
        assert type(plugin) is LARSMixedPrecision and plugin.precision == precision
        assert plugin.eta == 0.01 and plugin.exclude == ["fc.*"]
