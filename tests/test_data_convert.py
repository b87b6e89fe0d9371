"""``fastscale-data convert``: round trip, refusal to overwrite, bad source trees."""
import json
import subprocess
import sys

import pytest
import torch
from litdata import StreamingDataset
from torchvision.datasets import ImageFolder

from lightning_fastscale.data.cli import main
from lightning_fastscale.data.jpeg_decode import decode_rgb, jpeg_size
from lightning_fastscale.data.stored_format import read_metadata

from .data_streaming_utils import CLASSES, convert_tree, write_tree


def _stored(split_dir):
    ds = StreamingDataset(str(split_dir))
    return [ds[i] for i in range(len(ds))]


def test_round_trip_labels_class_order_counts_and_max_side(tmp_path):
    out = convert_tree(tmp_path, max_side=64)
    meta = read_metadata(out)
    assert meta.classes == list(CLASSES) == ImageFolder(str(tmp_path / "tree" / "train")).classes
    assert meta.counts == {"train": [8, 8, 8], "val": [2, 2, 2]} and meta.max_side == 64

    for split in ("train", "val"):
        reference = ImageFolder(str(tmp_path / "tree" / split))
        expected = {f"{reference.classes[t]}/{p.rsplit('/', 1)[1]}": t for p, t in reference.samples}
        samples = _stored(out / split)
        assert len(samples) == len(reference)
        assert {s["name"]: s["label"] for s in samples} == expected  # every file once, ImageFolder's label
        assert sorted(s["index"] for s in samples) == list(range(len(reference)))
        for s in samples:
            image = decode_rgb(torch.frombuffer(bytearray(s["image"]), dtype=torch.uint8))
            assert tuple(image.shape[1:]) == jpeg_size(s["image"])
            assert max(image.shape[1:]) <= 64
            if s["name"].endswith("_0.JPEG"):  # the 120 px wide source: scaled down to the max side
                assert image.shape[2] == 64 and image.shape[1] == round(40 * 64 / 120)


def test_training_split_is_written_with_the_classes_mixed(tmp_path):
    # litdata reads a chunk at a time: written class by class, every batch would hold one class
    labels = [s["label"] for s in _stored(convert_tree(tmp_path) / "train")]
    assert labels != sorted(labels)
    assert len(set(labels[:8])) > 1  # one class's worth of samples spans several classes


def test_cli_converts_procedural_set_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "shapes"
    args = ["convert", "procedural", str(out), "--train-size", "24", "--val-size", "8",
            "--num-classes", "4", "--resolution", "32", "--max-side", "32", "--workers", "1"]
    assert main(args) == 0
    meta = read_metadata(out)
    assert meta.classes == ["disk", "ring", "square", "frame"] and meta.split_size("train") == 24
    assert [s["label"] for s in sorted(_stored(out / "val"), key=lambda s: s["index"])] == [0, 1, 2, 3] * 2

    before = (out / "dataset.json").read_bytes()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "refusing to overwrite" in err
    assert (out / "dataset.json").read_bytes() == before


def test_console_script_module_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightning_fastscale.data.cli", "convert", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--max-side" in proc.stdout


def test_empty_class_folder_is_named(tmp_path):
    write_tree(tmp_path / "tree")
    (tmp_path / "tree" / "train" / "n04").mkdir()
    assert main(["convert", str(tmp_path / "tree"), str(tmp_path / "out"), "--workers", "1"]) == 2
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="n04"):
        from lightning_fastscale.data.convert import convert

        convert(tmp_path / "tree", tmp_path / "out")


def test_corrupt_source_jpeg_is_named_and_nothing_half_written_is_left(tmp_path):
    write_tree(tmp_path / "tree", train_per_class=2, val_per_class=1)
    (tmp_path / "tree" / "train" / "n02" / "broken.JPEG").write_bytes(b"\xff\xd8 not really a jpeg")
    from lightning_fastscale.data.convert import convert

    with pytest.raises(Exception, match="broken.JPEG"):
        convert(tmp_path / "tree", tmp_path / "out", num_workers=1, verbose=False)
    assert not (tmp_path / "out").exists()


def test_metadata_with_an_empty_training_class_is_refused(tmp_path):
    out = convert_tree(tmp_path)
    meta_file = out / "dataset.json"
    raw = json.loads(meta_file.read_text())
    raw["classes"].append("n99")
    raw["counts"]["train"].append(0)
    meta_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'n99' has no training samples"):
        read_metadata(out)
