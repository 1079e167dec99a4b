"""Environment for the subprocesses tests start: the repo ahead of the caller's PYTHONPATH, never instead of it
(a GPU host finds optuna and the CuTe DSL through PYTHONPATH)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(*drop: str, **extra: str) -> dict[str, str]:
    """``os.environ`` with the repo first on PYTHONPATH, without the variables in ``drop``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env
