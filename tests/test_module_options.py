"""``ImageClassifier`` / ``fastscale-train`` options: channels_last, torch.compile, cuDNN
benchmark, FLOPs for ThroughputMonitor. Checked on CPU that each option is wired."""
import warnings

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from omegaconf import open_dict
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastscale import train
from lightning_fastscale.module import ImageClassifier, batch_size_of


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_fastscale.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


def _loader(n=16, side=16, classes=4, batch=8):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, side, side, generator=g), torch.randint(0, classes, (n,), generator=g))
    return DataLoader(data, batch_size=batch)


def _trainer(tmp_path, **kwargs):
    defaults = dict(accelerator="cpu", devices=1, max_steps=2, default_root_dir=tmp_path)
    return pl.Trainer(**{**defaults, **kwargs})


def test_channels_last_reaches_the_network_weights_and_inputs(tmp_path):
    module = ImageClassifier("resnet_small", num_classes=4, channels_last=True, model_kwargs={"widths": [8, 8, 8]})
    seen = []
    module.model.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    _trainer(tmp_path).fit(module, _loader(), _loader())
    convs = [m.weight for m in module.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert all(not w.is_contiguous() for w in convs if w.shape[-1] > 1)  # really NHWC, not both
    assert seen and all(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() for x in seen)


def test_channels_last_off_keeps_contiguous_inputs(tmp_path):
    module = ImageClassifier("resnet_small", num_classes=4, model_kwargs={"widths": [8, 8, 8]})
    seen = []
    module.model.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    _trainer(tmp_path, max_steps=1).fit(module, _loader(), _loader())
    assert seen and all(x.is_contiguous() for x in seen)


def test_compile_wraps_the_network_in_place_with_the_mode(tmp_path, monkeypatch):
    calls = []

    def recording_compile(fn, **kwargs):  # stands in for torch.compile: records, compiles nothing
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    module = ImageClassifier("resnet_small", num_classes=4, compile=True, compile_mode="max-autotune",
                             model_kwargs={"widths": [8, 8, 8]})
    names_before = set(module.state_dict())
    assert calls == []  # nothing happens before the Trainer configures the model
    _trainer(tmp_path, max_steps=1).fit(module, _loader(), _loader())
    assert calls == [{"mode": "max-autotune"}]
    assert module.model._compiled_call_impl is not None
    assert set(module.state_dict()) == names_before  # checkpoints keep the parameter names


def test_compile_off_by_default_and_bad_mode_refused():
    assert ImageClassifier("linear", num_classes=3, model_kwargs={"resolution": 8}).compile_network is False
    with pytest.raises(ValueError, match=r"^compile_mode='fastest' is not one of \[None, 'default'"):
        ImageClassifier("linear", num_classes=3, compile=True, compile_mode="fastest", model_kwargs={"resolution": 8})
    with pytest.raises(ValueError, match=r"^compile_mode='max-autotune' has no effect without compile=True$"):
        ImageClassifier("linear", num_classes=3, compile_mode="max-autotune", model_kwargs={"resolution": 8})


def test_fastscale_train_wires_the_options(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # the default logger; build() starts no run
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_fastscale.conf", version_base="1.3"):
        cfg = compose("train", return_hydra_config=True, overrides=[
            "model.channels_last=true", "model.compile=true", "model.compile_mode=reduce-overhead",
            "trainer.benchmark=true", "trainer.accelerator=cpu", "data.train_size=16", "data.val_size=16",
            "data.batch_size=8"])
    with open_dict(cfg):  # the default callbacks and logger write into the run folder
        cfg.hydra.runtime.output_dir = str(tmp_path)
    HydraConfig.instance().set_config(cfg)
    try:
        _, module, trainer = train.build(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert module.channels_last and module.compile_network and module.compile_mode == "reduce-overhead"
    assert torch.backends.cudnn.benchmark is True  # Lightning's Trainer(benchmark=True) set it


def test_gpu_trainer_preset_turns_on_benchmark_and_channels_last_not_compile():
    gpu = _compose(["trainer=gpu"])
    assert gpu.trainer.benchmark is True and gpu.trainer.accelerator == "gpu"
    assert gpu.model.channels_last is True and gpu.model.compile is False
    cpu = _compose(["trainer=cpu"])
    assert cpu.trainer.benchmark is None and cpu.model.channels_last is False and cpu.model.compile is False


def test_flops_per_batch_equals_the_linear_formula():
    classes, side, batch = 5, 8, 32
    module = ImageClassifier("linear", num_classes=classes, model_kwargs={"resolution": side})
    assert module.flops_per_batch is None  # before any batch
    module._last_batch_shape = (batch, 3, side, side)
    features = 3 * side * side
    # forward 2*B*F*C (multiply-add); backward only the weight gradient, 2*B*F*C (the input needs none)
    assert module.flops_per_batch == 4 * batch * features * classes
    module.eval()
    assert module.flops_per_batch == 2 * batch * features * classes


def test_throughput_monitor_gets_flops_without_warning(tmp_path):
    module = ImageClassifier("resnet_small", num_classes=4, model_kwargs={"widths": [8, 8, 8]})
    trainer = _trainer(tmp_path, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                       callbacks=[ThroughputMonitor(batch_size_fn=batch_size_of, window_size=2)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _loader(n=24), _loader())
    assert not [w for w in caught if "flops_per_batch" in str(w.message)]
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "device/flops_per_sec" in metrics
