"""LabelSmoothing: smoothed targets and schedule by hand, training-only effect, misuse errors."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_fastscale.callbacks import LabelSmoothing, smooth_targets, smoothing_at_epoch
from tests.callbacks_recipe_utils import TinyClassifier, make_trainer, tensor_loader


def _hand_cross_entropy(logits: torch.Tensor, y: torch.Tensor, eps: float) -> float:
    """Mean over rows of -sum_k q_k log softmax(z)_k with q = (1-eps) onehot + eps/K, in plain Python."""
    total = 0.0
    for row, target in zip(logits.double().tolist(), y.tolist()):
        k = len(row)
        log_norm = math.log(sum(math.exp(z) for z in row))
        for j, z in enumerate(row):
            q = (1 - eps) * (j == target) + eps / k
            total -= q * (z - log_norm)
    return total / len(y)


def test_smooth_targets_match_hand_values() -> None:
    q = smooth_targets(torch.tensor([0, 2]), num_classes=4, smoothing=0.2)
    expected = torch.tensor([[0.85, 0.05, 0.05, 0.05], [0.05, 0.05, 0.85, 0.05]])
    torch.testing.assert_close(q, expected)
    torch.testing.assert_close(smooth_targets(torch.tensor([1]), 3, 0.0), torch.tensor([[0.0, 1.0, 0.0]]))


def test_torch_label_smoothing_is_cross_entropy_against_smoothed_targets() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.3, 0.2, -2.0, 1.5], [-0.5, 0.5, 1.0, -1.0]])
    y = torch.tensor([0, 3, 2])
    for eps in (0.0, 0.1, 0.3):
        torch_loss = nn.CrossEntropyLoss(label_smoothing=eps)(logits, y)
        soft = nn.functional.cross_entropy(logits, smooth_targets(y, 4, eps))
        assert torch_loss.item() == pytest.approx(_hand_cross_entropy(logits, y, eps), rel=1e-6)
        assert soft.item() == pytest.approx(_hand_cross_entropy(logits, y, eps), rel=1e-6)


def test_schedule_constant_and_annealed_at_boundaries() -> None:
    assert [smoothing_at_epoch(e, 0.1) for e in (0, 5, 100)] == [0.1, 0.1, 0.1]
    got = [smoothing_at_epoch(e, 0.2, 0.0, 4) for e in range(6)]
    assert got == pytest.approx([0.2, 0.15, 0.1, 0.05, 0.0, 0.0])
    with pytest.raises(ValueError, match="epoch"):
        smoothing_at_epoch(-1, 0.1)


def _closer_to(loss: float, expected: float, other: float) -> bool:
    """``loss`` matches ``expected`` and is at least 10x closer to it than to ``other``."""
    return loss == pytest.approx(expected, rel=1e-5) and 10 * abs(loss - expected) < abs(loss - other)


def test_callback_smooths_training_loss_only(tmp_path) -> None:
    torch.manual_seed(0)
    module = TinyClassifier()
    smoothing = LabelSmoothing(smoothing=0.3, final_smoothing=0.1, anneal_epochs=2)
    trainer = make_trainer(tmp_path, [smoothing], max_epochs=2, num_sanity_val_steps=1)
    trainer.fit(module, tensor_loader(), tensor_loader(n=16, seed=1))

    per_epoch = {0: 0.3, 1: 0.2}
    assert {epoch for epoch, *_ in module.train_records} == {0, 1}
    for epoch, logits, y, loss, eps_in_use in module.train_records:
        assert eps_in_use == pytest.approx(per_epoch[epoch])
        smoothed, plain = _hand_cross_entropy(logits, y, per_epoch[epoch]), _hand_cross_entropy(logits, y, 0.0)
        assert _closer_to(loss, smoothed, plain)
    # sanity check (1 batch) + 2 validation epochs of 2 batches, all unsmoothed
    assert len(module.val_records) == 1 + 2 * 2
    for logits, y, loss in module.val_records:
        plain, smoothed = _hand_cross_entropy(logits, y, 0.0), _hand_cross_entropy(logits, y, 0.2)
        assert _closer_to(loss, plain, smoothed)
    assert trainer.callback_metrics["label_smoothing"].item() == pytest.approx(0.2)
    assert module.criterion.label_smoothing == 0.0  # put back when the fit ends


def test_attribute_selects_among_several_losses(tmp_path) -> None:
    module = TinyClassifier()
    module.aux_criterion = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"several nn.CrossEntropyLoss.*criterion.*aux_criterion.*attribute="):
        make_trainer(tmp_path, [LabelSmoothing(0.1)], max_steps=1).fit(module, tensor_loader())
    assert module.train_records == []  # failed before any training step
    make_trainer(tmp_path, [LabelSmoothing(0.1, attribute="criterion")], max_steps=1).fit(module, tensor_loader())
    assert module.train_records[0][-1] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("prepare", "kwargs", "message"),
    [
        (lambda m: delattr(m, "criterion"), {}, "holds no nn.CrossEntropyLoss attribute"),
        (lambda m: None, {"attribute": "loss_fn"}, "has no submodule 'loss_fn'"),
        (lambda m: None, {"attribute": "model"}, "is a Sequential, not an nn.CrossEntropyLoss"),
        (lambda m: setattr(m.criterion, "label_smoothing", 0.1), {}, "already has label_smoothing=0.1"),
    ],
)
def test_misuse_fails_before_training(tmp_path, prepare, kwargs, message) -> None:
    module = TinyClassifier()
    prepare(module)
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, [LabelSmoothing(0.1, **kwargs)], max_steps=1).fit(module, tensor_loader())
    assert module.train_records == []


class FunctionalLoss(TinyClassifier):
    """Keeps ``self.criterion`` but computes the training loss with ``F.cross_entropy``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)


def test_a_criterion_that_training_step_never_calls_is_refused_before_the_first_backward(tmp_path) -> None:
    module = FunctionalLoss()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(RuntimeError, match=r"FunctionalLoss.criterion.*without calling it.*self.criterion\(logits, targets\)"):
        make_trainer(tmp_path, [LabelSmoothing(0.1)], max_steps=2).fit(module, tensor_loader())
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # no step was taken
    assert module.criterion.label_smoothing == 0.0  # and the criterion is left as it was


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"smoothing": 1.5}, r"smoothing=1.5 is outside \[0, 1\]"),
        ({"smoothing": 0.1, "final_smoothing": -0.1, "anneal_epochs": 3}, r"final_smoothing=-0.1 is outside"),
        ({"smoothing": 0.1, "final_smoothing": 0.0}, "needs anneal_epochs >= 1"),
    ],
)
def test_bad_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LabelSmoothing(**kwargs)
