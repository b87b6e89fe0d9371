"""``ImageClassifier`` and the built-in dataset under Lightning's own ``LightningCLI``.

Every option of the module, the datamodule, the Trainer, the strategy, the precision plugin and
the callbacks is a command-line flag or a YAML key, built by jsonargparse from the type hints
(``pip install lightning_fastscale[cli]``)::

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml \\
        --model.scheduler=torch.optim.lr_scheduler.CosineAnnealingLR --model.scheduler.T_max=100
    python examples/lightning_cli.py fit --print_config      # every option with its default

The YAML selects the hierarchical all-reduce strategy (2 CPU processes as 2 emulated nodes),
the LARS precision plugin and recipe callbacks. The dataset's class count is linked to the
model's, so it is given once. Each run writes (``config.yaml``, ``checkpoints/``) into a fresh
folder ``runs/lightning_cli/<date>_<time>`` unless ``--trainer.default_root_dir`` is given.
"""
from __future__ import annotations

import os
import time

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_fastscale  # noqa: F401  (registers the strategy names)
from lightning_fastscale import ImageClassifier, ProceduralDataModule


class FastscaleCLI(LightningCLI):
    """``LightningCLI`` with the model's ``num_classes`` taken from the datamodule."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes")


def run_folder() -> str:
    """This run's folder; the ranks Lightning's launcher starts inherit the stamp through the environment."""
    stamp = os.environ.setdefault("LIGHTNING_CLI_RUN_STAMP", time.strftime("%Y-%m-%d_%H-%M-%S"))
    return os.path.join("runs", "lightning_cli", stamp)


def main(args: list[str] | None = None, run: bool = True) -> FastscaleCLI:
    """Run the CLI on ``args`` (``sys.argv`` when None); ``run=False`` only builds the objects."""
    return FastscaleCLI(ImageClassifier, ProceduralDataModule, args=args, run=run,
                        trainer_defaults={"default_root_dir": run_folder()})


if __name__ == "__main__":
    main()
