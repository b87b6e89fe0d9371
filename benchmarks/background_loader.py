"""No-worker training loader: batches decoded on the training thread against a background thread.

With ``num_workers=0`` the streaming datamodule decodes in the training process. This times,
on a folder written by ``fastscale-data convert``, images per second of one epoch of

* ``synchronous``: `EpochAwareStreamingDataLoader` (the batch is decoded on the training
  thread when the loop asks for it),
* ``background``: `BackgroundStreamingDataLoader` (the datamodule's loader: one thread reads
  the batches, ``prefetch_factor`` threads decode them, that many batches ahead),

each with the same ``decode_threads``, for a loop that does nothing with the batch, a loop
whose "step" waits a fixed time without using the CPU (what the host does while an
accelerator runs the step), and one whose step is a CPU matrix product of about that time.
Rounds are interleaved; the table gives medians and the background / synchronous ratio of
the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from lightning_fastscale.data.streaming import EpochAwareStreamingDataLoader, StreamingDataModule


def _matmul_step(ms: float) -> Callable[[], None]:
    a = torch.randn(256, 256)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        a @ a
        n += 1
    per_step = max(1, round(ms / 1000 / ((time.perf_counter() - start) / n)))

    def step() -> None:
        for _ in range(per_step):
            a @ a

    return step


def epoch_rate(loader: EpochAwareStreamingDataLoader, step: Callable[[], None] | None) -> float:
    """Images per second of one whole epoch of ``loader`` with ``step`` run on every batch."""
    start, n = time.perf_counter(), 0
    for images, _ in loader:
        n += images.shape[0]
        if step is not None:
            step()
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="folder written by fastscale-data convert")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--decode-threads", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(1)  # the matmul step: one core, as the step of a training thread
    dm = StreamingDataModule(args.root, resolution=args.resolution, batch_size=args.batch_size,
                             num_workers=0, decode_threads=args.decode_threads, pin_memory=False)
    dm.setup("fit")

    def synchronous() -> EpochAwareStreamingDataLoader:
        dataset = dm.train_dataset()
        return EpochAwareStreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=0,
                                             collate_fn=dataset.batch_decoder(args.decode_threads, False))

    loaders = {"synchronous": synchronous(), "background": dm.train_dataloader()}
    wait_s = args.step_ms / 1000
    steps = {"none": None, f"wait {args.step_ms:g} ms": lambda: time.sleep(wait_s),
             f"matmul ~{args.step_ms:g} ms": _matmul_step(args.step_ms)}
    for loader in loaders.values():  # warm-up epoch
        epoch_rate(loader, None)
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for step_name, step in steps.items():
            for name, loader in loaders.items():
                rates.setdefault((step_name, name), []).append(epoch_rate(loader, step))
    print("| step per batch | synchronous, images/s | background, images/s | background / synchronous |")
    print("|---|---:|---:|---:|")
    for step_name in steps:
        sync = statistics.median(rates[(step_name, "synchronous")])
        bg = statistics.median(rates[(step_name, "background")])
        print(f"| {step_name} | {sync:,.0f} | {bg:,.0f} | {bg / sync:.2f}x |")


if __name__ == "__main__":
    import results_file

    results_file.run(main, "background_loader")
