"""The module-side recipe (no-decay groups, label smoothing, zero-init BN) under DDP on 2 CPU processes."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_fastscale.callbacks import LabelSmoothing, ZeroInitResidualBN
from lightning_fastscale.models import create_model
from tests.callbacks_recipe_utils import TinyClassifier, tensor_loader
from tests.distributed import ReleaseProcessGroup


class _RankProbe(pl.Callback):
    """Writes, per rank, what the callbacks set up and the final weights, to compare ranks."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.record: dict = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.record["groups"] = [
            (g["name"], g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
            for g in trainer.optimizers[0].param_groups
        ]
        self.record["zero_gammas"] = sorted(
            n for n, p in pl_module.named_parameters() if n.endswith("bn2.weight") and not p.any()
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record.setdefault("smoothing", []).append(pl_module.criterion.label_smoothing)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # parameters only: BN running statistics are per rank between DDP's buffer broadcasts
        self.record["weights"] = {k: v.tolist() for k, v in pl_module.named_parameters()}
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


def test_recipe_callbacks_act_identically_on_every_rank(tmp_path) -> None:
    torch.manual_seed(0)
    module = TinyClassifier(model=create_model("resnet_small", num_classes=4, widths=(4, 8, 8)), no_decay_on_bias_norm=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, default_root_dir=tmp_path,
        callbacks=[LabelSmoothing(0.2), ZeroInitResidualBN(), _RankProbe(str(tmp_path)),
                   ReleaseProcessGroup()],
    )
    trainer.fit(module, tensor_loader())
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    bn_or_bias = sorted(
        f"{prefix}.{name}"
        for prefix, m in module.named_modules()
        for name, _ in m.named_parameters(recurse=False)
        if isinstance(m, torch.nn.BatchNorm2d) or name == "bias"
    )
    assert len(bn_or_bias) == 19  # 9 BN layers (stem, 2 per block, 2 shortcuts) x 2 + fc.bias
    for rank in ranks:
        (decay_name, decay_wd, decayed), (no_decay_name, no_decay_wd, excluded) = rank["groups"]
        assert (decay_name, decay_wd, no_decay_name, no_decay_wd) == ("decay", 0.1, "no_decay", 0.0)
        assert excluded == bn_or_bias
        assert len(decayed) == 10  # 9 convs + fc.weight
        assert rank["zero_gammas"] == [f"model.stages.{i}.0.bn2.weight" for i in range(3)]
        assert rank["smoothing"] == [0.2, 0.2]  # 32 samples / 2 ranks / batch 8
    assert ranks[0]["groups"] == ranks[1]["groups"]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # replicas stayed identical
