"""How far bf16 autocast gradients are from fp32 ones, per parameter, on the study's model.

A diagnostic for the large-batch study (benchmarks/README.md, "Settings compared"), where the
full recipe in bf16 on the CPU ends about 1.3 points below the same recipe with the plugin in
fp32. One batch of the built-in dataset through ``resnet_small`` (the study's 16/32/64 widths),
at initialisation; the relative error ``||g_variant - g_fp32|| / ||g_fp32||`` of each
parameter's gradient for:

    autocast_bf16   torch.autocast("cpu", bfloat16): what LARSMixedPrecision runs on the CPU
    emulated_bf16   no autocast; every convolution's input and weight rounded to bf16, the
                    product summed in fp32 and the output rounded to bf16 (ideal bf16 kernels)

When the two columns agree, the error comes from bf16 itself (8-bit mantissas of activations
and their gradients), not from the CPU's bf16 kernels.

    python benchmarks/bf16_grad_error.py [--batch 512] [--seed 0]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fastscale.data.procedural import ProceduralShapes
from lightning_fastscale.models import create_model


def _gradients(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, autocast: bool) -> dict[str, torch.Tensor]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _emulated_bf16_convolutions(model: nn.Module) -> Callable[[], None]:
    """Make every Conv2d compute bf16-rounded inputs in fp32 and round its output; return an undo."""
    def round_bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).to(torch.float32)

    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    for conv in convs:
        conv.forward = lambda x, c=conv: round_bf16(c._conv_forward(round_bf16(x), round_bf16(c.weight), c.bias))
    return lambda: [conv.__dict__.pop("forward") for conv in convs]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print and return ``{parameter: {variant: relative error}}``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=512, help="the study's large batch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    data = ProceduralShapes(size=args.batch, num_classes=10, resolution=24, seed=args.seed)
    images = torch.stack([data[i][0] for i in range(args.batch)])
    labels = torch.tensor([data[i][1] for i in range(args.batch)])
    model = create_model("resnet_small", num_classes=10, widths=[16, 32, 64], blocks_per_stage=1)

    reference = _gradients(model, images, labels, autocast=False)
    variants = {"autocast_bf16": _gradients(model, images, labels, autocast=True)}
    undo = _emulated_bf16_convolutions(model)
    variants["emulated_bf16"] = _gradients(model, images, labels, autocast=False)
    undo()

    table = {name: {v: float((g[name] - ref).norm() / ref.norm()) for v, g in variants.items()}
             for name, ref in reference.items()}
    print(f"| parameter | shape | {' | '.join(variants)} |")
    print("|---|---|" + "---:|" * len(variants))
    for name, errors in table.items():
        cells = " | ".join(f"{e:.4f}" for e in errors.values())
        print(f"| {name} | {tuple(reference[name].shape)} | {cells} |")
    return table


if __name__ == "__main__":
    import results_file

    results_file.run(main, "bf16_grad_error")
