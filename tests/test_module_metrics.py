"""``ImageClassifier`` metrics: val/top1 and val/top5 are micro accuracy, per-class mean apart."""
import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fastscale.module import ImageClassifier


def _fixed_ranking_model(num_classes: int) -> nn.Module:
    """Ignores its input and always ranks class 0 first, 1 second, ..."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, num_classes))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.arange(num_classes, 0, -1, dtype=torch.float32))
    return model


def test_top1_is_fraction_of_correct_samples_with_unbalanced_classes(tmp_path):
    num_classes = 6
    # class 0 is half of the data; classes 1..5 one sample each
    targets = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5])
    inputs = torch.randn(len(targets), 3, 4, 4)
    module = ImageClassifier(model=_fixed_ranking_model(num_classes), num_classes=num_classes)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, default_root_dir=tmp_path
    )
    # batches of 3 so the metric accumulates over uneven batches
    (metrics,) = trainer.validate(module, DataLoader(TensorDataset(inputs, targets), batch_size=3), verbose=False)

    logits = module.model(inputs)
    micro_top1 = (logits.argmax(1) == targets).float().mean().item()
    micro_top5 = (logits.topk(5, dim=1).indices == targets[:, None]).any(1).float().mean().item()
    per_class = [(logits.argmax(1)[targets == c] == c).float().mean().item() for c in range(num_classes)]
    assert (micro_top1, micro_top5) == pytest.approx((0.5, 0.9))  # the hand count: 5/10 and all but class 5
    assert metrics["val/top1"] == pytest.approx(micro_top1)
    assert metrics["val/top5"] == pytest.approx(micro_top5)
    assert metrics["val/per_class_top1"] == pytest.approx(sum(per_class) / num_classes)  # 1/6
    assert metrics["val/per_class_top1"] != pytest.approx(metrics["val/top1"])
