"""No weight decay on bias/norm: which parameters, the optimizer groups, training, resume, LARS, misuse."""
from __future__ import annotations

import functools

import pytest
import timm
import torch
import torchvision
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fastscale import ImageClassifier
from lightning_fastscale.models.alexnet_bn import AlexNetBN
from lightning_fastscale.param_groups import param_groups_without_decay
from lightning_fastscale.precision import LARS
from tests.callbacks_recipe_utils import TinyClassifier, make_trainer, tensor_loader


def _bias_and_bn_names(model: nn.Module) -> set[str]:
    """Independent statement of the rule for these CNNs: BN weight/bias and every bias."""
    names = set()
    for prefix, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            if isinstance(m, nn.BatchNorm2d) or pname == "bias":
                names.add(f"{prefix}.{pname}" if prefix else pname)
    return names


def _group_names(module: nn.Module, group: dict) -> set[str]:
    by_id = {id(p): n for n, p in module.named_parameters()}
    return {by_id[id(p)] for p in group["params"]}


@pytest.mark.parametrize(
    "build",
    [
        lambda: torchvision.models.resnet50(weights=None),
        lambda: timm.create_model("resnet50", pretrained=False),
    ],
    ids=["torchvision", "timm"],
)
def test_resnet50_excludes_the_53_bn_layers_and_fc_bias(build) -> None:
    model = build()
    decay, no_decay = param_groups_without_decay(model, weight_decay=1e-4)
    # ResNet-50: stem BN + 16 bottlenecks x 3 BN + 4 downsample BN = 53 BN layers -> 106 params,
    # plus fc.bias = 107 excluded; 53 convs + fc.weight = 54 decayed.
    assert (len(decay["params"]), len(no_decay["params"])) == (54, 107)
    assert _group_names(model, no_decay) == _bias_and_bn_names(model)
    assert {"bn1.weight", "layer1.0.downsample.1.bias", "layer4.2.bn3.weight", "fc.bias"} <= _group_names(model, no_decay)
    assert {"conv1.weight", "layer4.2.conv3.weight", "fc.weight"} <= _group_names(model, decay)
    assert (decay["name"], decay["weight_decay"], no_decay["name"], no_decay["weight_decay"]) == (
        "decay", 1e-4, "no_decay", 0.0
    )


def test_alexnet_bn_excludes_its_six_bn_layers_and_three_fc_biases() -> None:
    model = AlexNetBN(num_classes=10)
    decay, no_decay = param_groups_without_decay(model)
    assert "weight_decay" not in decay  # unset: the optimizer's own weight_decay applies
    assert _group_names(model, no_decay) == {
        "features.1.weight", "features.1.bias", "features.5.weight", "features.5.bias",
        "features.9.weight", "features.9.bias", "features.12.weight", "features.12.bias",
        "features.15.weight", "features.15.bias", "bn_pool5.weight", "bn_pool5.bias",
        "classifier.2.bias", "classifier.5.bias", "classifier.7.bias",
    }
    # BN: 2 x (96 + 256 + 384 + 384 + 256 + 256); fc biases 4096 + 4096 + 10
    assert sum(p.numel() for p in no_decay["params"]) == 2 * 1632 + 4096 + 4096 + 10
    assert len(decay["params"]) == 5 + 3  # five conv weights (no conv bias), three fc weights


def test_extra_patterns_add_names_and_bad_patterns_are_rejected() -> None:
    model = AlexNetBN(num_classes=10)
    decay, no_decay = param_groups_without_decay(model, extra_patterns=["classifier.7.*"])
    assert "classifier.7.weight" in _group_names(model, no_decay)
    assert "classifier.7.weight" not in _group_names(model, decay)
    with pytest.raises(ValueError, match="not a non-empty string"):
        param_groups_without_decay(model, extra_patterns=[""])
    with pytest.raises(ValueError, match="not a non-empty string"):
        ImageClassifier("resnet_small", 4, no_weight_decay_on_bias_norm=True, no_weight_decay_patterns=[3])
    with pytest.raises(ValueError, match=r"^no_weight_decay_patterns=\['model.fc.\*'\] has no effect without"):
        ImageClassifier("resnet_small", 4, no_weight_decay_patterns=["model.fc.*"])


def _tiny_image_classifier(**kwargs) -> ImageClassifier:
    """The TinyClassifier network in an ImageClassifier: SGD lr 0.1, momentum 0.9, weight decay 0.1."""
    kwargs.setdefault("optimizer", functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1))
    return ImageClassifier(TinyClassifier().model, num_classes=4, no_weight_decay_on_bias_norm=True, **kwargs)


