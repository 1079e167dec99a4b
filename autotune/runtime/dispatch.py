"""Runtime dispatch: the one place that turns a call's shape into (backend, config).

Training code calls ``autotune.load("artifacts")`` once; every attention call then asks ``select``
for its shape bucket. The choice is a pure function of the artifact files and the call's shape (no
timing, no tuning at runtime), so every process of a job picks the same config. Choices are cached
per (kind, dtype, head dims, heads, length bucket, distribution, source, mask, fill bin): after the first
call a lookup is one dict access. Entries are keyed by (dtype, dims, heads, bucket, distribution,
mask); when the exact one is missing, dispatch uses the closest entry (same bucket first, then the
nearest tuned bucket), then the heuristic default, and warns once per reason saying what differs.
A bf16 or fp16 call with no entry of its own dtype for its head dims is served by the other 16-bit
dtype's entries that the full re-check ran in the call's dtype (same tiles, same tensor-core rate).

Without a distribution hint, a call is matched to its bucket's entries by what the host knows
without a sync: the fill ratio L / (B x max_seq_len) of the batch against the fill of the batch
each entry was tuned on (``entry_fill``), nearest in log scale. A call no entry is within a factor
``FILL_TOLERANCE`` of runs the entry tuned on the lowest fill when the call is more skewed than every
tuned batch (those entries launch only real tiles, heaviest first, which is what skewed batches need),
else the uniform entry (the one tuned on the most work). A call that falls back to a nearest entry (other
heads, mask or bucket) is matched by fill the same way among that entry's distributions.

Which files are usable is decided by ``autotune.runtime.artifacts.assess_artifact`` (the verdict that
``autotune show`` prints too): stale, invalid or foreign files (another GPU, another architecture)
are rejected; a same-architecture GPU only with ``allow_same_arch=True``; version drift is a warning.

Configs leave this module as JSON strings (sorted keys) because custom ops take plain ints/strings.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autotune import spec
from autotune.runtime.buckets import BUCKETS, DISTRIBUTIONS, bucket_for
from autotune.runtime.defaults import fit_spec_default, spec_defaults
from autotune.runtime.gpus import interpreting as _interpreting
from kernel_templates.hstu_attention.input_check import GRID_YZ_MAX

SOURCES = ("tuned", "default", "reference")
MASKS = ("causal", "targets", "context", "context+targets", "window")  # == autotune.tuning.tasks.MASKS
LARGEST_BUCKET = BUCKETS[-1]  # longer calls run this bucket's config
FILL_TOLERANCE = 2.0  # a call's fill within this factor of an entry's may take that entry
FILL_STEPS = 4  # fill bins per halving (the choice cache key): 2**(-1/4) apart


# --------------------------------------------------------------------------------------------------
# Backends: read from the op specs (autotune.spec). Modules are imported only when a backend is
# chosen, so the CuTe DSL (cutlass) is never imported unless an artifact or caller picks "cute".
# --------------------------------------------------------------------------------------------------
def kinds() -> list[str]:
    """Every kernel an op spec declares (the artifact file names)."""
    return spec.kernels()


def launcher(backend: str, kind: str) -> Any:
    """The runtime launcher of ``backend`` for ``kind`` (imported once)."""
    target = spec.kernel(kind).backend(backend).launcher
    if target is None:
        raise ValueError(f"{kind}: backend {backend!r} has no runtime launcher")
    return spec.resolve(target)


@functools.lru_cache(maxsize=64)
def index_dtype(backend: str, kind: str) -> torch.dtype | None:
    """The dtype ``backend`` reads offsets and targets in (None: whatever it is given)."""
    if backend == "reference":
        return None
    name = spec.kernel(kind).backend(backend).index_dtype
    return None if name is None else getattr(torch, name)


@functools.lru_cache(maxsize=512)
def decode_config(backend: str, kind: str, config_json: str) -> Any:
    """Config object for a backend from its JSON string (cached: same string, same object). The string may come
    from outside an artifact (a direct ``torch.ops.hstu`` call), so it is held to the field types an artifact's
    config is: a ``ValueError`` naming ``config`` rather than a float tile reaching the launcher."""
    from kernel_templates.config_types import config_type_error

    if backend == "reference":
        return None
    cls_spec = spec.kernel(kind).backend(backend).config
    if cls_spec is None:
        return None
    cls = spec.resolve(cls_spec)
    try:
        values = json.loads(config_json)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config of {kind} ({backend}) must be a JSON object, got {config_json!r:.80}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(
            f"config of {kind} ({backend}) must be a JSON object of {cls.__name__}, got {config_json!r:.80}"
        )
    problem = config_type_error(cls, values)
    if problem:
        raise ValueError(f"config.{problem} ({kind}, backend {backend!r})")
    return cls.from_dict(values)


_RUNNERS: dict[tuple[str, str, str], tuple] = {}


def runner(backend: str, kind: str, config_json: str) -> tuple[Any, Any, torch.dtype | None]:
    """(launcher, decoded config, index dtype) of one dispatched choice: what a call needs, in one dict
    lookup (the per-call spec walk and three cache lookups it replaces cost several us on a short call).
    Dropped with the other cached choices (``clear_cache``), and resolved again whenever ``launcher``,
    ``decode_config`` or ``index_dtype`` is replaced (a plugin or a test patching one takes effect at once)."""
    resolvers = (launcher, decode_config, index_dtype)
    key = (backend, kind, config_json)
    hit = _RUNNERS.get(key)
    if hit is None or hit[0] != resolvers:
        config = decode_config(backend, kind, config_json)
        hit = _RUNNERS[key] = (resolvers, launcher(backend, kind), config, index_dtype(backend, kind))
    return hit[1:]


@functools.cache
def backend_available(name: str, kind: str) -> bool:
    """Whether ``name`` provides ``kind`` here (imports its launcher: call only when it is chosen)."""
    if name == "reference":
        return True
    try:
        b = spec.kernel(kind).backend(name)
    except ValueError:
        return False
    if b.launcher is None or spec.unavailable_reason(b) is not None:
        return False
    try:
        spec.resolve(b.launcher)
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
    missing: dict[str, str] = field(default_factory=dict)  # kernels without a file: defaults, said when called
    notes: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


_STATE = _State()
_CACHE: dict[tuple, Choice] = {}
# Held while the state is replaced and the choices dropped, and while a choice is cached: a choice resolved
# from a state that a ``load`` in another thread replaced meanwhile is returned to its call but never cached.
_STATE_LOCK = threading.Lock()
_WARNED: set[str] = set()
WARNINGS: list[str] = []  # every fallback warning issued in this process, for reports


class DispatchWarning(UserWarning):
    """A dispatch fell back (nearest bucket or heuristic default); the message says why."""


# A warning names the first frame outside these folders: this package, its kernels, and torch (autograd and
# custom ops call the kernels' launchers on the user's behalf).
_OWN_DIRS = tuple(
    str(d) + os.sep
    for d in (
        Path(__file__).resolve().parents[1],
        Path(__file__).resolve().parents[2] / "kernel_templates",
        Path(torch.__file__).resolve().parent,
    )
)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package (the user's call, the model's layer), so a
    warning points at the line that asked for the kernel, not at dispatch's internals (a fixed level named
    ``value = build(state)`` or whichever helper the choice went through)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.realpath(frame.f_code.co_filename).startswith(_OWN_DIRS):
        frame, level = frame.f_back, level + 1
    return level  # the outermost frame when every one is the package's (its own CLI)


def _warn_once(msg: str, key: str | None = None) -> None:
    """Warn ``msg`` unless ``key`` (default: the message) was warned already in this process."""
    key = msg if key is None else key
    if key in _WARNED:
        return
    _WARNED.add(key)
    WARNINGS.append(msg)
    warnings.warn(msg, DispatchWarning, stacklevel=_caller_stacklevel())


_CLEAR_HOOKS: list = []  # caches built on choices (the fused layer's plans)


def on_clear(fn) -> None:
    """Call ``fn`` whenever cached choices are dropped."""
    _CLEAR_HOOKS.append(fn)


def cached_choices() -> dict[tuple, Choice]:
    """A copy of the choices made since the last ``clear_cache``, for reports; keys are (kind, dtype,
    dqk, dv, heads, length key (``length_key``), distribution, source, mask, fill bin) as ``select`` builds them."""
    return dict(_CACHE)


def clear_cache() -> None:
    """Forget cached choices (after loading other artifacts, or when the op specs change)."""
    _CACHE.clear()
    _RUNNERS.clear()
    decode_config.cache_clear()
    backend_available.cache_clear()
    grid_rows.cache_clear()
    for fn in _CLEAR_HOOKS:
        fn()


spec.on_change(clear_cache)


def reset() -> None:
    """Back to the unloaded state: no artifacts, no cached choices, warnings may repeat (tests)."""
    global _STATE
    with _STATE_LOCK:
        _STATE = _State()
        clear_cache()
    _WARNED.clear()
    WARNINGS.clear()


def _detect_gpu() -> str:
    from autotune.runtime.gpus import detect_gpu

    return detect_gpu()


def _same_arch_file(root: Path, gpu: str, kind: str) -> Path | None:
    """The artifact of ``kind`` of another GPU with ``gpu``'s compute capability (first by name), if any."""
    from autotune.runtime.gpus import same_arch_gpus

    for other in same_arch_gpus(gpu):
        file = root / other / f"{kind}.json"
        if file.is_file():
            return file
    return None


