"""Runtime dispatch: the one place that turns a call's shape into (backend, config).

Training code calls ``autotune.load("artifacts")`` once; every attention call then asks ``select``
for its shape bucket. The choice is a pure function of the artifact files and the call's shape (no
timing, no tuning at runtime), so every process of a job picks the same config. Choices are cached
per (kind, dtype, head dims, heads, bucket, distribution, source): after the first call a lookup is
one dict access. When nothing fits, dispatch falls back to the nearest tuned bucket, then to the
heuristic default, and warns once per reason saying why.

Configs leave this module as JSON strings (sorted keys) because custom ops take plain ints/strings.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

KINDS = ("hstu_attention_fwd", "hstu_attention_bwd")
SOURCES = ("tuned", "default", "reference")


# --------------------------------------------------------------------------------------------------
# Backend table. Add a backend by adding one entry; modules are imported only when it is chosen, so
# the CuTe DSL (cutlass) is never imported unless an artifact or caller picks "cute".
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """Where a backend's launchers and config classes live ("module:attr"; None = not provided).

    ``requires``: modules that must be installed (checked with find_spec, never imported here);
    ``needs_cuda``: the backend only runs on a CUDA device.
    """

    fwd: str | None
    bwd: str | None
    fwd_config: str | None = None
    bwd_config: str | None = None
    requires: tuple[str, ...] = ()
    needs_cuda: bool = False


BACKENDS: dict[str, Backend] = {
    "triton": Backend(
        fwd="kernel_templates.hstu_attention.triton_fwd:hstu_attention_fwd",
        bwd="kernel_templates.hstu_attention.triton_bwd:hstu_attention_bwd",
        fwd_config="kernel_templates.hstu_attention.config:HSTUFwdConfig",
        bwd_config="kernel_templates.hstu_attention.config:HSTUBwdConfig",
    ),
    # CuTe DSL forward and backward; launcher signatures as the Triton ones (fwd: plus ``sm_count``).
    "cute": Backend(
        fwd="kernel_templates.cute:hstu_attention_cute_fwd",
        bwd="kernel_templates.cute:hstu_attention_cute_bwd",
        fwd_config="kernel_templates.cute:HSTUCuteFwdConfig",
        bwd_config="kernel_templates.cute:HSTUCuteBwdConfig",
        requires=("cutlass",),
        needs_cuda=True,
    ),
    # The PyTorch oracle (handled inside autotune.ops; configs ignored).
    "reference": Backend(fwd=None, bwd=None),
}


def register_backend(name: str, backend: Backend) -> None:
    """Add or replace a backend (e.g. an experimental kernel) and drop cached choices."""
    BACKENDS[name] = backend
    clear_cache()


@functools.cache
def resolve(spec: str) -> Any:
    """Import ``module:attr`` once."""
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)


@functools.lru_cache(maxsize=512)
def decode_config(backend: str, kind: str, config_json: str) -> Any:
    """Config object for a backend from its JSON string (cached: same string, same object)."""
    spec = BACKENDS[backend]
    cls_spec = spec.fwd_config if kind == "hstu_attention_fwd" else spec.bwd_config
    if cls_spec is None:
        return None
    return resolve(cls_spec).from_dict(json.loads(config_json))


def backend_available(name: str, kind: str) -> bool:
    """Whether ``name`` provides ``kind`` here (imports its module: call only when it is chosen)."""
    spec = BACKENDS.get(name)
    if spec is None:
        return False
    if name == "reference":
        return True
    target = spec.fwd if kind == "hstu_attention_fwd" else spec.bwd
    if target is None:
        return False
    if spec.needs_cuda and not torch.cuda.is_available():
        return False
    try:
        if any(importlib.util.find_spec(m) is None for m in spec.requires):
            return False
        resolve(target)
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return False
    return True


# --------------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """What one call runs: backend name, config as JSON, and why (tuned / nearest / default)."""

    backend: str
    config: str
    source: str
    bucket: int | None = None


@dataclass
class _State:
    loaded: bool = False
    path: str | None = None
    gpu: str | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


_STATE = _State()
_CACHE: dict[tuple, Choice] = {}
_WARNED: set[str] = set()
WARNINGS: list[str] = []  # every fallback warning issued in this process, for reports


class DispatchWarning(UserWarning):
    """A dispatch fell back (nearest bucket or heuristic default); the message says why."""


def _warn_once(msg: str) -> None:
    if msg in _WARNED:
        return
    _WARNED.add(msg)
    WARNINGS.append(msg)
    warnings.warn(msg, DispatchWarning, stacklevel=4)


def clear_cache() -> None:
    """Forget cached choices (after loading other artifacts)."""
    _CACHE.clear()


def reset() -> None:
    """Back to the unloaded state: no artifacts, no cached choices, warnings may repeat (tests)."""
    global _STATE
    _STATE = _State()
    _CACHE.clear()
    _WARNED.clear()
    WARNINGS.clear()


def _detect_gpu() -> str:
    from autotune.gpus import detect_gpu

    return detect_gpu()


def load(path: str | os.PathLike = "artifacts", gpu: str | None = None) -> dict[str, Any]:
    """Load the tuned artifacts of ``gpu`` (detected when None) from ``path``/<gpu>/<kernel>.json.

    Never raises for a missing or rejected file: the reason is kept and warned once when a call
    would have used it, and that kernel runs the heuristic default. Returns a summary dict.
    """
    from autotune.artifacts import ArtifactError, load_artifact

    state = _State(loaded=True, path=str(path))
    if gpu is None:
        try:
            gpu = _detect_gpu()
        except Exception as exc:  # noqa: BLE001 - no CUDA / unknown GPU: defaults, with the reason
            for kind in KINDS:
                state.problems[kind] = f"no artifact used for {kind}: could not detect the GPU ({exc})"
    state.gpu = gpu
    if gpu is not None:
        for kind in KINDS:
            file = Path(path) / gpu / f"{kind}.json"
            if not file.is_file():
                state.problems[kind] = f"no artifact for GPU '{gpu}': {file} does not exist"
                continue
            try:
                state.artifacts[kind] = load_artifact(file)
            except ArtifactError as exc:
                state.problems[kind] = f"artifact {file} rejected (stale template hash or invalid): {exc}"
    global _STATE
    _STATE = state
    _CACHE.clear()
    return summary()


def summary() -> dict[str, Any]:
    """What is loaded: GPU, kernels with artifacts, problems, warnings so far."""
    return {
        "loaded": _STATE.loaded,
        "path": _STATE.path,
        "gpu": _STATE.gpu,
        "kernels": sorted(_STATE.artifacts),
        "problems": dict(_STATE.problems),
        "warnings": list(WARNINGS),
    }


# --------------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _bucket_for(max_seq_len: int) -> int:
    from autotune.buckets import bucket_for

    return bucket_for(max_seq_len)


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _get(entry: Any, name: str, default: Any = None) -> Any:
    if isinstance(entry, dict):
        return entry.get(name, default)
    return getattr(entry, name, default)


def _entries(artifact: Any) -> list[Any]:
    if isinstance(artifact, dict):
        return list(artifact.get("entries", []))
    return list(getattr(artifact, "entries", []))


def _config_json(config: Any) -> str:
    d = config if isinstance(config, dict) else config.to_dict()
    return json.dumps(d, sort_keys=True)


def default_choice(kind: str, dqk: int, dv: int) -> Choice:
    """The heuristic default (Triton) for these head dims."""
    from kernel_templates.hstu_attention.config import default_bwd_config, default_fwd_config

    fn = default_fwd_config if kind == "hstu_attention_fwd" else default_bwd_config
    return Choice("triton", _config_json(fn(dqk, dv, _interpreting())), "default")


def _entry_choice(kind: str, entry: Any, source: str) -> Choice | None:
    backend = _get(entry, "backend", "triton")
    if not backend_available(backend, kind):
        _warn_once(f"{kind}: tuned backend '{backend}' is not available in this process; using the default")
        return None
    return Choice(backend, _config_json(_get(entry, "config")), source, _get(entry, "bucket"))


def _nearest(entries: list[Any], bucket: int, distribution: str | None, num_heads: int) -> Any:
    """Deterministic nearest entry: closest log2 bucket, then same distribution, causal mask, same
    heads, the larger bucket, and finally the config's text (a total order: no ties left)."""

    def rank(e: Any) -> tuple:
        b = int(_get(e, "bucket"))
        return (
            abs(math.log2(b) - math.log2(bucket)),
            0 if distribution is None or _get(e, "distribution") == distribution else 1,
            0 if _get(e, "mask", "causal") == "causal" else 1,
            0 if _get(e, "num_heads") == num_heads else 1,
            -b,
            json.dumps(_get(e, "config"), sort_keys=True),
        )

    return min(entries, key=rank)


