"""Diagnostics: where a training step's time goes, and ``fastscale-doctor``, which names the bottleneck."""
