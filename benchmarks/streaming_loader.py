"""The streaming training loader: batch decode in threads against per-sample decode; buffers; restarts.

On a generated tree of photo-like JPEGs (``input_common.write_tree``) converted at each
``--max-sides`` (``640`` keeps the source size), this times, in interleaved rounds:

1. images/s of ``StreamingDataModule``'s training loader up to the uint8 batch, within one
   epoch, at several (loader workers, decode threads): the batch path (one
   ``transforms.train_batch`` call per batch, the datamodule's own) against the per-sample
   path it replaced (each sample decoded strictly and augmented as it is read, then
   ``default_collate``), both on the same samples, crops and flips;
2. one ``train_batch`` call into an NCHW buffer against a channels-last one; the per-batch
   cost of the output buffer: a fresh allocation that is then written, against
   writing into a buffer that is reused; in a loader worker, allocating the batch in shared
   memory (what the collate does) against copying it there when it is sent;
3. what starting a new epoch's workers costs: the wait for an epoch's first batch beyond a
   steady batch, against the time of a whole ImageNet-length epoch at the measured rate.

Prints one JSON document. Example::

    python benchmarks/streaming_loader.py --workdir /tmp/slb --max-sides 256 640
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from input_common import write_tree  # noqa: E402

from lightning_fastscale.data import StreamingDataModule, transforms  # noqa: E402
from lightning_fastscale.data.convert import convert  # noqa: E402
from lightning_fastscale.data.jpeg_decode import strict_decode  # noqa: E402
from lightning_fastscale.data.streaming_datasets import DecodedStreamingDataset  # noqa: E402

IMAGENET_TRAIN = 1_281_167


class PerSampleDataset(DecodedStreamingDataset):
    """The path before batch decode: each sample decoded strictly and augmented as it is read."""

    def decode(self, item: dict[str, Any]) -> tuple[torch.Tensor, int]:
        g = transforms.sample_generator(self.augment_seed, self.current_epoch, int(item["index"]))
        data = torch.frombuffer(bytearray(item["image"]), dtype=torch.uint8)
        image = strict_decode(lambda d: transforms.train_transform(d, self.resolution, g, self.scale, self.ratio), data)
        return image, int(item["label"])


class PerSampleDataModule(StreamingDataModule):
    dataset_class = PerSampleDataset


def loader_rate(dm_class: type, root: Path, args: argparse.Namespace, workers: int, threads: int) -> tuple[float, float]:
    """``(images per wall second, images per CPU second of this process)`` over ``args.batches``
    batches after 2 warm-up ones, within one epoch. The second is the per-core figure that stays
    put on a loaded machine; it counts only this process, so it means something with no workers."""
    dm = dm_class(str(root), resolution=args.resolution, batch_size=args.batch_size, num_workers=workers,
                  decode_threads=threads, pin_memory=False, device_prefetch=False)
    loader = dm.train_dataloader()
    if len(loader) < args.batches + 2:
        raise SystemExit(f"{len(loader)} batches per epoch; need {args.batches + 2}: more --images or a smaller --batch-size")
    it = iter(loader)
    for _ in range(2):
        next(it)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.batches):
        next(it)
    images = args.batches * args.batch_size
    rates = images / (time.perf_counter() - start), images / (time.process_time() - cpu)
    del it
    return rates


def epoch_start_cost(root: Path, args: argparse.Namespace, workers: int, threads: int) -> dict[str, float]:
    """Seconds to an epoch's first batch beyond a steady batch (median over epochs), and the steady batch."""
    dm = StreamingDataModule(str(root), resolution=args.resolution, batch_size=args.batch_size, num_workers=workers,
                             decode_threads=threads, pin_memory=False, device_prefetch=False)
    loader = dm.train_dataloader()
    firsts, steady = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        firsts.append(time.perf_counter() - start)
        for _ in range(len(loader) - 1):
            t = time.perf_counter()
            next(it)
            steady.append(time.perf_counter() - t)
        for _ in it:
            pass
    step = statistics.median(steady)
    return {"first_batch_s": statistics.median(firsts), "steady_batch_s": step,
            "restart_excess_s": statistics.median(firsts) - step}