def load(
    path: str | os.PathLike | None = None, gpu: str | None = None, allow_same_arch: bool = False
) -> dict[str, Any]:
    """Load the tuned artifacts of ``gpu`` (detected when None) from ``path``/<gpu>/<kernel>.json
    (``path`` None: the artifacts shipped with the installed package, the repository's in a checkout).

    Each file must pass ``autotune.runtime.artifacts.assess_artifact`` against the running environment: a
    file tuned on another GPU (by its ``gpu``, its device name or the folder it was copied to) is
    rejected. ``allow_same_arch=True`` accepts a GPU of the same compute capability (H100 configs on
    an H200; also looked up in that GPU's folder when ``gpu`` has none) and says so once. Other
    library versions are said once and the file is used.

    Never raises for a missing or rejected file, whatever it holds: the reason is kept and warned once
    when a call would have used it, and that kernel runs the heuristic default. Returns ``summary()``.
    """
    from autotune.runtime import gpus
    from autotune.runtime.artifacts import assess_artifact, is_gpu_key

    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a folder path (str or os.PathLike) or None, got {type(path).__name__}")
    if isinstance(path, str) and not path.strip():  # Path("") is the working directory: its files were read
        raise ValueError(f"path must name a folder (None: the packaged artifacts), got {path!r}")
    if not isinstance(allow_same_arch, bool):  # the string "false" is truthy: it accepted another GPU's files
        raise ValueError(
            f"allow_same_arch must be a bool, got {type(allow_same_arch).__name__} {allow_same_arch!r:.40}"
        )
    if gpu is not None and not isinstance(gpu, str):
        raise ValueError(f"gpu must be a GPU key such as 'h100' or None, got {type(gpu).__name__}")
    gpu = gpu.strip().lower() if gpu is not None else None
    if gpu is not None and not is_gpu_key(gpu):  # '' or 'x/..' would read files outside <path>/<gpu>/
        raise ValueError(f"gpu must be a GPU key such as 'h100' (a folder name) or None, got {gpu!r:.60}")
    if path is None:
        from autotune.runtime.bundle import packaged_artifacts_root

        path = packaged_artifacts_root()
    state = _State(loaded=True, path=str(path))
    if gpu is None:
        try:
            gpu = _detect_gpu()
        except Exception as exc:  # noqa: BLE001 - no CUDA / unknown GPU: defaults, with the reason
            for kind in kinds():
                state.problems[kind] = f"no artifact used for {kind}: could not detect the GPU ({exc})"
    state.gpu = gpu
    running = gpus.running_environment() if gpu is not None else None
    for kind in kinds() if gpu is not None else ():
        file = Path(path) / gpu / f"{kind}.json"
        if not os.path.lexists(file):
            file = (_same_arch_file(Path(path), gpu, kind) if allow_same_arch else None) or file
        if not os.path.lexists(file):  # a FIFO, folder or dangling link there is rejected by assess, not "missing"
            hint = ""
            if (Path(path) / f"{kind}.json").is_file():
                hint = f" ({path} holds {kind}.json itself: pass the folder above it, which holds one folder per GPU)"
            elif gpu not in gpus.GPUS:
                hint = f" ('{gpu}' is not a known GPU key: {', '.join(sorted(gpus.GPUS))})"
            state.missing[kind] = f"no artifact for GPU '{gpu}': {file} does not exist{hint}"
            continue
        verdict = assess_artifact(file, gpu, running, allow_same_arch)
        if verdict.usable:
            state.artifacts[kind] = verdict.artifact
            state.notes[kind], state.files[kind] = list(verdict.notes), str(file)
        else:
            state.problems[kind] = f"artifact rejected: {verdict.reason}"
    global _STATE
    with _STATE_LOCK:
        _STATE = state
        clear_cache()
    for note in dict.fromkeys(n for kind in kinds() for n in state.notes.get(kind, [])):
        _warn_once(note)  # fwd and bwd usually share the note: said once
    return summary()


