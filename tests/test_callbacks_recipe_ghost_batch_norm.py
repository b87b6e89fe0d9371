"""GhostBatchNorm normalises each group of the batch as plain BN would normalise it alone.

The claim it exists for: one device with ghost groups of g trains exactly as k workers of
batch g with plain BN under DDP (Goyal et al. 2017's per-worker BN).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fastscale.callbacks import GhostBatchNorm, GhostBatchNormLayer, apply_ghost_batch_norm, ghost_batch_norm
from lightning_fastscale.models import create_model
from tests.callbacks_recipe_utils import TinyClassifier, make_trainer, tensor_loader
from tests.distributed import run_distributed


def _reference(x: torch.Tensor, bn: nn.BatchNorm2d, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain BN applied to each group alone (each from the same running stats); running stats of
    the full groups averaged."""
    outs, means, vars_ = [], [], []
    for chunk in x.split(group):
        copy_bn = copy.deepcopy(bn)
        copy_bn.weight, copy_bn.bias = bn.weight, bn.bias  # share, so gradients reach bn's own
        outs.append(copy_bn(chunk))
        if chunk.shape[0] == group:
            means.append(copy_bn.running_mean)
            vars_.append(copy_bn.running_var)
    return torch.cat(outs), torch.stack(means).mean(0), torch.stack(vars_).mean(0)


@pytest.mark.parametrize(
    ("shape", "group", "bn_type"),
    [
        ((64, 5, 6, 6), 16, nn.BatchNorm2d),
        ((40, 5, 6, 6), 16, nn.BatchNorm2d),  # remainder group of 8
        ((48, 7), 8, nn.BatchNorm1d),
        ((24, 3, 5), 6, nn.BatchNorm1d),  # (N, C, L)
        ((32, 4, 3, 3, 3), 8, nn.BatchNorm3d),
    ],
)
def test_equals_plain_batch_norm_on_each_group(shape, group, bn_type) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3 + 1
    bn = bn_type(shape[1])
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
    layer = GhostBatchNormLayer(shape[1], group)
    layer.load_state_dict(bn.state_dict())

    x_ref = x.clone().requires_grad_()
    x_ghost = x.clone().requires_grad_()
    expected, expected_mean, expected_var = _reference(x_ref, bn, group)
    got = layer(x_ghost)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.running_mean, expected_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.running_var, expected_var, rtol=1e-6, atol=1e-7)
    assert layer.num_batches_tracked.item() == 1

    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(x_ghost.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, bn.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, bn.bias.grad, rtol=1e-4, atol=1e-5)


def test_groups_differ_from_plain_batch_norm_over_the_whole_batch() -> None:
    """Guard against a no-op: groups with different statistics normalise differently."""
    x = torch.cat([torch.randn(16, 3, 4, 4), torch.randn(16, 3, 4, 4) * 5 + 3])
    plain = F.batch_norm(x, None, None, training=True)
    ghost = ghost_batch_norm(x, None, None, None, None, 16)
    assert (plain - ghost).abs().max() > 0.5
    # each group is standardised on its own
    for chunk in ghost.split(16):
        torch.testing.assert_close(chunk.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)


def test_batch_no_larger_than_a_group_is_plain_batch_norm() -> None:
    torch.manual_seed(1)
    x = torch.randn(16, 4, 5, 5)
    bn, layer = nn.BatchNorm2d(4), GhostBatchNormLayer(4, 16)
    assert torch.equal(layer(x), bn(x))
    assert torch.equal(layer.running_mean, bn.running_mean) and torch.equal(layer.running_var, bn.running_var)


def test_eval_uses_running_stats_and_state_dict_is_plain_batch_norm() -> None:
    torch.manual_seed(2)
    bn = nn.BatchNorm2d(4)
    for _ in range(3):
        bn(torch.randn(32, 4, 3, 3) * 2)
    layer = GhostBatchNormLayer(4, 8)
    layer.load_state_dict(bn.state_dict())
    assert layer.state_dict().keys() == bn.state_dict().keys()
    x = torch.randn(32, 4, 3, 3)
    assert torch.equal(layer.eval()(x), bn.eval()(x))