def buffer_costs(args: argparse.Namespace, repeats: int = 20) -> dict[str, float]:
    """Milliseconds per uint8 buffer of a 256-image batch: fresh + written vs reused + written; shm alloc vs shm copy."""
    shape = (256, 3, args.resolution, args.resolution)  # a typical per-GPU batch
    reused = torch.empty(shape, dtype=torch.uint8)
    reused.fill_(1)

    def ms(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    def shared_then_written() -> None:
        storage = torch.UntypedStorage._new_shared(reused.numel())
        torch.empty(0, dtype=torch.uint8).set_(storage).view(shape).fill_(2)

    def written_then_shared() -> None:
        torch.empty(shape, dtype=torch.uint8).fill_(2).share_memory_()

    return {
        "fresh_written_ms": ms(lambda: torch.empty(shape, dtype=torch.uint8).fill_(2)),
        "reused_written_ms": ms(lambda: reused.fill_(2)),
        "shared_alloc_written_ms": ms(shared_then_written),
        "written_then_copied_to_shared_ms": ms(written_then_shared),
    }


def layout_rates(root: Path, args: argparse.Namespace, count: int = 64) -> dict[str, float]:
    """Images per CPU second of one ``train_batch`` call (1 thread) into an NCHW and a channels-last buffer."""
    from litdata import StreamingDataset

    dataset = StreamingDataset(str(root / "train"))
    jpegs = [torch.frombuffer(bytearray(dataset[i]["image"]), dtype=torch.uint8) for i in range(count)]
    times: dict[str, list[float]] = {"NCHW": [], "channels-last": []}
    for _ in range(args.rounds + 2):
        for name, layout in (("NCHW", torch.contiguous_format), ("channels-last", torch.channels_last)):
            out = torch.empty((count, 3, args.resolution, args.resolution), dtype=torch.uint8, memory_format=layout)
            generators = [transforms.sample_generator(0, 0, i) for i in range(count)]
            start = time.process_time()
            transforms.train_batch(jpegs, generators, args.resolution, out=out)
            times[name].append(time.process_time() - start)
    return {name: round(count / statistics.median(t), 1) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--max-sides", type=int, nargs="+", default=[256, 640])
    parser.add_argument("--images", type=int, default=384, help="training images generated (default: %(default)s)")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    tree = args.workdir / "tree"
    if not tree.exists():
        write_tree(tree, classes=4, train_per_class=args.images // 4, val_per_class=1)
    streams = {}
    for side in args.max_sides:
        streams[side] = args.workdir / f"stream{side}"
        if not streams[side].exists():
            convert(tree, streams[side], max_side=side, quality=90, num_workers=1)

    settings = [("per-sample", 0, 1), ("batch", 0, 1), ("batch", 0, cores),
                ("per-sample", cores, 1), ("batch", cores, 1), ("batch", max(1, cores // 2), 2)]
    classes = {"per-sample": PerSampleDataModule, "batch": StreamingDataModule}
    result: dict[str, Any] = {"cores": cores, "resolution": args.resolution, "batch_size": args.batch_size}
    for side, root in streams.items():
        rates: dict[str, list[tuple[float, float]]] = {f"{p} {w}x{t}": [] for p, w, t in settings}
        for _ in range(args.rounds):
            for path, workers, threads in settings:
                rates[f"{path} {workers}x{threads}"].append(loader_rate(classes[path], root, args, workers, threads))
        wall = {k: round(statistics.median(r[0] for r in v), 1) for k, v in rates.items()}
        cpu = {k: round(statistics.median(r[1] for r in v), 1) for k, v in rates.items() if k.split()[1].startswith("0x")}
        result[f"max_side_{side}"] = {
            "train_batch images_per_cpu_s by buffer layout": layout_rates(root, args),
            "images_per_wall_s (workers x threads)": wall,
            "images_per_cpu_s, no workers": cpu,
            "per core: batch 0x1 / per-sample 0x1 (cpu s)": round(cpu["batch 0x1"] / cpu["per-sample 0x1"], 3),
            f"all cores: batch 0x{cores} / per-sample {cores}x1 (wall)":
                round(wall[f"batch 0x{cores}"] / wall[f"per-sample {cores}x1"], 3),
        }
    root = streams[args.max_sides[0]]
    workers = cores
    restart = epoch_start_cost(root, args, workers, 1)
    per_rank_epoch_s = IMAGENET_TRAIN / 8 / args.batch_size * restart["steady_batch_s"]
    result["epoch_start"] = {**{k: round(v, 4) for k, v in restart.items()}, "workers": workers,
                             "imagenet_epoch_per_rank_of_8_s": round(per_rank_epoch_s, 1),
                             "restart_share_of_epoch": round(restart["restart_excess_s"] / per_rank_epoch_s, 6)}
    result["buffers"] = {k: round(v, 3) for k, v in buffer_costs(args).items()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    import results_file

    results_file.run(main, "streaming_loader")