def summary() -> dict[str, Any]:
    """What is loaded: GPU, kernels with artifacts (and their files), problems (rejected files),
    missing files (those kernels run their defaults, warned at their first call), notes said when a
    file was used anyway (version drift, same-architecture), warnings so far."""
    state = _STATE  # one state: a load in another thread must not mix two folders into one summary
    return {
        "loaded": state.loaded,
        "path": state.path,
        "gpu": state.gpu,
        "kernels": sorted(state.artifacts),
        "problems": dict(state.problems),
        "missing": dict(state.missing),
        "notes": {k: list(v) for k, v in state.notes.items()},
        "files": dict(state.files),
        "warnings": list(WARNINGS),
    }


# --------------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------------
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


def tracing() -> bool:
    """Whether this call is being traced (torch.compile / torch.export), not run."""
    compiler = torch.compiler
    return compiler.is_compiling() or bool(getattr(compiler, "is_exporting", lambda: False)())


def _check_sizes(dqk: int, dv: int, num_heads: int, max_seq_len: int = 0, heads_name: str = "num_heads") -> None:
    """Raise ValueError naming the first size no call can have: head dims and heads are ints >= 1, max_seq_len an
    int >= 0 (an empty batch's may be 0). A bool or float would otherwise hit the cached choice of the int it
    equals (True == 1). Plain int checks first: every dispatched call runs this."""
    if (
        type(dqk) is int
        and type(dv) is int
        and type(num_heads) is int
        and type(max_seq_len) is int
        and dqk > 0
        and dv > 0
        and num_heads > 0
        and max_seq_len >= 0
    ):
        return
    sizes = (("dqk", dqk, 1), ("dv", dv, 1), (heads_name, num_heads, 1), ("max_seq_len", max_seq_len, 0))
    for name, value, low in sizes:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int >= {low}, got {type(value).__name__} {value!r}")
        if value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _spec_defaults(kind: str, dqk: int, dv: int, dtype: str | None, num_heads: int, interpret: bool) -> dict:
    _check_sizes(dqk, dv, num_heads)
    if spec.kernel(kind).default is None:
        raise ValueError(f"{kind}: its spec names no default configs")
    return spec_defaults(kind, dqk, dv, num_heads, dtype, interpret)


