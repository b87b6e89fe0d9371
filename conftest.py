"""Test-wide settings: no network for W&B, quiet Hydra errors in full, one thread per process."""
import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
# Several ranks share two cores: one intra-op thread each avoids oversubscription spin.
os.environ.setdefault("OMP_NUM_THREADS", "1")
