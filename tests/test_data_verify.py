"""Damaged streaming data: ``fastscale-data verify`` and training name the chunk file and sample.

The three kinds of damage: a flipped byte in a stored JPEG (libjpeg only warns), a truncated
chunk (litdata would wait for the rest and time out) and an overwritten chunk header offset
(litdata would fail with a bare ``struct.error``). Also: ``convert``'s output and ``--help``.
"""
import contextlib
import io
import shutil
import struct
from pathlib import Path

import pytest
import torch

from lightning_fastscale.data import StreamingDataModule, jpeg_decode
from lightning_fastscale.data.cli import main as fastscale_data
from lightning_fastscale.data.jpeg_decode import strict_decode
from lightning_fastscale.data.stored_format import CorruptDataError
from lightning_fastscale.data.streaming import DecodedStreamingDataset
from lightning_fastscale.data.verify import verify

from .data_streaming_utils import write_tree

SAMPLE = 9  # the damaged sample (litdata index, one chunk per split here): the tree's 6th image, which
# a flipped first entropy-coded byte makes libjpeg warn about (the convert mixes the classes)


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """A tree converted by the command line (24 train, 6 val images), and what it printed."""
    tmp = tmp_path_factory.mktemp("verify")
    write_tree(tmp / "tree")
    out = tmp / "stream"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert fastscale_data(["convert", str(tmp / "tree"), str(out), "--max-side", "64", "--quality", "95",
                               "--workers", "1"]) == 0
    return out, stdout.getvalue() + stderr.getvalue()


def _chunk(root: Path, split: str = "train") -> Path:
    return root / split / "chunk-0-0.bin"


def _offsets(data: bytes) -> tuple[int, ...]:
    count = struct.unpack_from("<I", data, 0)[0]
    return struct.unpack_from(f"<{count + 1}I", data, 4)