def _resolve(
    kind: str, dtype: str, dqk: int, dv: int, num_heads: int, max_seq_len: int, distribution: str | None, source: str
) -> Choice:
    if source == "reference":
        return Choice("reference", "{}", "reference")
    if source == "default" or not _STATE.loaded:
        return default_choice(kind, dqk, dv)
    if kind in _STATE.problems:
        _warn_once(f"{_STATE.problems[kind]}; using the heuristic default config")
        return default_choice(kind, dqk, dv)
    artifact = _STATE.artifacts[kind]
    bucket = _bucket_for(max_seq_len)
    entry = artifact.lookup(dtype, dqk, dv, bucket, distribution) if hasattr(artifact, "lookup") else None
    if entry is not None:
        choice = _entry_choice(kind, entry, "tuned")
        return choice or default_choice(kind, dqk, dv)
    same_dims = [
        e
        for e in _entries(artifact)
        if _get(e, "dtype") == dtype and int(_get(e, "dqk")) == dqk and int(_get(e, "dv")) == dv
    ]
    if not same_dims:
        _warn_once(
            f"{kind}: no tuned entry for dtype={dtype}, head dims dqk={dqk} dv={dv} (unseen head dim) in the "
            f"'{_STATE.gpu}' artifact; using the heuristic default config"
        )
        return default_choice(kind, dqk, dv)
    best = _nearest(same_dims, bucket, distribution, num_heads)
    if entry is None:
        _warn_once(
            f"{kind}: no tuned entry for bucket {bucket} (dtype={dtype}, dqk={dqk}, dv={dv}, "
            f"distribution={distribution}); using the nearest tuned bucket {_get(best, 'bucket')}"
        )
    choice = _entry_choice(kind, best, "nearest" if entry is None else "tuned")
    return choice or default_choice(kind, dqk, dv)


def select(
    kind: str,
    dtype: torch.dtype | str,
    dqk: int,
    dv: int,
    num_heads: int,
    max_seq_len: int,
    distribution: str | None = None,
    source: str = "tuned",
) -> Choice:
    """The (backend, config) for one call; cached, deterministic, never times anything.

    ``source``: "tuned" (loaded artifacts, with fallbacks), "default" (heuristic), "reference".
    ``distribution``: "uniform" (full lengths) or "jagged" when the caller knows it, else None.
    """
    key = (kind, dtype, dqk, dv, num_heads, max_seq_len, distribution, source)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    if source not in SOURCES:
        raise ValueError(f"unknown kernel source {source!r}; expected one of {SOURCES}")
    dims = (int(dqk), int(dv), int(num_heads), int(max_seq_len))
    choice = _resolve(kind, _dtype_name(dtype), *dims, distribution, source)
    _CACHE[key] = choice
    return choice