def preferred_default(
    kind: str, dqk: int, dv: int, dtype: str | None = None, num_heads: int = 1, interpret: bool = False
) -> Choice:
    """The spec's first default (its preferred backend), whether or not it runs in this process: what a GPU
    with every backend runs without artifacts, and what a trace records."""
    backend, config = next(iter(_spec_defaults(kind, dqk, dv, dtype, num_heads, interpret).items()))
    config = fit_spec_default(kind, backend, config, dqk, dv, num_heads, dtype, interpret)
    return Choice(backend, _config_json(config), "default")


def default_choice(kind: str, dqk: int, dv: int, dtype: str | None = None, num_heads: int = 1) -> Choice:
    """The heuristic default for these dims and dtype: the first available backend of the kernel
    spec's defaults (float32 takes smaller attention tiles), fitted to the running GPU's rules
    (``defaults.fit_spec_default``)."""
    interpret = _interpreting()
    defaults = _spec_defaults(kind, dqk, dv, dtype, num_heads, interpret)
    for backend, config in defaults.items():
        if backend_available(backend, kind):
            config = fit_spec_default(kind, backend, config, dqk, dv, num_heads, dtype, interpret)
            return Choice(backend, _config_json(config), "default")
    if tracing():  # a trace (torch.export of the model for its tasks) only records the choice: no kernel runs
        return preferred_default(kind, dqk, dv, dtype, num_heads, interpret)
    hint = ""
    if not torch.cuda.is_available() and not interpret:
        hint = (
            "; there is no CUDA GPU here: set TRITON_INTERPRET=1 to run the Triton kernels on the CPU (slow), or "
            "use the 'reference' source (source='reference', or kernels='reference' in the model)"
        )
    raise RuntimeError(f"{kind}: no backend of its defaults ({', '.join(defaults)}) can run in this process{hint}")


