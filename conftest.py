"""Test-wide settings: no network for W&B, quiet Hydra errors in full, one thread per process,
and an environment restored after every test."""
import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
# Several ranks share two cores: one intra-op thread each avoids oversubscription spin.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


@pytest.fixture(autouse=True)
def _restore_environment():
    """Give every test the environment it started with.

    An in-process Trainer or Fabric with a DDP strategy writes ``MASTER_PORT`` (and the rank
    variables) into ``os.environ`` through Lightning's cluster environment. Left there, every
    later launch inherits that one port: two jobs started side by side collide on it, and a
    launch can join a stale process that still listens there.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
