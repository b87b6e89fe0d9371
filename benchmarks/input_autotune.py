"""``num_workers: auto`` against measurement: the probe's pick, then every worker count it tried measured again.

Example::

    python benchmarks/input_autotune.py --workdir /tmp/ipb5
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import input_common

from lightning_fastscale.data.cli import bench_pipeline


def autotune_check(stream_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run the auto probe, then re-measure each count it tried; the pick vs the best re-measured."""
    import tempfile

    from lightning_fastscale.data import StreamingDataModule

    dm = StreamingDataModule(str(stream_root), resolution=args.resolution, batch_size=args.batch_size,
                             num_workers="auto", num_workers_cache=str(Path(tempfile.mkdtemp()) / "nw.json"))
    dm.setup("fit")
    probe = dm.num_workers_probe
    assert probe is not None
    # wall clock for every count, as the probe measures: what a training run waits on
    threads = probe["threads_by_workers"]
    remeasured = {n: bench_pipeline("streaming", str(stream_root), args.resolution, args.batch_size, n, args.batches,
                                    warmup=max(2, n), decode_threads=threads[n]) for n in probe["images_per_s"]}
    best = max(remeasured.values())
    return {"pick": probe["num_workers"], "probe_curve": probe["images_per_s"], "remeasured": remeasured,
            "pick_vs_best": remeasured[probe["num_workers"]] / best}


def run(args: argparse.Namespace) -> None:
    _, streams = input_common.prepare(args)
    res = autotune_check(streams[args.max_sides[-1]], args)
    print(f"\nnum_workers auto: {json.dumps(res, default=str)}")


if __name__ == "__main__":
    parser = input_common.parser(__doc__, "input_autotune")
    parser.add_argument("--batches", type=int, default=8)
    input_common.main(run, parser.parse_args())