# The CuTe kernels' grid order, (heads, sequences, blocks), puts the batch in y, which CUDA caps at GRID_YZ_MAX;
# their compact and persistent orders, and the Triton kernels, put it in x (2**31 - 1).
def for_batch(
    kind: str, backend: str, config: Any, batch: int, dqk: int, dv: int, dtype: object, heads: int
) -> tuple[str, Any]:
    """(backend, config) that can launch ``batch`` sequences: the choice itself (config as given: JSON or object),
    unless it is a CuTe config of the grid order and the batch is over ``GRID_YZ_MAX``; then the Triton default
    of the same dims, its config as JSON (said once)."""
    _check_sizes(dqk, dv, heads, heads_name="heads")
    if batch <= GRID_YZ_MAX or backend != "cute":
        return backend, config
    # Decoded as every config string is (a ValueError naming config): read with json.loads, a malformed string
    # from a direct torch.ops.hstu call failed here as a JSONDecodeError or AttributeError naming nothing.
    c = (decode_config(backend, kind, config) if isinstance(config, str) else config).to_dict()
    if c.get("compact") or c.get("persistent"):
        return backend, config
    interpret = _interpreting()
    config = _spec_defaults(kind, dqk, dv, dtype, heads, interpret)["triton"]
    _warn_once(
        f"{kind}: a batch of {batch} sequences is over the {GRID_YZ_MAX} the chosen CuTe config's launch grid holds "
        "(its grid order puts sequences in the grid's y dimension); running the Triton default",
        key=f"{kind}:wide-batch",
    )
    return "triton", _config_json(fit_spec_default(kind, "triton", config, dqk, dv, heads, dtype, interpret))


@functools.lru_cache(maxsize=512)
def grid_rows(kind: str, backend: str, config: Any) -> int | None:
    """Rows of a sequence one block of the choice's launch grid covers along a 65535-capped grid dimension
    (``BackendSpec.grid_rows``; config as JSON or object), None when its grids hold any length."""
    b = next((b for b in spec.kernel(kind).backends if b.name == backend), None)  # "reference": no grid
    if b is None or b.grid_rows is None:
        return None
    return spec.resolve(b.grid_rows)(decode_config(backend, kind, config) if isinstance(config, str) else config)


def _entry_choice(kind: str, entry: Any, source: str, call: dict[str, Any], gpu: str | None = None) -> Choice | None:
    """The entry's choice, or None (the default serves) when its backend cannot run here or its config is
    infeasible for the call (``call``: dtype, dqk, dv, num_heads, bucket) on ``gpu`` (the artifacts' GPU), say a
    nearest entry of other heads whose tile the space's rules reject at this width, or a hand-edited file."""
    backend = _get(entry, "backend", "triton")
    if backend == "reference":  # the fp32 oracle is asked for by source="reference", never read from a file
        _warn_once(f"{kind}: an entry names the 'reference' backend, not a tuned one; using the default")
        return None
    if not backend_available(backend, kind):
        _warn_once(f"{kind}: tuned backend '{backend}' is not available in this process; using the default")
        return None
    config = _config_json(_get(entry, "config"))
    reason = _infeasible(kind, backend, config, call, gpu)
    if reason:
        _warn_once(
            f"{kind}: the {source} entry's {backend} config {config} cannot serve {call}: {reason}; using the default"
        )
        return None
    return Choice(backend, config, source, _get(entry, "bucket"))


def _infeasible(kind: str, backend: str, config: str, call: dict[str, Any], gpu_key: str | None) -> str | None:
    """The search space's reason to reject ``config`` for the call on ``gpu_key`` (the artifacts' GPU), or None."""
    from autotune.runtime.gpus import GPUS
    from search_spaces.base import SpaceContext

    space_name = spec.kernel(kind).backend(backend).space
    gpu = GPUS.get(str(gpu_key).lower())
    if space_name is None or gpu is None:
        return None
    # The GPU's rules (the interpreter runs any tile, only slower; its own rules only keep tuning under it short).
    ctx = SpaceContext(gpu, call["dtype"], call["dqk"], call["dv"], call["bucket"], False, call["num_heads"])
    return spec.resolve(space_name).why_infeasible(decode_config(backend, kind, config), ctx)


def mask_of(contextual_seq_len: int, has_targets: bool, max_attn_len: int) -> str:
    """The artifact mask name (``autotune.tuning.tasks.MASKS``) of a call's mask arguments.

    Each mask feature is its own kernel specialisation, so its best config can differ. A window
    (``max_attn_len > 0``) names the call whatever else it has: it decides which key blocks a query
    block visits, so it shapes the best tile most, and no tuned mask combines it with the others.
    """
    if max_attn_len > 0:
        return "window"
    if contextual_seq_len > 0:
        return "context+targets" if has_targets else "context"
    return "targets" if has_targets else "causal"


def _nearest(entries: list[Any], bucket: int, distribution: str | None, num_heads: int, mask: str) -> Any:
    """Deterministic closest entry: closest log2 bucket, then same distribution, same mask (else
    causal), same heads (else the closest count), the larger bucket, and finally the config's text
    (a total order: no ties left)."""

    def rank(e: Any) -> tuple:
        b = int(_get(e, "bucket"))
        m = _get(e, "mask", "causal")
        return (
            abs(math.log2(b) - math.log2(bucket)),
            0 if distribution is None or _get(e, "distribution") == distribution else 1,
            0 if m == mask else 1 if m == "causal" else 2,
            abs(int(_get(e, "num_heads")) - num_heads),
            -b,
            json.dumps(_get(e, "config"), sort_keys=True),
        )

    return min(entries, key=rank)