def _damaged(stream, tmp_path, kind: str) -> Path:
    root = tmp_path / kind
    shutil.copytree(stream[0], root)
    data = bytearray(_chunk(root).read_bytes())
    if kind == "flip":
        # the first byte of the JPEG's entropy-coded data, after the start-of-scan header
        sos = data.index(b"\xff\xda", _offsets(data)[SAMPLE])
        data[sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")] ^= 0xFF
    elif kind == "truncate":
        data = data[:-500]
    else:  # header: the offset of sample SAMPLE points past the end of the file
        struct.pack_into("<I", data, 4 + 4 * SAMPLE, len(data) + 4096)
    _chunk(root).write_bytes(bytes(data))
    return root


def test_convert_prints_one_labelled_progress_line_per_split_and_help_shows_defaults(stream, capsys):
    _, printed = stream
    assert "convert train" in printed and "convert val" in printed
    for noise in ("lightning.ai", "start_method", "Worker", "inferred the following", "Progress"):
        assert noise not in printed
    with pytest.raises(SystemExit):
        fastscale_data(["convert", "--help"])
    assert "(default: 512)" in capsys.readouterr().out


def test_verify_passes_intact_data(stream, capsys):
    assert fastscale_data(["verify", str(stream[0])]) == 0
    assert "30 samples read and decoded, 0 problem(s)" in capsys.readouterr().out


@pytest.mark.parametrize("kind, problem", [
    ("flip", f"chunk-0-0.bin: sample {SAMPLE}: ValueError: Corrupt JPEG data"),
    ("truncate", "chunk-0-0.bin: 47198 bytes, index.json says 47698: the file is truncated"),
    ("header", f"chunk-0-0.bin: header offset {SAMPLE} (51794) lies outside the items"),
])
def test_verify_names_each_damaged_chunk_and_sample(stream, tmp_path, capsys, kind, problem):
    root = _damaged(stream, tmp_path, kind)
    if kind != "flip":  # the sizes in the message are this tree's
        size = int((stream[0] / "train" / "index.json").read_text().split('"chunk_bytes": ')[1].split(",")[0])
        problem = problem.replace("47698", str(size)).replace("47198", str(size - 500))
        problem = problem.replace("51794", str(size + 4096))
    assert fastscale_data(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"bad: {_chunk(root)}" in out and problem in out, out
    checked, problems = verify(root)
    assert len(problems) == 1 and str(problems[0]).startswith(str(_chunk(root)))
    assert checked == (30 if kind == "flip" else 6)  # a structurally damaged chunk is not read


def test_libjpeg_warning_is_an_error_in_strict_decode_only(stream, tmp_path):
    root = _damaged(stream, tmp_path, "flip")
    data = bytes(_chunk(root).read_bytes())
    start, end = _offsets(data)[SAMPLE : SAMPLE + 2]
    image = data[start:end]
    jpeg = torch.frombuffer(bytearray(image[image.index(b"\xff\xd8"):]), dtype=torch.uint8)
    assert jpeg_decode.decode_rgb(jpeg).shape[0] == 3  # what trained through before: a warning only
    with pytest.raises(ValueError, match="Corrupt JPEG data"):
        strict_decode(jpeg_decode.decode_rgb, jpeg)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_training_on_a_flipped_byte_names_the_chunk_and_sample(stream, tmp_path, num_workers):
    root = _damaged(stream, tmp_path, "flip")
    dm = StreamingDataModule(str(root), resolution=32, batch_size=4, num_workers=num_workers, device_prefetch=False)
    with pytest.raises(CorruptDataError, match=rf"{_chunk(root)}: sample {SAMPLE}: cannot decode .*Corrupt JPEG"):
        for _ in dm.train_dataloader():
            pass


@pytest.mark.parametrize("rect_val", [False, True])
def test_validation_in_threads_gives_the_same_batches_and_names_a_flipped_byte(stream, tmp_path, rect_val):
    """Validation decodes each batch's samples in the decode threads: the batches of 1 and 2
    threads are bitwise equal, and a damaged sample is named by chunk and sample either way."""
    def batches(root, threads):
        dm = StreamingDataModule(str(root), resolution=32, batch_size=4, num_workers=0, decode_threads=threads,
                                 rect_val=rect_val)
        return [(x.clone(), y.tolist()) for x, y in dm.val_dataloader()]

    one, two = batches(stream[0], 1), batches(stream[0], 2)
    assert len(one) == len(two) > 0
    assert all(torch.equal(x1, x2) and y1 == y2 for (x1, y1), (x2, y2) in zip(one, two))
    root = tmp_path / "val-flip"  # a byte of the JPEG's entropy-coded data flipped so that libjpeg warns
    shutil.copytree(stream[0], root)
    data = bytearray(_chunk(root, "val").read_bytes())
    start, end = _offsets(bytes(data))[5:7]  # the validation split is stored in the tree's order
    sos = data.index(b"\xff\xda", start)
    first = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    for pos in range(first, min(first + 64, end - 2)):  # not every flipped byte makes libjpeg warn
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        jpeg = damaged[start:end]
        try:
            strict_decode(jpeg_decode.decode_rgb, torch.frombuffer(jpeg[jpeg.index(b"\xff\xd8"):], dtype=torch.uint8))
        except ValueError:
            break
    else:
        pytest.fail("none of 64 flipped bytes made libjpeg warn")
    _chunk(root, "val").write_bytes(bytes(damaged))
    for threads in (1, 2):
        with pytest.raises(CorruptDataError, match=rf"{_chunk(root, 'val')}: sample 5: cannot decode .*Corrupt JPEG"):
            batches(root, threads)


@pytest.mark.parametrize("kind", ["truncate", "header"])
def test_training_refuses_a_damaged_chunk_before_it_starts(stream, tmp_path, kind):
    root = _damaged(stream, tmp_path, kind)
    with pytest.raises(CorruptDataError, match=rf"{_chunk(root)}: .*Run `fastscale-data verify {root}`"):
        StreamingDataModule(str(root), resolution=32, batch_size=4, num_workers=0)


def test_a_read_error_inside_litdata_names_the_chunk_and_sample(stream, tmp_path):
    """Where the check before training does not run (a remote root read through the cache), a
    damaged header found while reading is named, not a bare ``struct.error``."""
    root = _damaged(stream, tmp_path, "header")
    dataset = DecodedStreamingDataset(str(root / "train"), resolution=32)
    with pytest.raises(CorruptDataError, match=rf"{_chunk(root)}: sample {SAMPLE}: cannot read the stored sample"):
        dataset[SAMPLE]
