"""hstu-autotune: the tuner (``autotune run|show|bench``) and the runtime dispatch of tuned configs.

Kept light on purpose: importing ``autotune`` must not import torch, triton or optuna. The tuner
lives in ``autotune.tuner`` / ``autotune.cli``; artifacts (stdlib only) in ``autotune.artifacts``;
the GPU registry in ``autotune.gpus``; buckets in ``autotune.buckets``.
"""

from __future__ import annotations

__all__: list[str] = []

# --- runtime dispatch (owner: autotune/dispatch.py) ---------------------------------------------
# The dispatch engineer adds ``load()`` here, e.g. ``from autotune.dispatch import load``.