def call_fill(rows: int, batch: int, max_seq_len: int) -> float | None:
    """L / (B x max_seq_len) of a call, in (0, 1]; None where it says nothing (no rows or sequences)."""
    if rows <= 0 or batch <= 0 or max_seq_len <= 0:
        return None
    return min(1.0, rows / (batch * max_seq_len))


def fill_bin(fill: float | None) -> int | None:
    """The call's fill rounded to a ``FILL_STEPS``-per-halving log bin (<= 0), so choices cache; None for no fill
    (None or 0). Anything but a real number >= 0 is a ValueError: a tensor would be read on the host (a sync
    per call, the thing fill exists to avoid), a NaN or negative fill silently ran the uniform entry."""
    if fill is None:
        return None
    if type(fill) is not float and (isinstance(fill, bool) or not isinstance(fill, numbers.Real)):
        raise ValueError(f"fill must be a float L / (B x max_seq_len) (call_fill) or None, got {type(fill).__name__}")
    if not fill >= 0:
        raise ValueError(f"fill must be >= 0 (L / (B x max_seq_len)), got {fill!r}")
    if fill == 0:
        return None
    return min(0, round(math.log2(min(fill, 1.0)) * FILL_STEPS))


def entry_fill(entry: Any) -> float:
    """The fill ratio of the batch an entry was tuned on: recorded by the tuner (``fill``, or the
    lengths sample's ``batch_fill``), else 1 for 'uniform' and the fill of its synthetic law's batch."""
    for recorded in (_get(entry, "fill"), (_get(entry, "lengths") or {}).get("batch_fill")):
        # Artifacts are validated at load; a value outside (0, 1] is skipped rather than trusted.
        if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and 0 < recorded <= 1:
            return float(recorded)
    if _get(entry, "distribution") == "uniform":
        return 1.0
    from autotune.runtime.buckets import law_fill

    return law_fill(int(_get(entry, "bucket")), _get(entry, "distribution"))


SIBLING_DTYPES = {"bfloat16": "float16", "float16": "bfloat16"}


def verified_for(entry: Any, dtype: str, mask: str | None = None) -> bool:
    """Whether the full re-check ran ``entry``'s config in ``dtype`` (under ``mask`` when given) and it passed
    (``verified`` lists the passing cases as "case/mask/dtype"): a config re-checked in fp16 only under the
    causal mask says nothing about its fp16 window or target kernels."""
    for case in _get(entry, "verified") or ():
        parts = str(case).rsplit("/", 2)
        if parts[-1] == dtype and (mask is None or (len(parts) == 3 and parts[1] == mask)):
            return True
    return False


def _serving_dtype(entries: list[Any], dtype: str, dqk: int, dv: int, mask: str) -> str:
    """The dtype whose entries serve a call: its own when the artifact has entries of these head
    dims in it; else the other 16-bit dtype's when one of them was re-checked in the call's dtype and mask.

    bf16 and fp16 run the same tiles at the same tensor-core rate, so a config tuned in one is as
    fast in the other; what has to be shown is that it is correct there, which the full re-check
    (every mask in bf16 and fp16) records. Entries not re-checked in the call's dtype and mask never serve
    it: the call keeps its own dtype and falls back to the default.
    """

    sibling = SIBLING_DTYPES.get(dtype)
    if sibling is None or any(_has_dims(e, dtype, dqk, dv) for e in entries):
        return dtype
    served = any(_has_dims(e, sibling, dqk, dv) and verified_for(e, dtype, mask) for e in entries)
    return sibling if served else dtype


def _has_dims(e: Any, dtype: str, dqk: int, dv: int) -> bool:
    """Whether entry ``e`` is of this dtype and these head dims."""
    return _get(e, "dtype") == dtype and int(_get(e, "dqk")) == dqk and int(_get(e, "dv")) == dv


def _same_task_but_distribution(e: Any, dtype: str, dqk: int, dv: int, bucket: int, heads: int, mask: str) -> bool:
    return (
        _get(e, "dtype") == dtype
        and int(_get(e, "dqk")) == dqk
        and int(_get(e, "dv")) == dv
        and int(_get(e, "bucket")) == bucket
        and int(_get(e, "num_heads")) == heads
        and _get(e, "mask", "causal") == mask
    )