def test_image_classifier_builds_its_optimizer_over_the_two_groups(tmp_path) -> None:
    module = _tiny_image_classifier(scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))
    trainer = make_trainer(tmp_path, [], max_steps=3)
    trainer.fit(module, tensor_loader())
    (optimizer,) = trainer.optimizers
    decay, no_decay = optimizer.param_groups
    assert _group_names(module, decay) == {"model.0.weight", "model.5.weight"}
    assert _group_names(module, no_decay) == {"model.0.bias", "model.1.weight", "model.1.bias", "model.5.bias"}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    # the scheduler was built on the two groups and schedules both: lr = 0.1 / (1 + 3)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.025])
    # off (the default): one group, every parameter with the optimizer's weight decay
    plain = ImageClassifier(TinyClassifier().model, num_classes=4, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    assert len(plain.configure_optimizers().param_groups) == 1


class _ZeroLoss(ImageClassifier):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return (self(batch[0]) * 0.0).sum()


def test_zero_decay_really_applies_to_excluded_parameters(tmp_path) -> None:
    """With an all-zero gradient, only weight decay moves parameters in the first SGD step."""
    module = _ZeroLoss(TinyClassifier().model, num_classes=4, no_weight_decay_on_bias_norm=True,
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    make_trainer(tmp_path, [], max_steps=1).fit(module, tensor_loader())
    for name, p in module.named_parameters():
        if name in {"model.0.weight", "model.5.weight"}:
            torch.testing.assert_close(p.detach(), before[name] * (1 - 0.1 * 0.5))  # SGD: w -= lr*wd*w
        else:
            torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)


def test_lars_leaves_the_same_parameters_alone(tmp_path) -> None:
    """One rule: the no-decay group is exactly what LARS leaves unadapted and undecayed, and with
    the LARS optimizer over the two groups those parameters do not move on a zero gradient."""
    module = _ZeroLoss(TinyClassifier().model, num_classes=4, no_weight_decay_on_bias_norm=True,
                       optimizer=functools.partial(LARS, lr=0.1, momentum=0.9, weight_decay=0.5, eta=1e-3))
    groups = param_groups_without_decay(module)
    lars_groups = LARS.from_module(module, lr=0.1, weight_decay=0.5).param_groups
    assert [_group_names(module, g) for g in groups] == [_group_names(module, g) for g in lars_groups]
    assert lars_groups[1]["lars"] is False and lars_groups[1]["weight_decay"] == 0.0
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    make_trainer(tmp_path, [], max_steps=1).fit(module, tensor_loader())
    for name, p in module.named_parameters():
        if name in _group_names(module, groups[1]):
            torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
        else:  # weight decay through LARS moved the decayed ones
            assert not torch.equal(p.detach(), before[name]), name


def _final_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path) -> None:
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda s: 1 / (1 + s))
    torch.manual_seed(0)
    straight = _tiny_image_classifier(scheduler=schedule)
    torch.manual_seed(0)
    first_half = _tiny_image_classifier(scheduler=schedule)
    torch.manual_seed(0)
    resumed = _tiny_image_classifier(scheduler=schedule)

    make_trainer(tmp_path / "a", [], max_epochs=4).fit(straight, tensor_loader())

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(tmp_path / "b", [ckpt], max_epochs=2, enable_checkpointing=True).fit(first_half, tensor_loader())
    saved = torch.load(ckpt.last_model_path, weights_only=False)
    saved_groups = saved["optimizer_states"][0]["param_groups"]
    assert [(g["name"], g["weight_decay"], len(g["params"])) for g in saved_groups] == [
        ("decay", 0.1, 2), ("no_decay", 0.0, 4)
    ]
    make_trainer(tmp_path / "c", [], max_epochs=4).fit(resumed, tensor_loader(), ckpt_path=ckpt.last_model_path)
    expected, got = _final_weights(straight), _final_weights(resumed)
    assert not torch.equal(expected["model.0.weight"], _final_weights(first_half)["model.0.weight"])
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)


def test_module_without_bias_or_norm_is_rejected_when_built() -> None:
    network = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4, bias=False))
    with pytest.raises(ValueError, match=r"^no_weight_decay_on_bias_norm=True: Sequential has no trainable bias"):
        ImageClassifier(network, num_classes=4, no_weight_decay_on_bias_norm=True)
