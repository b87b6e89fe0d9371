"""Test-wide settings: no network for W&B, quiet Hydra errors in full, one thread per process."""
import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