def _nearest_fill(entries: list[Any], fill: float) -> Any:
    """The entry tuned on the fill nearest ``fill`` (log scale; 'uniform' first on ties), if within
    ``FILL_TOLERANCE``; else, for a call below every entry's fill, the lowest-fill entry; else the
    'uniform' entry, else None."""
    if not entries:
        return None

    def distance(e: Any) -> float:
        return abs(math.log2(entry_fill(e)) - math.log2(fill))

    best = min(entries, key=lambda e: (distance(e), _get(e, "distribution") != "uniform", _config_json(e["config"])))
    if distance(best) <= math.log2(FILL_TOLERANCE) or all(entry_fill(e) > fill for e in entries):
        return best
    return next((e for e in entries if _get(e, "distribution") == "uniform"), None)


def _by_fill(pool: list[Any], entry: Any, fbin: int | None) -> Any:
    """The entry of ``entry``'s task (all but its distribution) tuned on the fill nearest the call's fill bin
    (``_nearest_fill``), else ``entry``. Used for the exact key and for the nearest one alike: a call of untuned
    heads, mask or bucket is as skewed as it is, and would otherwise take whichever entry sorts first."""
    if fbin is None:
        return entry
    key = [_get(entry, n) for n in ("dtype", "dqk", "dv", "bucket", "num_heads")] + [_get(entry, "mask", "causal")]
    same = [e for e in pool if _same_task_but_distribution(e, *key)]
    return _nearest_fill(same, 2.0 ** (fbin / FILL_STEPS)) or entry


def entry_for_fill(entries: list[Any], entry: Any, fill: float | None) -> Any:
    """The entry of ``entry``'s task (all but its distribution) that a call of ``fill`` without a distribution hint
    runs (``_by_fill``): what a record of such a call (an exported node) names, rather than whichever sorts first."""
    return _by_fill(list(entries), entry, fill_bin(fill))


def _fallback_message(kind: str, call: dict[str, Any], entry: Any) -> str:
    """What the closest entry differs in from the call (bucket, distribution, heads, mask)."""
    diffs = []
    if _get(entry, "bucket") != call["bucket"]:
        diffs.append(f"the nearest tuned bucket {_get(entry, 'bucket')}")
    for name in ("dtype", "distribution", "num_heads", "mask"):
        if call[name] is not None and _get(entry, name) != call[name]:
            diffs.append(f"{name}={_get(entry, name)} instead of {call[name]}")
    wanted = ", ".join(f"{k}={v}" for k, v in call.items() if k != "bucket")
    return (
        f"{kind}: no tuned entry for bucket {call['bucket']} ({wanted}); using the closest tuned entry, "
        f"with {', '.join(diffs)}"
    )


def _resolve(
    state: _State,
    kind: str,
    dtype: str,
    dqk: int,
    dv: int,
    num_heads: int,
    max_seq_len: int,
    distribution: str | None,
    source: str,
    mask: str = "causal",
    fbin: int | None = None,
) -> Choice:
    if source == "reference":
        return Choice("reference", "{}", "reference")
    if source == "default" or not state.loaded:
        return default_choice(kind, dqk, dv, dtype, num_heads)
    problem = state.problems.get(kind) or state.missing.get(kind)
    if problem:
        _warn_once(f"{problem}; using the heuristic default config")
        return default_choice(kind, dqk, dv, dtype, num_heads)
    artifact = state.artifacts.get(kind)
    if artifact is None:  # a spec registered after the load (a plugin imported later): its file was never read
        _warn_once(
            f"{kind}: registered after autotune.load() read {state.path}, so no artifact of it was loaded; call "
            "autotune.load() again after registering it; using the heuristic default config"
        )
        return default_choice(kind, dqk, dv, dtype, num_heads)
    serve = _serving_dtype(_entries(artifact), dtype, dqk, dv, mask)
    # The other dtype's entries serve only where re-checked in the call's dtype and mask; its own, all of them.
    usable = None if serve == dtype else functools.partial(verified_for, dtype=dtype, mask=mask)
    pool = [e for e in _entries(artifact) if usable is None or usable(e)]
    bucket = bucket_for(max_seq_len)
    if max_seq_len > LARGEST_BUCKET:
        _warn_once(
            f"{kind}: max_seq_len {max_seq_len} is above the largest tuned bucket {LARGEST_BUCKET}; using that "
            "bucket's config, which was never tuned or timed at these lengths",
            key=f"{kind}: above the largest bucket",
        )
    entry = artifact.lookup(serve, dqk, dv, bucket, distribution, num_heads, mask, among=usable)
    if entry is not None and distribution is None:
        entry = _by_fill(pool, entry, fbin)
    fit = {"dtype": serve, "dqk": dqk, "dv": dv, "num_heads": num_heads, "bucket": bucket}  # the config must fit
    if entry is not None:
        choice = _entry_choice(kind, entry, "tuned", fit, state.gpu)
        return choice or default_choice(kind, dqk, dv, dtype, num_heads)
    same_dims = [e for e in pool if _has_dims(e, serve, dqk, dv)]
    if not same_dims:
        _warn_once(
            f"{kind}: no tuned entry for dtype={dtype}, head dims dqk={dqk} dv={dv} (unseen head dim) in the "
            f"'{state.gpu}' artifact; using the heuristic default config"
        )
        return default_choice(kind, dqk, dv, dtype, num_heads)
    best = _nearest(same_dims, bucket, distribution, num_heads, mask)
    if distribution is None:  # the closest task's entries, still told apart by the call's fill
        best = _by_fill(same_dims, best, fbin)
    call = {"dtype": dtype, "dqk": dqk, "dv": dv, "bucket": bucket, "distribution": distribution}
    _warn_once(_fallback_message(kind, {**call, "num_heads": num_heads, "mask": mask}, best))
    choice = _entry_choice(kind, best, "nearest", fit, state.gpu)
    return choice or default_choice(kind, dqk, dv, dtype, num_heads)


