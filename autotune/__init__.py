"""hstu-autotune: the tuner (``autotune run|show|bench``) and the runtime dispatch of tuned configs.

Kept light on purpose: importing ``autotune`` must not import torch, triton or optuna. The tuner
lives in ``autotune.tuning.tuner`` / ``autotune.tuning.cli``; artifacts (stdlib only) in ``autotune.runtime.artifacts``;
the GPU registry in ``autotune.runtime.gpus``; buckets in ``autotune.runtime.buckets``.
"""

from __future__ import annotations

# The one home of the project version: pyproject.toml reads it (dynamic), and a source checkout on
# PYTHONPATH, which has no installed metadata, still knows it.
__version__ = "0.1.0"

__all__: list[str] = []

# --- runtime dispatch (owner: autotune/runtime/dispatch.py) ---------------------------------------------
# The dispatch engineer adds ``load()`` here, e.g. ``from autotune.runtime.dispatch import load``.


def load(path: str | None = None, gpu: str | None = None, allow_same_arch: bool = False) -> dict:
    """Load tuned artifacts for ``gpu`` (detected when None) so every HSTU op call dispatches to them.

    One line in training code: ``autotune.load()`` (the artifacts shipped with the package) or
    ``autotune.load(DIR)`` (a folder or an ``autotune export`` bundle). Lazy, so ``import autotune`` stays light.
    Files tuned on another GPU are rejected (warned, defaults used); ``allow_same_arch=True`` accepts
    one of the same compute capability (H100 configs on an H200), said once. Never raises.
    """
    from autotune.runtime.dispatch import load as _load

    return _load(path, gpu, allow_same_arch)


__all__.append("load")
