"""ZeroInitResidualBN zeroes exactly the last BN gamma of each residual branch, once."""
from __future__ import annotations

import lightning.pytorch as pl
import pytest
import timm
import torch
import torchvision
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fastscale.callbacks import ZeroInitResidualBN, zero_init_residual_bn
from lightning_fastscale.models import create_model
from lightning_fastscale.models.alexnet_bn import AlexNetBN
from tests.callbacks_recipe_utils import TinyClassifier, make_trainer, tensor_loader


def _fill_bn_gammas(model: nn.Module) -> None:
    """Give every BN gamma a non-zero value so that zeroing is visible (timm zero-inits already)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)


def _zeroed_parameters(model: nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    """Names of parameters that changed; asserts each of them changed to exactly zero."""
    changed = set()
    for name, p in model.named_parameters():
        if not torch.equal(p, before[name]):
            assert torch.count_nonzero(p) == 0, name
            changed.add(name)
    return changed


def _expected(stages: list[int], last_bn: str, prefix: str = "layer") -> set[str]:
    return {f"{prefix}{i + 1}.{j}.{last_bn}.weight" for i, n in enumerate(stages) for j in range(n)}


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: torchvision.models.resnet18(weights=None), _expected([2, 2, 2, 2], "bn2")),
        (lambda: torchvision.models.resnet50(weights=None), _expected([3, 4, 6, 3], "bn3")),
        (lambda: timm.create_model("resnet18", pretrained=False), _expected([2, 2, 2, 2], "bn2")),
        (lambda: timm.create_model("resnet50", pretrained=False), _expected([3, 4, 6, 3], "bn3")),
        (
            lambda: create_model("resnet20", num_classes=10),
            {f"stages.{i}.{j}.bn2.weight" for i in range(3) for j in range(3)},
        ),
    ],
    ids=["torchvision-resnet18", "torchvision-resnet50", "timm-resnet18", "timm-resnet50", "resnet20"],
)
def test_zeroes_exactly_the_last_bn_of_each_residual_branch(build, expected) -> None:
    model = build()
    _fill_bn_gammas(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    blocks = zero_init_residual_bn(model)
    assert len(blocks) == len(expected)
    assert _zeroed_parameters(model, before) == expected


def test_model_without_residual_blocks_is_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="no residual block it knows.*zero_init_last"):
        zero_init_residual_bn(AlexNetBN(num_classes=10))
    module = TinyClassifier()
    with pytest.raises(ValueError, match="TinyClassifier has no residual block"):
        make_trainer(tmp_path, [ZeroInitResidualBN()], max_steps=1).fit(module, tensor_loader())
    assert module.train_records == []


class _GammaAtTrainStart(pl.Callback):
    """Records the residual gammas as the first training step will see them."""

    def __init__(self) -> None:
        self.gammas: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.gammas = {n: p.detach().clone() for n, p in pl_module.named_parameters() if n.endswith("bn2.weight")}


def _small_resnet() -> nn.Module:
    return create_model("resnet_small", num_classes=4, widths=(4, 8, 8))


def test_callback_zeroes_before_training_and_not_again_on_resume_or_refit(tmp_path) -> None:
    module = TinyClassifier(model=_small_resnet(), weight_decay=0.0)
    _fill_bn_gammas(module)
    seen = _GammaAtTrainStart()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = make_trainer(tmp_path, [ZeroInitResidualBN(), seen, ckpt], max_epochs=1, enable_checkpointing=True)
    trainer.fit(module, tensor_loader())
    assert len(seen.gammas) == 3 and all(torch.count_nonzero(g) == 0 for g in seen.gammas.values())
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if n.endswith("bn2.weight")}
    assert all(torch.count_nonzero(g) > 0 for g in trained.values())  # training moved them off zero

    # resume into a fresh module: the checkpoint's gammas win over the zero-init
    fresh = TinyClassifier(model=_small_resnet(), weight_decay=0.0)
    seen_resumed = _GammaAtTrainStart()
    make_trainer(tmp_path, [ZeroInitResidualBN(), seen_resumed], max_epochs=2).fit(
        fresh, tensor_loader(), ckpt_path=ckpt.last_model_path
    )
    for name, gamma in trained.items():
        torch.testing.assert_close(seen_resumed.gammas[name], gamma, rtol=0, atol=0)

    # a second fit of the already trained module keeps its gammas
    seen_refit = _GammaAtTrainStart()
    make_trainer(tmp_path, [ZeroInitResidualBN(), seen_refit], max_epochs=1).fit(module, tensor_loader())
    for name, gamma in trained.items():
        torch.testing.assert_close(seen_refit.gammas[name], gamma, rtol=0, atol=0)