def length_key(max_seq_len: int) -> int:
    """What a choice depends on of ``max_seq_len``: its bucket (``bucket_for``), or ``2 * LARGEST_BUCKET`` above the
    largest. The choice cache is keyed by it, not by the length: a loose max_seq_len chooses by the rows, so keyed
    by the length it held (and resolved again) one choice per row count a jagged stream reached."""
    return min(max(BUCKETS[0], 1 << (int(max_seq_len) - 1).bit_length()), 2 * LARGEST_BUCKET)


def select(
    kind: str,
    dtype: torch.dtype | str,
    dqk: int,
    dv: int,
    num_heads: int,
    max_seq_len: int,
    distribution: str | None = None,
    source: str = "tuned",
    mask: str = "causal",
    fill: float | None = None,
) -> Choice:
    """The (backend, config) for one call; cached, deterministic, never times anything.

    ``source``: "tuned" (loaded artifacts, with fallbacks), "default" (heuristic), "reference".
    ``distribution``: "uniform" (full lengths), "jagged" or "sparse" (``buckets.sequence_lengths``)
    when the caller knows it, else None.
    ``mask``: the call's mask name (``mask_of``); entries are keyed by it and by ``num_heads``.
    ``fill``: the call's L / (B x max_seq_len) (``call_fill``, a float: never a tensor, whose value would be read
    on the host), used when ``distribution`` is None.
    ``dqk``, ``dv`` and ``num_heads`` are ints >= 1, ``max_seq_len`` an int >= 0 (an empty batch's may be 0); any
    other value is a ValueError naming it.
    """
    _check_sizes(dqk, dv, num_heads, max_seq_len)  # before the lookup: True would hit the entry of 1
    fbin = fill_bin(fill) if distribution is None else None
    key = (kind, dtype, dqk, dv, num_heads, length_key(max_seq_len), distribution, source, mask, fbin)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if kind not in kinds():
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {tuple(kinds())}")
    if source not in SOURCES:
        raise ValueError(f"source={source!r}: unknown kernel source; expected one of {SOURCES}")
    if mask not in MASKS:
        raise ValueError(f"unknown mask {mask!r}; expected one of {MASKS} (see mask_of)")
    if distribution is not None and distribution not in DISTRIBUTIONS:  # a typo would run a nearest entry, warned
        raise ValueError(f"unknown distribution {distribution!r}; expected None or one of {DISTRIBUTIONS}")
    dims = (int(dqk), int(dv), int(num_heads), int(max_seq_len))

    def store(choice: Choice) -> None:
        if choice.backend == "reference" or backend_available(choice.backend, kind):  # not a trace-only choice
            _CACHE[key] = choice

    # One state for the whole choice: a concurrent load must not mix two GPUs' files into it.
    return cache_unless_reloaded(
        lambda state: _resolve(state, kind, _dtype_name(dtype), *dims, distribution, source, mask, fbin), store
    )


def cache_unless_reloaded(build: Callable[[_State], Any], store: Callable[[Any], None]) -> Any:
    """``build(state)`` on the loaded state, kept through ``store`` only if no ``load`` (another thread's) replaced
    that state meanwhile: a cache of choices (this module's, the fused layer's plans) filled after the load dropped
    it kept the old files' choices for every later call."""
    state = _STATE
    value = build(state)
    with _STATE_LOCK:
        if _STATE is state:
            store(value)
    return value
