"""Result rows of the benchmarks: one timing helper and one writer, so every table is the same data.

Each row carries the GPU, library versions and git sha with the shape and p20/p50/p80 ms; rows are
appended as JSON lines to ``benchmarks/results/<name>.jsonl`` (and to ``$OUT/<name>.jsonl`` when set).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


@cache
def environment() -> dict[str, Any]:
    """GPU, versions and the checkout's git sha (what every row is keyed by)."""
    env: dict[str, Any] = {"torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = "cpu"
    env["git_sha"] = os.environ.get("GIT_SHA") or git_sha(Path(__file__).resolve().parents[1])
    return env


def git_sha(root: Path) -> str | None:
    """HEAD's short sha, with "+dirty" when tracked files differ from it: a snapshot copied onto a GPU host
    over an older .git must not pass for that commit (set ``GIT_SHA`` there to name the real one)."""
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()  # fmt: skip
        if not sha:
            return None
        cmd = ["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"]
        diff = subprocess.run(cmd, capture_output=True, timeout=30)
        return sha + ("+dirty" if diff.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return None


def time_ms(fn: Callable[[], Any], rep_ms: float = 300.0, min_samples: int = 20) -> dict[str, float]:
    """p20 / p50 / p80 ms of ``fn`` on the GPU (``do_bench``: warm-up, L2 flush before every sample),
    over at least ``min_samples`` samples."""
    if not torch.cuda.is_available():
        import time

        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    else:
        import triton.testing

        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        rep = max(rep_ms, 1.3 * min_samples * start.elapsed_time(end))
        times = [float(t) for t in triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="all")]
    from autotune.tuning.measure import quantile

    return {"p20_ms": quantile(times, 0.2), "p50_ms": quantile(times, 0.5), "p80_ms": quantile(times, 0.8),
            "samples": len(times)}  # fmt: skip


def append_rows(name: str, rows: list[dict[str, Any]]) -> list[Path]:
    """Append ``rows`` (each merged with ``environment()``) to ``<name>.jsonl`` here and under $OUT.

    Every row is made a JSON line before any file is opened, and each file takes them in one write: a row that
    cannot be written (a value JSON has no type for) appended none of them, not the rows before it to one file
    only. NumPy and 0-d tensor scalars are written as numbers, a NaN or infinite one as null (standard JSON)."""
    env = environment()
    lines = []
    for i, row in enumerate(rows):
        try:
            lines.append(json.dumps(_plain({**env, **row}), sort_keys=True, allow_nan=False) + "\n")
        except (TypeError, ValueError) as e:
            raise TypeError(f"append_rows({name!r}): row {i} cannot be written as JSON ({e})") from None
    paths = [RESULTS / f"{name}.jsonl"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / f"{name}.jsonl")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("".join(lines))
    return paths


def _plain(value: Any) -> Any:
    """``value`` with NumPy / 0-d tensor scalars as Python numbers and non-finite floats as None, in dicts and
    lists too (``json`` wrote NaN, which no strict JSON reader takes, and refused a ``numpy.float32``)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if not isinstance(value, (str, int, float)) and callable(getattr(value, "item", None)):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):  # an array of several values: json names its type
            return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
