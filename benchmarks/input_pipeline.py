"""Input-pipeline throughput: ImageFolder (PIL) vs the streaming datamodule vs DALI CPU vs nvJPEG.

Generates its own ImageNet-like JPEG tree (333-640 px wide, aspect 0.66-1, quality 85-95,
multi-octave texture + gradient + pixel noise so files are ~100 KB like ImageNet's), converts
it with ``fastscale-data convert`` at each ``--max-sides``, then times the training pipeline
(random resized crop to ``--resolution`` + flip, up to a normalised float batch):

* per core: one process, one thread (``num_workers=0``, ``torch.set_num_threads(1)``; DALI
  ``num_threads=1``);
* all cores: ``num_workers = os.cpu_count()`` loader processes (DALI: that many threads);

and reports images/s and the ratio to today's ``ImageFolderDataModule`` measured in the same
run. ``streaming @ source`` stores the images at their own size (max side 640): the same
pixels as ImageFolder reads, re-encoded once; its ``uint8 out`` row stops at the uint8 batch
(on a GPU machine the normalisation runs on the device, so that is the CPU's share), and the
``decode_jpeg alone`` row times just the decode of the same bytes: the ceiling of any pipeline
that decodes them in full. The timed batches lie within one epoch (``bench_pipeline`` refuses
otherwise). DALI runs where ``nvidia-dali`` imports; nvJPEG where CUDA is available (otherwise
each is skipped with a message).

``--decoders`` also times JPEG decoders alone on the source files (TorchCodec, torchvision and,
where ``simplejpeg`` is installed, libjpeg-turbo's DCT-domain scaling). ``--autotune`` also runs the ``num_workers: auto`` probe and measures every worker count it
tried again, to check the pick against the best measured count. ``--train-step`` times the
end-to-end ``fastscale-train`` step (the Hydra config of ``train.py``, built with its
``build``) with ``data=streaming`` against ``data=imagefolder`` at equal settings, in
interleaved rounds.

Example::

    flock /tmp/cpu.lock nice -n 5 python benchmarks/input_pipeline.py --workdir /tmp/ipb --autotune --train-step
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import results_file
import torch
from PIL import Image

from lightning_fastscale.data import jpeg_decode
from lightning_fastscale.data.cli import bench_pipeline
from lightning_fastscale.data.convert import convert
from lightning_fastscale.data.stored_format import read_metadata
from lightning_fastscale.data.transforms import normalize_on_device as fast_normalize


def photo_like(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """An RGB uint8 image with texture at several scales, a colour gradient and pixel noise."""
    img = np.zeros((height, width, 3), np.float32)
    for octave in (4, 16, 64):
        base = rng.normal(0, 1, (max(2, height // octave), max(2, width // octave), 3))
        small = Image.fromarray((base * 40 + 128).clip(0, 255).astype(np.uint8))
        img += (np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), np.float32) - 128) * (octave / 64) ** 0.5
    yy, xx = np.mgrid[0:height, 0:width]
    img += rng.uniform(-60, 60, 3) * (xx / width)[..., None] + rng.uniform(-60, 60, 3) * (yy / height)[..., None]
    img += rng.uniform(60, 190, 3) + rng.normal(0, 16, img.shape)
    return img.clip(0, 255).astype(np.uint8)


def write_tree(root: Path, classes: int, train_per_class: int, val_per_class: int, seed: int = 0) -> dict[str, float]:
    """ImageNet layout of photo-like JPEGs; returns the mean file size and pixel count."""
    rng = np.random.default_rng(seed)
    sizes, pixels = [], []
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            d = root / split / f"n{c:08d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                w = int(rng.integers(333, 641))
                h = int(w * rng.uniform(0.66, 1.0))
                buf = io.BytesIO()
                Image.fromarray(photo_like(rng, h, w)).save(buf, "JPEG", quality=int(rng.integers(85, 96)))
                (d / f"img_{i:05d}.JPEG").write_bytes(buf.getvalue())
                sizes.append(len(buf.getvalue()))
                pixels.append(w * h)
    return {"mean_kb": statistics.mean(sizes) / 1e3, "mean_pixels": statistics.mean(pixels), "files": len(sizes)}


def dali_images_per_s(root: Path, resolution: int, batch_size: int, threads: int, batches: int, clock: str = "wall") -> float | None:
    """DALI CPU pipeline: fused decode + random crop, resize, flip, uint8 out; None without DALI."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except Exception as err:  # ImportError, or a CUDA-library load error
        print(f"DALI skipped: nvidia-dali not importable ({type(err).__name__}: {err})")
        return None

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=0)
    def pipe() -> Any:
        jpegs, labels = fn.readers.file(file_root=str(root / "train"), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=resolution, resize_y=resolution)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return images, labels

    p = pipe()
    p.build()
    timer = time.process_time if clock == "process" else time.perf_counter
    for _ in range(2):
        p.run()
    start = timer()
    for _ in range(batches):
        images, _ = p.run()
        batch = torch.from_numpy(images.as_array()).permute(0, 3, 1, 2)
        fast_normalize(batch)  # normalise like the others, on the CPU
    rate = batches * batch_size / (timer() - start)
    del p
    return rate


