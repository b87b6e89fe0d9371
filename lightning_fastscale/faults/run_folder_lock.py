"""Claim a run folder for one run at a time. More in ``docs/faults.md`` ("The run-folder lock")."""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

log = logging.getLogger(__name__)

LOCK_NAME = ".fastscale-run.lock"


class RunFolderInUseError(RuntimeError):
    """The run folder is claimed by another live run."""


def global_rank_from_env(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as torchrun, srun, LSF or Lightning's launcher set it (0 when nothing says otherwise)."""
    env = os.environ if environ is None else environ
    for key in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if env.get(key, "").strip():
            return int(env[key])
    node = int(env.get("NODE_RANK") or env.get("GROUP_RANK") or 0)
    local = int(env.get("LOCAL_RANK") or 0)
    return node * 1_000_000 + local  # any non-zero value: not rank 0


def _holder(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: Mapping[str, Any]) -> str:
    if not holder:
        return "a run whose lock file holds no details"
    text = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    if holder.get("started"):
        text += f", started {holder['started']}"
    if holder.get("slurm_job_id"):
        text += f", SLURM job {holder['slurm_job_id']}"
    return text


class Claim:
    """A held claim on a run folder; `release` (also run at exit) gives it up."""

    def __init__(self, folder: Path, fd: int | None) -> None:
        self.folder = folder
        self.path = folder / LOCK_NAME
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            if _holder(self.path).get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def claim(folder: str | os.PathLike) -> Claim:
    """Claim ``folder`` for this process, or raise `RunFolderInUseError` naming the holder.

    Examples:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> held = claim(folder)
        >>> claim(folder)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_fastscale.faults.run_folder_lock.RunFolderInUseError: run folder ... is in use by pid ...
        >>> held.release()
    """
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    for _ in range(10):  # the file may be replaced between open and lock by a releasing run
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # released meanwhile: try to create it
            created = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunFolderInUseError(
                    f"run folder {folder} is in use by {_describe(_holder(path))} (lock file {path}); "
                    "wait for that run to end, or give this run its own hydra.run.dir"
                ) from None
            if err.errno != errno.ENOLCK:
                raise
            if not created:  # no flock on this filesystem: the file alone decides
                raise RunFolderInUseError(
                    f"run folder {folder} has a lock file of {_describe(_holder(path))} ({path}) and this "
                    "filesystem cannot tell whether that run is alive; delete the file if it is not"
                ) from None
            fd = os.open(path, os.O_RDWR)
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # locked a file that its holder removed meanwhile: start over
            os.close(fd)
            continue
        previous = _holder(path)
        if not created and previous.get("pid") != os.getpid():
            log.warning(
                "run folder %s: taking over the lock of %s, which ended without releasing it", folder, _describe(previous)
            )
        os.ftruncate(fd, 0)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        held = Claim(folder, fd)
        atexit.register(held.release)
        return held
    raise RunFolderInUseError(f"run folder {folder}: could not claim {path}; another run keeps replacing it")


class ClaimRunFolder(Callback):
    """Hydra callback: claim ``hydra.run.dir`` before Hydra writes anything into it.

    Registered in ``train.yaml``; rank 0 of a single run (not ``-m``) claims it, a refused run exits with status 1.
    """

    def __init__(self) -> None:
        self.claim: Claim | None = None

    @override
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if global_rank_from_env() != 0:
            return
        folder = OmegaConf.select(config, "hydra.run.dir")
        if not folder:
            return
        try:
            self.claim = claim(folder)
        except RunFolderInUseError as err:
            # Hydra would print a traceback for an exception raised here: a user error gets one line
            print(f"fastscale-train: {err}", flush=True)
            raise SystemExit(1) from None

    @override
    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.claim is not None:
            self.claim.release()
            self.claim = None