def test_cumulative_moving_average_when_momentum_is_none() -> None:
    torch.manual_seed(3)
    layer = GhostBatchNormLayer(3, 4, momentum=None)
    batches = [torch.randn(8, 3, 2, 2) + i for i in range(3)]
    means = []
    for x in batches:
        layer(x)
        means += [chunk.mean(dim=(0, 2, 3)) for chunk in x.split(4)]
    torch.testing.assert_close(layer.running_mean, torch.stack(means).mean(0), rtol=1e-5, atol=1e-6)


def test_apply_converts_every_batch_norm_and_shares_parameters() -> None:
    model = create_model("resnet_small", num_classes=10)
    bns = {n: m for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    params = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = apply_ghost_batch_norm(model, 16)
    assert sorted(converted) == sorted(bns)
    assert all(isinstance(model.get_submodule(n), GhostBatchNormLayer) for n in bns)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {k: torch.equal(v, state[k]) for k, v in model.state_dict().items()} == dict.fromkeys(state, True)
    assert apply_ghost_batch_norm(model, 8) == converted  # regrouping an already converted model
    assert {model.get_submodule(n).ghost_batch_size for n in bns} == {8}


@pytest.mark.parametrize("bad", [0, 1, 2.5, True, "16"])
def test_bad_ghost_batch_size_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="ghost_batch_size"):
        GhostBatchNorm(bad)
    with pytest.raises(ValueError, match="ghost_batch_size"):
        apply_ghost_batch_norm(nn.Sequential(nn.BatchNorm2d(3)), bad)


def test_model_without_plain_batch_norm_is_refused() -> None:
    with pytest.raises(ValueError, match="SyncBatchNorm.*remove the callback"):
        apply_ghost_batch_norm(nn.Sequential(nn.Conv2d(3, 3, 1), nn.SyncBatchNorm(3)), 8)


def test_callback_converts_before_the_optimizer_and_trains_the_same_parameters(tmp_path) -> None:
    torch.manual_seed(4)
    module = TinyClassifier()
    bn_weight = module.model[1].weight
    before = bn_weight.detach().clone()
    trainer = make_trainer(tmp_path, [GhostBatchNorm(4)], limit_val_batches=0)
    trainer.fit(module, tensor_loader(n=32, batch_size=8))
    assert isinstance(module.model[1], GhostBatchNormLayer)
    assert module.model[1].weight is bn_weight and not torch.equal(bn_weight, before)
    assert module.model[1].num_batches_tracked.item() == 4


def test_callback_warns_when_the_batch_holds_one_group(tmp_path) -> None:
    trainer = make_trainer(tmp_path, [GhostBatchNorm(8)], limit_val_batches=0)
    with pytest.warns(UserWarning, match="not larger than ghost_batch_size=8"):
        trainer.fit(TinyClassifier(), tensor_loader(n=16, batch_size=8))


def _tiny_net() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 3),
                         nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return torch.randn(3, 16, 3, 8, 8, generator=g), torch.randint(0, 4, (3, 16), generator=g)


def _train(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _ddp_plain_batch_norm(rank: int, world_size: int) -> dict[str, list]:
    xs, ys = _data()
    per_rank = xs.shape[1] // world_size
    model = nn.parallel.DistributedDataParallel(_tiny_net())
    _train(model, xs[:, rank * per_rank:(rank + 1) * per_rank], ys[:, rank * per_rank:(rank + 1) * per_rank])
    # Plain lists: tensors would travel as shared memory that is gone once the rank exits.
    return {n: p.detach().tolist() for n, p in model.module.named_parameters()}


def test_one_device_with_ghost_groups_trains_as_ddp_workers_with_plain_batch_norm() -> None:
    """Two DDP ranks of batch 8 (plain BN each) == one process of batch 16 with groups of 8."""
    ddp = {n: torch.tensor(v) for n, v in run_distributed(_ddp_plain_batch_norm, 2)[0].items()}
    model = _tiny_net()
    apply_ghost_batch_norm(model, 8)
    _train(model, *_data())
    plain = _tiny_net()
    _train(plain, *_data())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ddp[name], rtol=1e-5, atol=1e-6)
    # and plain BN over the whole batch of 16 does not (the test can tell the difference)
    assert max((p - ddp[n]).abs().max().item() for n, p in plain.named_parameters()) > 1e-3