def nvjpeg_images_per_s(stream_root: Path, resolution: int, batch_size: int, batches: int) -> float | None:
    """Batched nvJPEG decode + crop/resize/flip on the GPU from stored bytes; None without CUDA."""
    if not torch.cuda.is_available():
        print("nvJPEG skipped: no CUDA device")
        return None
    from litdata import StreamingDataset
    from torchvision.transforms.v2 import functional as F

    from lightning_fastscale.data import transforms

    ds = StreamingDataset(str(stream_root / "train"))
    datas = [torch.frombuffer(bytearray(ds[i]["image"]), dtype=torch.uint8) for i in range(min(len(ds), batch_size * 4))]
    g = torch.Generator().manual_seed(0)

    def run(k: int) -> None:
        chunk = [datas[(k * batch_size + j) % len(datas)] for j in range(batch_size)]
        images = jpeg_decode.decode_jpeg_batch_on_device(chunk, "cuda")
        out = []
        for img in images:
            box = transforms.random_resized_crop_box(img.shape[1], img.shape[2], g)
            out.append(F.resized_crop(img, *box, [resolution, resolution], antialias=True))
        transforms.normalize_on_device(torch.stack(out))

    run(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(batches):
        run(k)
    torch.cuda.synchronize()
    return batches * batch_size / (time.perf_counter() - start)


def decode_only_images_per_s(stream_root: Path, count: int) -> float:
    """Images per CPU-second of libjpeg-turbo ``decode_jpeg`` alone on stored bytes: the ceiling
    of any CPU pipeline that fully decodes these files, whatever it does after the decode."""
    from litdata import StreamingDataset


    ds = StreamingDataset(str(stream_root / "train"))
    datas = [torch.frombuffer(bytearray(ds[i]["image"]), dtype=torch.uint8) for i in range(min(len(ds), count))]
    start = time.process_time()
    for data in datas:
        jpeg_decode.decode_rgb(data)
    return len(datas) / (time.process_time() - start)


def decoder_ms(tree: Path, files: int = 100, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` ms per image, one thread, of JPEG decoders on the source files:
    TorchCodec and torchvision (the same libjpeg-turbo), and, where ``simplejpeg`` imports,
    libjpeg-turbo's DCT-domain scaling at M/8 and its fast IDCT + upsampling."""
    import warnings

    from torchvision.io import decode_jpeg as torchvision_decode_jpeg


    raw = [p.read_bytes() for p in sorted((tree / "train").rglob("*.JPEG"))[:files]]
    datas = [torch.frombuffer(bytearray(r), dtype=torch.uint8) for r in raw]
    cases: dict[str, Any] = {
        "torchcodec decode_jpeg (decode_rgb)": lambda i: jpeg_decode.decode_rgb(datas[i]),
        "torchvision decode_jpeg": lambda i: torchvision_decode_jpeg(datas[i]),
    }
    try:
        import cv2
    except ImportError:
        print("opencv not installed: cv2.imdecode row skipped")
    else:
        arrays = [np.frombuffer(r, np.uint8) for r in raw]
        cases["OpenCV imdecode, RGB"] = lambda i: cv2.imdecode(arrays[i], cv2.IMREAD_COLOR_RGB)
    try:
        import simplejpeg
    except ImportError:
        print("simplejpeg not installed: DCT-domain scaling rows skipped")
    else:
        sizes = [simplejpeg.decode_jpeg_header(r)[:2] for r in raw]
        for num in (8, 7, 6, 5, 4):
            cases[f"simplejpeg, DCT scale {num}/8"] = lambda i, num=num: simplejpeg.decode_jpeg(
                raw[i], min_height=sizes[i][0] * num // 8, min_width=sizes[i][1] * num // 8)
        cases["simplejpeg, fast IDCT + upsampling"] = lambda i: simplejpeg.decode_jpeg(raw[i], fastdct=True, fastupsample=True)
    best = {name: math.inf for name in cases}
    with warnings.catch_warnings():  # torchvision's decoders are deprecated from 0.29
        warnings.simplefilter("ignore")
        for _ in range(repeats):
            for name, fn in cases.items():
                start = time.process_time()
                for i in range(len(raw)):
                    fn(i)
                best[name] = min(best[name], (time.process_time() - start) / len(raw) * 1e3)
    return best


def kernel_ms(stored: tuple[list[torch.Tensor], list[int]], resolution: int, files: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` ms per image, one thread, of each step of the training transform on
    the same stored bytes, crop boxes and flips: the decode (TorchCodec, and simplejpeg with its
    accurate and its fast IDCT), the per-image resize against `train_batch`'s (OpenCV bilinear
    for crops enlarged on both axes, torchvision's antialiased kernel into the batch slot
    otherwise), and the whole per-image and batch paths (`train_batch` with each decoder, and
    with DCT-domain scaling); then the pixel differences of the fast IDCT and of DCT-domain
    scaling after the whole transform, in grey levels."""
    import cv2
    import simplejpeg
    from torchvision.transforms.v2 import functional as F

    from lightning_fastscale.data import transforms

    jpegs = stored[0][:files]
    images = [jpeg_decode.decode_rgb(j) for j in jpegs]
    plans = [transforms.draw_crop(im.shape[1], im.shape[2], transforms.sample_generator(0, 0, i))
             for i, im in enumerate(images)]
    out = torch.empty(len(jpegs), 3, resolution, resolution, dtype=torch.uint8, memory_format=torch.channels_last)
    scratch = np.empty((resolution, resolution, 3), np.uint8)
    pixels, slots = [transforms._pixels(im) for im in images], out.permute(0, 2, 3, 1).numpy()  # train_batch's views
    enlarged = [i for i, (box, _) in enumerate(plans) if box[2] <= resolution and box[3] <= resolution]

    def area(i: int) -> None:  # FFCV's resize: INTER_AREA on the crop region, whatever the scale
        (top, left, h, w), _ = plans[i]
        cv2.resize(images[i].permute(1, 2, 0).numpy()[top : top + h, left : left + w], (resolution, resolution),
                   dst=scratch, interpolation=cv2.INTER_AREA)

    cases: dict[str, Any] = {
        "decode (TorchCodec `decode_jpeg`)": (lambda i: jpeg_decode.decode_rgb(jpegs[i]), range(len(jpegs))),
        "decode (simplejpeg, accurate IDCT: `train_batch`'s)": (
            lambda i: simplejpeg.decode_jpeg(jpegs[i].numpy(), "RGB"), range(len(jpegs))),
        "decode (simplejpeg, fast IDCT, as FFCV's)": (
            lambda i: simplejpeg.decode_jpeg(jpegs[i].numpy(), "RGB", fastdct=True), range(len(jpegs))),
        "resize + flip, torchvision `resized_crop` (per-image path)": (
            lambda i: transforms.crop_resize_flip(images[i], *plans[i][:1], resolution, plans[i][1]), range(len(jpegs))),
        "resize + flip, `train_batch`'s (into the batch slot)": (
            lambda i: transforms._crop_resize_flip_into(pixels[i], plans[i][0], resolution, plans[i][1], out[i], slots[i]),
            range(len(jpegs))),
        "resize, OpenCV INTER_AREA on the crop (FFCV's)": (area, range(len(jpegs))),
        "crops enlarged on both axes only: torchvision `resized_crop`": (
            lambda i: transforms.crop_resize_flip(images[i], *plans[i][:1], resolution, plans[i][1]), enlarged),
        "the same crops: `train_batch`'s (OpenCV bilinear)": (
            lambda i: transforms._crop_resize_flip_into(pixels[i], plans[i][0], resolution, plans[i][1], out[i], slots[i]),
            enlarged),
        "whole transform, per image (`train_transform`)": (
            lambda i: transforms.train_transform(jpegs[i], resolution, transforms.sample_generator(0, 0, i)),
            range(len(jpegs))),
    }
    best = {name: math.inf for name in cases}
    gens = lambda: [transforms.sample_generator(0, 0, i) for i in range(len(jpegs))]  # noqa: E731
    sj = transforms._simplejpeg

    def batch(decoder: Any, dct_scaling: bool = False) -> torch.Tensor:
        transforms._simplejpeg = decoder  # None: TorchCodec decodes, as without simplejpeg
        try:
            return transforms.train_batch(jpegs, gens(), resolution, out=out, dct_scaling=dct_scaling)
        finally:
            transforms._simplejpeg = sj

    batches = {"whole transform, `train_batch` (1 thread, TorchCodec decode)": lambda: batch(None),
               "whole transform, `train_batch` (1 thread, simplejpeg decode)": lambda: batch(sj),
               "whole transform, `train_batch` (1 thread, simplejpeg, `dct_scaling=True`)": lambda: batch(sj, True)}
    best.update({name: math.inf for name in batches})
    for _ in range(repeats):
        for name, (fn, which) in cases.items():
            if not which:
                continue
            start = time.process_time()
            for i in which:
                fn(i)
            best[name] = min(best[name], (time.process_time() - start) / len(which) * 1e3)
        for name, run in batches.items():
            start = time.process_time()
            run()
            best[name] = min(best[name], (time.process_time() - start) / len(jpegs) * 1e3)
    val_best = {"validation resize + centre crop, torchvision (before)": math.inf,
                "validation resize + centre crop, `val_transform`'s": math.inf}
    short = round(resolution / 0.875)
    for _ in range(repeats):
        start = time.process_time()
        for im in images:
            F.center_crop(F.resize(im, [short], antialias=True), [resolution, resolution])
        mid = time.process_time()
        for im in images:
            transforms.resize_centre_crop(im, resolution)
        end = time.process_time()
        for name, took in zip(val_best, (mid - start, end - mid)):
            val_best[name] = min(val_best[name], took / len(images) * 1e3)
    best.update(val_best)
    best["share of crops enlarged on both axes"] = len(enlarged) / len(jpegs)
    # where a 1/2-scale DCT-domain decode could serve: the crop keeps >= the output size at half scale
    best["share of crops >= 2x the output on both axes"] = sum(
        box[2] >= 2 * resolution and box[3] >= 2 * resolution for box, _ in plans) / len(jpegs)
    # accuracy against the per-image path (torchvision's antialiased bilinear), in grey levels
    reduced = [i for i in range(len(jpegs)) if i not in set(enlarged)]
    for name, which, fn in (("`train_batch`", range(len(jpegs)), None), ("OpenCV INTER_AREA, reduced crops", reduced, area)):
        diffs = []
        for i in which:
            ref = transforms.crop_resize_flip(images[i], plans[i][0], resolution, False).permute(1, 2, 0).numpy()
            if fn is None:
                transforms._crop_resize_flip_into(pixels[i], plans[i][0], resolution, False, out[i], slots[i])
                got = out[i].permute(1, 2, 0).numpy()
            else:
                fn(i)
                got = scratch
            diffs.append(np.abs(got.astype(np.int16) - ref.astype(np.int16)))
        best[f"{name}: mean abs diff to torchvision"] = float(np.mean([d.mean() for d in diffs])) if diffs else math.nan
        best[f"{name}: max abs diff to torchvision"] = float(max(d.max() for d in diffs)) if diffs else math.nan
    # the whole transform with the fast IDCT or DCT-domain scaling against `train_batch` as it is
    accurate = batch(sj).clone()
    reductions = [transforms._dct_reduction(box, resolution) for box, _ in plans]
    best["share of crops decoded at 1/2, 1/4 or 1/8 scale (`dct_scaling`)"] = sum(d > 1 for d in reductions) / len(jpegs)
    scaled = batch(sj, True)
    changed = [i for i, d in enumerate(reductions) if d > 1]
    d = (scaled[changed].int() - accurate[changed].int()).abs() if changed else None
    best["`dct_scaling`, crops decoded reduced: mean abs diff"] = d.float().mean().item() if changed else math.nan
    best["`dct_scaling`, crops decoded reduced: max abs diff"] = d.max().item() if changed else math.nan
    best["`dct_scaling`, other crops: max abs diff"] = max(
        ((scaled[i].int() - accurate[i].int()).abs().max().item() for i in range(len(jpegs)) if reductions[i] == 1),
        default=math.nan)
    fast_images = [torch.from_numpy(simplejpeg.decode_jpeg(j.numpy(), "RGB", fastdct=True)).permute(2, 0, 1) for j in jpegs]
    d = torch.stack([(transforms.crop_resize_flip(fi, box, resolution, False).int()
                      - transforms.crop_resize_flip(im, box, resolution, False).int()).abs()
                     for fi, im, (box, _) in zip(fast_images, images, plans)])
    best["fast IDCT after the crop + resize: mean abs diff"] = d.float().mean().item()
    best["fast IDCT after the crop + resize: max abs diff"] = d.max().item()
    return best


def _measure(pipeline: str, root: Path, args: argparse.Namespace, workers: int, normalize: bool = True) -> float:
    # one process (workers=0): images per CPU-second of this process, robust to other load;
    # with workers: wall clock, since the work happens in the worker processes
    clock = "process" if workers == 0 else "wall"
    return bench_pipeline(pipeline, str(root), args.resolution, args.batch_size, workers, args.batches,
                          warmup=max(2, workers), clock=clock, normalize=normalize)


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


def train_step_check(tree: Path, stream_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Median ``fastscale-train`` step time, data=streaming vs data=imagefolder, interleaved rounds."""
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_module

    from lightning_fastscale.train import build

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *a: Any) -> None:
            self.starts.append(time.perf_counter())

    common = [
        f"data.resolution={args.step_resolution}", f"data.batch_size={args.step_batch_size}",
        f"data.num_workers={args.step_workers}", "trainer.max_epochs=1", f"+trainer.limit_train_batches={args.step_batches}",
        "+trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "callbacks=none", "logger=none", "trainer.accelerator=cpu", "trainer.devices=1", "+trainer.enable_checkpointing=false",
        f"trainer.default_root_dir={args.workdir / 'train_step'}",
    ]
    configs = {
        "imagefolder": ["data=imagefolder", f"data.root={tree}", "data.persistent_workers=false", *common],
        "streaming": ["data=streaming", f"data.root={stream_root}", *common],
    }
    times: dict[str, list[float]] = {k: [] for k in configs}
    with initialize_config_module("lightning_fastscale.conf", version_base="1.3"):
        for r in range(args.step_rounds):
            for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                cfg = compose("train", overrides=configs[name])
                pl.seed_everything(0)
                datamodule, module, trainer = build(cfg)
                timer = StepTimer()
                trainer.callbacks.append(timer)
                trainer.fit(module, datamodule=datamodule)
                steps = np.diff(timer.starts)[3:]  # after the first batches (worker start-up)
                times[name].append(float(np.median(steps)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_step_s": med, "rounds": times, "streaming_over_imagefolder_step_time": med["streaming"] / med["imagefolder"]}


# ---- ImageNet-length epochs against FFCV (--versus-ffcv) ------------------------------------


def repeated_tree(tree: Path, out: Path, repeat: int) -> Path:
    """``tree`` with every training file present ``repeat`` times (hard links; val once)."""
    if (out / "done").is_file():
        return out
    for src in sorted(tree.rglob("*.JPEG")):
        rel = src.relative_to(tree)
        copies = repeat if rel.parts[0] == "train" else 1
        (out / rel.parent).mkdir(parents=True, exist_ok=True)
        for k in range(copies):
            dst = out / rel.parent / f"{src.stem}_r{k}{src.suffix}"
            if not dst.exists():
                os.link(src, dst)
    (out / "done").write_text("")
    return out


def stored_train(stream_root: Path) -> tuple[list[torch.Tensor], list[int]]:
    """The JPEG bytes and labels of a converted training split, read once through litdata."""
    from litdata import StreamingDataset

    ds = StreamingDataset(str(stream_root / "train"))
    items = [ds[i] for i in range(len(ds))]
    return [torch.frombuffer(bytearray(it["image"]), dtype=torch.uint8) for it in items], [int(it["label"]) for it in items]


def ffcv_importable() -> bool:
    """Whether FFCV imports; if not, say so in one line."""
    try:
        import ffcv.fields  # noqa: F401
        import ffcv.loader  # noqa: F401
    except Exception as err:  # ImportError, or its compiled extension failing to load
        print(f"FFCV skipped: ffcv not importable ({type(err).__name__}: {err}); install steps in benchmarks/README.md")
        return False
    return True


def ffcv_beton(stream_root: Path, path: Path) -> Path:
    """An FFCV 1.0.2 dataset of the same stored images (decoded, re-encoded by FFCV at quality
    90: the same pixel count)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    if path.is_file():
        return path

    class Stored(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.jpegs, self.labels = stored_train(stream_root)

        def __len__(self) -> int:
            return len(self.jpegs)

        def __getitem__(self, i: int) -> tuple[Any, int]:
            return Image.open(io.BytesIO(self.jpegs[i].numpy().tobytes())).convert("RGB"), self.labels[i]

    tmp = path.with_suffix(".partial")
    writer = DatasetWriter(str(tmp), {"image": RGBImageField(write_mode="jpg", jpeg_quality=90),
                                      "label": IntField()}, num_workers=os.cpu_count() or 1)
    writer.from_indexed_dataset(Stored())
    tmp.rename(path)
    return path


def _warmed(run_epoch: Any, clock: str) -> Any:
    """Run one untimed warm-up epoch; return a function that times one more epoch (images/s).

    ``run_epoch()`` runs an epoch and returns the number of images it delivered.
    ``clock="process"``: per CPU-second of this process (all its threads), the per-core figure;
    ``"wall"``: what a training loop waits on."""
    timer = time.process_time if clock == "process" else time.perf_counter
    run_epoch()

    def timed() -> float:
        start = timer()
        seen = run_epoch()
        return seen / (timer() - start)

    return timed


def _loader_epochs(loader: Any) -> Any:
    def run() -> int:
        seen = 0
        for images, _ in loader:
            seen += images.shape[0]
        return seen
    return run


def datamodule_epochs(pipeline: str, root: Path, args: argparse.Namespace, workers: int, threads: int = 1) -> Any:
    """A datamodule's training loader (what ``fastscale-train`` iterates), uint8 batches for the
    streaming pipeline (normalised on the device; ``threads`` decode threads per loader process),
    float for ImageFolder (its transform's own)."""
    from lightning_fastscale.data.cli import make_datamodule

    extra = {"decode_threads": threads} if pipeline == "streaming" else {}
    dm = make_datamodule(pipeline, str(root), args.resolution, args.batch_size, workers, **extra)
    if hasattr(dm, "setup"):
        dm.setup("fit")
    return _warmed(_loader_epochs(dm.train_dataloader()), "process" if workers == 0 and threads == 1 else "wall")


def train_batch_epochs(stored: tuple[list[torch.Tensor], list[int]], args: argparse.Namespace, threads: int,
                       torchcodec: bool = False) -> Any:
    """`transforms.train_batch` over the stored bytes held in memory (no chunk reads): shuffled
    batches, one generator per sample, ``threads`` threads, one reused output buffer;
    ``torchcodec``: decoded by TorchCodec, as where simplejpeg is not installed."""
    from lightning_fastscale.data import transforms

    jpegs, _ = stored
    out = torch.empty(args.batch_size, 3, args.resolution, args.resolution, dtype=torch.uint8,
                      memory_format=torch.channels_last)
    epoch = [0]
    simplejpeg = transforms._simplejpeg

    def run() -> int:
        epoch[0] += 1
        order = torch.randperm(len(jpegs), generator=torch.Generator().manual_seed(epoch[0])).tolist()
        seen = 0
        transforms._simplejpeg = None if torchcodec else simplejpeg
        try:
            for b in range(len(order) // args.batch_size):
                idx = order[b * args.batch_size : (b + 1) * args.batch_size]
                gens = [transforms.sample_generator(0, epoch[0], i) for i in idx]
                transforms.train_batch([jpegs[i] for i in idx], gens, args.resolution, threads=threads, out=out)
                seen += len(idx)
        finally:
            transforms._simplejpeg = simplejpeg
        return seen

    return _warmed(run, "process" if threads == 1 else "wall")


def ffcv_epochs(beton: Path, args: argparse.Namespace, threads: int) -> Any:
    """FFCV's loader: fused decode + random resized crop (its defaults: scale 0.08-1, ratio
    3/4-4/3), flip, uint8 ``(N, 3, H, W)`` torch batches, ``threads`` Numba threads, random order."""
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.decoders import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage

    loader = Loader(str(beton), batch_size=args.batch_size, num_workers=threads, order=OrderOption.RANDOM,
                    drop_last=True, os_cache=True, pipelines={
                        "image": [RandomResizedCropRGBImageDecoder((args.resolution, args.resolution)),
                                  RandomHorizontalFlip(), ToTensor(), ToTorchImage()],
                        "label": [IntDecoder(), ToTensor()]})
    return _warmed(_loader_epochs(loader), "process" if threads == 1 else "wall")


def stored_sides(args: argparse.Namespace) -> list[int]:
    """The stored max sides of ``--versus-ffcv``'s data: source size (640), then each ``--max-sides``."""
    return [640, *sorted(set(args.max_sides) - {640}, reverse=True)]


def written_stream(args: argparse.Namespace, side: int) -> Path:
    """The converted folder ``--versus-ffcv`` wrote for ``side``; exits saying how to write it if missing."""
    root = args.workdir / f"stream-x{args.repeat}-{side}"
    if not (root / "dataset.json").is_file():
        raise SystemExit(f"{root} is missing: run --versus-ffcv with the same --workdir, --repeat and "
                         "--max-sides first (--epoch-rounds 0 writes only the data)")
    return root


def read_cost_table(args: argparse.Namespace) -> None:
    """Microseconds of CPU per sample to read ``--versus-ffcv``'s shuffled training split through
    litdata's loader (no decode), with litdata's default window of samples per read
    (``batch_decode="auto"``) and one sample per read (``batch_decode=0``, the datamodule's);
    best of ``--epoch-rounds`` epochs after a warm-up one."""
    from litdata import StreamingDataLoader, StreamingDataset

    print("\n| read only, shuffled, batch_decode | stored max side | auto (litdata default) | 0 (one sample per read) |"
          "\n|---|---|---:|---:|")
    for side in stored_sides(args):
        split = written_stream(args, side) / "train"
        cost = {}
        for batch_decode in ("auto", 0):
            dataset = StreamingDataset(str(split), shuffle=True, seed=0, drop_last=True, batch_decode=batch_decode)
            loader = StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=0, collate_fn=list)
            best = math.inf
            for _ in range(args.epoch_rounds + 1):
                start = time.process_time()
                seen = sum(len(samples) for samples in loader)
                best = min(best, (time.process_time() - start) / seen * 1e6)
            cost[batch_decode] = best
        print(f"| litdata `StreamingDataLoader` | {'source' if side == 640 else side} | {cost['auto']:.1f} | {cost[0]:.1f} |")


def validation_table(args: argparse.Namespace) -> None:
    """Validation batches (`ValidationBatches`, square: resize 256 / crop 224 geometry) over the
    3,200 stored training images of ``--versus-ffcv``'s data, 1 decode thread and one per core,
    no loader worker: images/s, medians of ``--epoch-rounds`` interleaved rounds."""
    from torch.utils.data import DataLoader

    from lightning_fastscale.data import validation_plan
    from lightning_fastscale.data.streaming_datasets import ValidationBatches

    cores = os.cpu_count() or 1
    print(f"\n| validation, {args.resolution} px, batch {args.batch_size}, no worker | stored max side | 1 thread | "
          f"{cores} threads | ratio |\n|---|---|---:|---:|---:|")
    for side in stored_sides(args):
        root = written_stream(args, side)
        split, count = str(root / "train"), read_metadata(root).split_size("train")
        batches = validation_plan.square_rank_batches(count, args.batch_size, args.resolution, 0, 1, split)
        rates: dict[int, list[float]] = {1: [], cores: []}
        for _ in range(args.epoch_rounds):
            for threads in rates:
                torch.set_num_threads(1)
                loader = DataLoader(ValidationBatches(split, batches, split, crop_ratio=0.875, threads=threads),
                                    batch_size=None)
                start = time.perf_counter()
                seen = sum(images.shape[0] for images, _ in loader)
                rates[threads].append(seen / (time.perf_counter() - start))
        ratio = statistics.median(b / a for a, b in zip(rates[1], rates[cores]))
        print(f"| `ValidationBatches` | {'source' if side == 640 else side} | {statistics.median(rates[1]):,.0f} | "
              f"{statistics.median(rates[cores]):,.0f} | {ratio:.2f} |")


NOT_HERE = object()  # a row not measured in this column


def versus_ffcv(args: argparse.Namespace, tree: Path) -> None:
    """The epoch table: images/s at 1 core and all cores, ratios to ImageFolder and to FFCV."""
    cores = os.cpu_count() or 1
    big = repeated_tree(tree, args.workdir / f"tree-x{args.repeat}", args.repeat)
    streams, stored, betons = {}, {}, {}
    with_ffcv = ffcv_importable()
    sides = stored_sides(args)
    for side in sides:
        streams[side] = args.workdir / f"stream-x{args.repeat}-{side}"
        if not (streams[side] / "dataset.json").is_file():
            convert(big, streams[side], max_side=side, quality=90, verbose=False)
        stored[side] = stored_train(streams[side])
        betons[side] = ffcv_beton(streams[side], args.workdir / f"ffcv-x{args.repeat}-{side}.beton") if with_ffcv else None
    n = len(stored[640][0])
    if args.epoch_rounds < 1:  # the data only (set-up of a later run)
        return
    label = {side: "source" if side == 640 else str(side) for side in sides}
    # each row: (stored side, make(cores) -> a warmed-up epoch timer, or None where skipped)
    rows: dict[str, tuple[str, Any]] = {"ImageFolderDataModule (PIL decode, float out)": ("source", lambda c: datamodule_epochs(
        "imagefolder", big, args, 0 if c == 1 else c))}
    for side in sides:
        rows[f"StreamingDataModule, {label[side]}"] = (label[side], lambda c, side=side: datamodule_epochs(
            "streaming", streams[side], args, 0 if c == 1 else c))
        rows[f"StreamingDataModule, no worker, {cores} decode threads (background thread), {label[side]}"] = (
            label[side], lambda c, side=side: NOT_HERE if c == 1 else datamodule_epochs("streaming", streams[side], args, 0, c))
        rows[f"`train_batch`, bytes in memory, {label[side]}"] = (label[side], lambda c, side=side: train_batch_epochs(
            stored[side], args, c))
        rows[f"`train_batch`, bytes in memory, TorchCodec decode, {label[side]}"] = (
            label[side], lambda c, side=side: train_batch_epochs(stored[side], args, c, torchcodec=True))
        rows[f"FFCV 1.0.2, {label[side]}"] = (label[side], lambda c, side=side: None if betons[side] is None else ffcv_epochs(
            betons[side], args, c))

    def dali(c: int) -> Any:  # builds its pipeline per call, with its own warm-up batches
        probe = lambda: dali_images_per_s(big, args.resolution, args.batch_size, c, n // args.batch_size,  # noqa: E731
                                          "process" if c == 1 else "wall")
        return probe if probe() is not None else None

    rows["DALI CPU, source"] = ("source", dali)
    names = list(rows)
    cols = (1,) if args.per_core_only else (1, cores)
    timers: dict[tuple[str, int], Any] = {}
    results: dict[tuple[str, int], list[float | None]] = {(r, c): [] for r in names for c in cols}
    for rnd in range(args.epoch_rounds):  # interleaved, order rotated: load drift lands on all alike
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for c in cols:
            for r in order:
                # FFCV's loaders set torch's intra-op threads to their own thread count, process-wide,
                # and leave them so: reset to one, or every later torch resize here spreads over (and
                # spin-waits on) that many threads, which about halved `train_batch`'s images per
                # CPU-second measured after an FFCV row of 2 threads
                torch.set_num_threads(1)
                if (r, c) not in timers:  # made (and warmed up by one epoch) on first use
                    timers[(r, c)] = rows[r][1](c)
                    torch.set_num_threads(1)
                timer = timers[(r, c)]
                results[(r, c)].append(None if timer is None else math.nan if timer is NOT_HERE else timer())
                print(f"round {rnd} {r}, {c} core(s): {results[(r, c)][-1]}", flush=True)

    def ratio(r: str, base: str, c: int) -> str:
        vals, refs = results[(r, c)], results[(base, c)]
        if any(v is None or math.isnan(v) for v in vals + refs):
            return ""
        return f"{statistics.median(v / b for v, b in zip(vals, refs)):.2f}"

    print(f"\n{n} images per epoch ({n // args.repeat} files x {args.repeat}), {args.resolution} px, batch "
          f"{args.batch_size}, uint8 out unless noted; one warm-up epoch per pipeline, then medians of "
          f"{args.epoch_rounds} interleaved rounds of one epoch each; 1 core: images per CPU-second of one process (FFCV and `train_batch`: 1 thread); "
          f"{cores} cores: wall clock, {cores} loader workers or threads")
    head = " | 1 core | x ImageFolder | x FFCV |" + ("" if args.per_core_only else f" {cores} cores | x ImageFolder | x FFCV |")
    print(f"\n| pipeline | stored max side{head}")
    print("|---|---|" + "---:|" * 3 * len(cols))
    for r in names:
        side = rows[r][0]
        ffcv = f"FFCV 1.0.2, {side}"
        cells = []
        for c in cols:
            vals = results[(r, c)]
            shown = ("skipped" if any(v is None for v in vals) else "" if any(math.isnan(v) for v in vals)
                     else f"{statistics.median(vals):,.0f}")
            cells += [shown,
                      ratio(r, names[0], c), ratio(r, ffcv, c)]
        print(f"| {r} | {side} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fastscale-input-bench"))
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--train-per-class", type=int, default=64)
    parser.add_argument("--max-sides", type=int, nargs="+", default=[256, 320, 400])
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument("--skip-table", action="store_true", help="only the --autotune / --train-step checks")
    parser.add_argument("--train-step", action="store_true")
    parser.add_argument("--decoders", action="store_true", help="also time JPEG decoders alone (ms per image)")
    parser.add_argument("--step-resolution", type=int, default=128)
    parser.add_argument("--step-batch-size", type=int, default=32)
    parser.add_argument("--step-batches", type=int, default=12)
    parser.add_argument("--step-workers", type=int, default=1)
    parser.add_argument("--step-rounds", type=int, default=2)
    parser.add_argument("--versus-ffcv", action="store_true",
                        help="also the epoch table: 1 core and all cores, ratios to ImageFolder and to FFCV")
    parser.add_argument("--repeat", type=int, default=10, help="--versus-ffcv: times each training file is in an epoch")
    parser.add_argument("--epoch-rounds", type=int, default=3, help="--versus-ffcv: interleaved rounds")
    parser.add_argument("--validation", action="store_true",
                        help="after --versus-ffcv's data is written: validation batches, 1 decode thread and all cores")
    parser.add_argument("--read-cost", action="store_true",
                        help="after --versus-ffcv's data is written: litdata's read cost per sample, window vs one sample")
    parser.add_argument("--per-core-only", action="store_true", help="--versus-ffcv: only the 1-core column")
    parser.add_argument("--kernels", action="store_true",
                        help="also ms per image of each step of the training transform, source and max side 256")
    parser.add_argument("--quick", action="store_true", help="a short run that checks the script works (few images)")
    results_file.add_option(parser, "input_pipeline")
    args = parser.parse_args()
    with results_file.recording(args.results, vars(args)):
        run(args)


def run(args: argparse.Namespace) -> None:
    """The reports the flags ask for, printed."""
    if args.quick:
        args.classes, args.train_per_class, args.repeat, args.rounds, args.epoch_rounds = 2, 24, 2, 1, 1
        args.batches, args.batch_size, args.max_sides = 2, 8, [256]

    tree = args.workdir / "tree"
    if not (tree / "val").is_dir():
        stats = write_tree(tree, args.classes, args.train_per_class, 2)
        (args.workdir / "tree_stats.json").write_text(json.dumps(stats))
    stats = json.loads((args.workdir / "tree_stats.json").read_text())
    print(f"tree: {stats['files']} files, mean {stats['mean_kb']:.0f} KB, mean {stats['mean_pixels'] / 1e3:.0f} kpixel")
    streams = {}
    for side in [*args.max_sides, 640]:
        out = args.workdir / f"stream-{side}"
        if not (out / "dataset.json").is_file():
            convert(tree, out, max_side=side, quality=90, verbose=False)
        streams[side] = out

    cores = os.cpu_count() or 1
    torch.set_num_threads(1)
    if args.skip_table:
        args.rounds = 0
    pipelines: dict[str, Any] = {"ImageFolderDataModule (PIL decode)": lambda w: _measure("imagefolder", tree, args, w)}
    for side in [640, *args.max_sides]:
        label = "StreamingDataModule @ source size" if side == 640 else f"StreamingDataModule, max side {side}"
        pipelines[label] = lambda w, side=side: _measure("streaming", streams[side], args, w)
    pipelines["StreamingDataModule @ source size, uint8 out (normalised on the GPU)"] = (
        lambda w: _measure("streaming", streams[640], args, w, normalize=False))
    pipelines["`decode_jpeg` alone @ source size (ceiling of a full decode)"] = (
        lambda w: decode_only_images_per_s(streams[640], args.batches * args.batch_size) if w == 0 else math.nan)
    dali = "DALI CPU (decode+random crop fused)"
    pipelines[dali] = lambda w: dali_images_per_s(tree, args.resolution, args.batch_size, max(1, w), args.batches,
                                                   "process" if w == 0 else "wall")
    names = list(pipelines)
    results: dict[tuple[str, int], list[float | None]] = {(n, w): [] for n in names for w in (0, cores)}
    for r in range(args.rounds):  # interleaved, order rotated: load drift lands on all alike
        order = names[r % len(names):] + names[: r % len(names)]
        for w in (0, cores):
            for n in order:
                results[(n, w)].append(pipelines[n](w))
                print(f"round {r} {n} workers={w}: {results[(n, w)][-1]}", flush=True)

    def summary(n: str, w: int) -> tuple[str, str]:
        vals, base = results[(n, w)], results[(names[0], w)]
        if any(v is None for v in vals):
            return "skipped", ""
        if any(math.isnan(v) for v in vals):  # not measured in this column
            return "", ""
        paired = statistics.median(v / b for v, b in zip(vals, base))  # per-round ratios
        return f"{statistics.median(vals):.0f}", f"{paired:.2f}"

    if not args.skip_table:
        rate = nvjpeg_images_per_s(streams[640], args.resolution, args.batch_size, args.batches)
        print(f"\n| pipeline ({args.resolution} px train) | images/CPU-s, 1 process 1 thread | x ImageFolder "
              f"| images/s, {cores} workers | x ImageFolder |")
        print("|---|---|---|---|---|")
        for n in names:
            o, oa = summary(n, 0)
            a, aa = summary(n, cores)
            print(f"| {n} | {o} | {oa} | {a} | {aa} |")
        print(f"| nvJPEG batched decode on the GPU @ source size | {'skipped' if rate is None else f'{rate:.0f}'} | | | |")
        print(f"\nmedians of {args.rounds} interleaved rounds; ratios are medians of per-round ratios")

    if args.kernels:
        rows = {side: kernel_ms(stored_train(streams[side]), args.resolution, 48 if args.quick else 200)
                for side in (640, 256) if side in streams}
        print(f"\n| step, 1 thread, {args.resolution} px | ms per image, source | ms per image, max side 256 |\n|---|---:|---:|")
        for name in rows[640]:
            print(f"| {name} | " + " | ".join(f"{rows[side][name]:.3f}" for side in rows) + " |")
        print(f"({48 if args.quick else 200} stored images of each size, best of 5, ms of this process's CPU time)")
    if args.versus_ffcv:
        versus_ffcv(args, tree)
    if args.validation:
        validation_table(args)
    if args.read_cost:
        read_cost_table(args)
    if args.decoders:
        print("\n| decoder, source files, 1 thread | ms per image (best of 5) |\n|---|---|")
        for name, ms in decoder_ms(tree).items():
            print(f"| {name} | {ms:.2f} |")
    if args.autotune:
        res = autotune_check(streams[args.max_sides[-1]], args)
        print(f"\nnum_workers auto: {json.dumps({k: v for k, v in res.items()}, default=str)}")
    if args.train_step:
        res = train_step_check(tree, streams[args.max_sides[-1]], args)
        print(f"\ntrain step: {json.dumps(res)}")


if __name__ == "__main__":
    main()
