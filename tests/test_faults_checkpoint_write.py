"""A checkpoint write cut short (the process killed, the disk full) leaves no partial file under
a checkpoint's name and no temporary file in ``TMPDIR``, and ``resume=auto`` continues from the
newest complete checkpoint.

The run folder is on its own small tmpfs and ``TMPDIR`` on the disk the tests run on, the
usual cluster layout (run folder on another filesystem than ``TMPDIR``) under which Lightning's
own writer copies a temporary file across filesystems.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.fault_helpers import finish, start
from lightning_fastscale.faults import checkpoint_reading
from lightning_fastscale.faults.atomic_checkpoint_io import partial_files, save_atomically

# 1 rank, 64 samples / 16: 4 steps per epoch; checkpoints at the end of epochs 0 and 1 (about 94 kB each)
RUN = [
    "data.train_size=64", "data.val_size=16", "data.batch_size=16", "data.resolution=16",
    "model.model_kwargs.widths=[8,8,8]", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1", "trainer.accelerator=cpu", "logger=csv",
]


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs mounted for this test (root only), always unmounted."""
    mount = tmp_path / "fs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=False,
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}); needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def assert_no_partial_checkpoint(folder: Path, tmpdir: Path) -> None:
    for path in folder.glob("*.ckpt"):
        checkpoint_reading.read_checkpoint(path)  # raises, naming the file, on a truncated one
    leaked = [p for p in tmpdir.rglob("*") if p.is_file() and p.stat().st_size > 10_000]
    assert not leaked, f"checkpoint-sized temporary files in TMPDIR: {leaked}"


def test_disk_full_during_a_write_keeps_the_previous_file(small_fs):
    """In one process: the write that runs out of space fails, and the old file is whole."""
    target = small_fs / "last.ckpt"
    save_atomically({"step": 1, "w": torch.zeros(1000)}, target)
    with pytest.raises(OSError, match="No space left"):
        save_atomically({"step": 2, "w": torch.zeros(2_000_000)}, target)  # 8 MB on a 4 MiB disk
    assert torch.load(target)["step"] == 1
    assert not partial_files([small_fs]) and sorted(p.name for p in small_fs.iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_rank_killed_while_writing_a_checkpoint_then_resume_auto(small_fs, tmp_path):
    run_dir, tmpdir = small_fs / "run", tmp_path / "tmpdir"
    tmpdir.mkdir()
    kill = ["+callbacks.kill._target_=benchmarks.fault_helpers.KillDuringSave", "+callbacks.kill.step=8"]
    code, out = finish(start(run_dir, *kill, run=RUN, env={"TMPDIR": str(tmpdir)}))
    assert code == -25, out[-3000:]  # SIGXFSZ: killed mid-write, at the end of epoch 1
    folder = run_dir / "checkpoints"
    assert_no_partial_checkpoint(folder, tmpdir)
    leftovers = partial_files([folder])
    assert len(leftovers) == 1 and 0 < leftovers[0].stat().st_size <= 20_000  # the cut-short write, beside its target
    assert checkpoint_reading.read_checkpoint(folder / "last.ckpt")["global_step"] == 4  # epoch 0's, whole

    code, out = finish(start(run_dir, "resume=auto", run=RUN, env={"TMPDIR": str(tmpdir)}))
    assert code == 0, out[-3000:]
    assert f"removing {leftovers[0]}" in out and "continuing from" in out
    assert "taking over the lock of pid" in out  # the killed run never released its run folder
    assert checkpoint_reading.read_checkpoint(folder / "last.ckpt")["global_step"] == 8
    assert not partial_files([folder])
    assert_no_partial_checkpoint(folder, tmpdir)


@pytest.mark.slow  # two end-to-end runs; the in-process disk-full test above stays in the default run
def test_disk_full_while_writing_a_checkpoint_then_resume_auto(small_fs, tmp_path):
    run_dir, tmpdir, filler = small_fs / "run", tmp_path / "tmpdir", small_fs / "filler"
    tmpdir.mkdir()
    fill = ["+callbacks.fill._target_=benchmarks.fault_helpers.FillDiskAtStep", "+callbacks.fill.step=8",
            f"+callbacks.fill.path={filler}"]
    code, out = finish(start(run_dir, *fill, run=RUN, env={"TMPDIR": str(tmpdir)}))
    assert code != 0 and "No space left on device" in out, out[-3000:]
    folder = run_dir / "checkpoints"
    assert_no_partial_checkpoint(folder, tmpdir)
    assert not partial_files([folder])  # the failed write removed its temporary file
    assert checkpoint_reading.read_checkpoint(folder / "last.ckpt")["global_step"] == 4

    filler.unlink()  # space freed, as an operator would; the requeued job continues
    code, out = finish(start(run_dir, "resume=auto", run=RUN, env={"TMPDIR": str(tmpdir)}))
    assert code == 0, out[-3000:]
    assert "continuing from" in out
    assert checkpoint_reading.read_checkpoint(folder / "last.ckpt")["global_step"] == 8
    assert_no_partial_checkpoint(folder, tmpdir)
