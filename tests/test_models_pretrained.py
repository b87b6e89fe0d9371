"""``model.pretrained``: local weights files (written by the test), library weights refused
clearly when they cannot be fetched offline. Nothing is downloaded."""
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastscale.models import create_model
from lightning_fastscale.module import ImageClassifier

SMALL = {"widths": [8, 8, 8], "blocks_per_stage": 1}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def test_state_dict_file_is_loaded(tmp_path):
    source = create_model("resnet_small", 10, **SMALL)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    loaded = create_model("resnet_small", 10, pretrained=str(tmp_path / "w.pth"), **SMALL)
    fresh = create_model("resnet_small", 10, **SMALL)
    assert _same(loaded.state_dict(), source.state_dict())
    assert not _same(fresh.state_dict(), source.state_dict())  # random init differs: the load did it


def test_other_num_classes_keeps_a_fresh_head(tmp_path):
    source = create_model("resnet18", 1000)
    torch.save({"state_dict": source.state_dict()}, tmp_path / "w.pth")
    torch.manual_seed(1)
    loaded = create_model("resnet18", 7, pretrained=tmp_path / "w.pth")
    assert loaded.fc.weight.shape == (7, 512)
    body = {k: v for k, v in source.state_dict().items() if not k.startswith("fc.")}
    assert _same(body, {k: v for k, v in loaded.state_dict().items() if not k.startswith("fc.")})


def test_fastscale_checkpoint_fine_tunes_into_a_new_module(tmp_path):
    module = ImageClassifier("resnet_small", num_classes=4, model_kwargs=SMALL)
    data = TensorDataset(torch.randn(16, 3, 16, 16), torch.randint(0, 4, (16,)))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    tuned = ImageClassifier("resnet_small", num_classes=4, model_kwargs=SMALL, pretrained=str(tmp_path / "run.ckpt"))
    assert _same(tuned.model.state_dict(), module.model.state_dict())


def test_bad_weights_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^pretrained=.*missing.pth.: no such file"):
        create_model("resnet_small", 10, pretrained=tmp_path / "missing.pth", **SMALL)
    torch.save(create_model("resnet20", 10).state_dict(), tmp_path / "other.pth")
    with pytest.raises(ValueError, match="does not fit this model"):
        create_model("resnet_small", 10, pretrained=tmp_path / "other.pth", **SMALL)
    with pytest.raises(ValueError, match="no published weights"):
        create_model("resnet_small", 10, pretrained=True, **SMALL)
    with pytest.raises(ValueError, match="1000 classes"):
        create_model("torchvision.resnet18", 10, pretrained=True)


def test_default_is_random_init_and_a_string_is_a_file():
    assert isinstance(create_model("resnet18", 3), torch.nn.Module)
    # no coercion of "false": a string is a weights file (Hydra and LightningCLI give booleans)
    with pytest.raises(FileNotFoundError, match="pretrained='false': no such file"):
        create_model("resnet18", 3, pretrained="false")


@pytest.mark.slow  # a fresh interpreter, about 10 s
def test_library_weights_offline_give_a_clear_error(tmp_path):
    # Hugging Face Hub in offline mode, empty caches: timm cannot get the weights and must say how to fix it.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TORCH_HOME": str(tmp_path / "torch")}
    code = "from lightning_fastscale.models import create_model; create_model('resnet18', 10, pretrained=True)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pretrained=True: could not get the timm" in proc.stderr
    assert "pretrained='/path/to/weights.pth'" in proc.stderr
