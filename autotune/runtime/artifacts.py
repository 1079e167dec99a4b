"""Tuning artifacts: ``artifacts/<gpu>/<kernel>.json``, exactly as docs/CONTRACTS.md defines them.

Stdlib only, so the runtime dispatch can load artifacts without the tuner's dependencies. Loading
validates everything (schema version, keys, types, configs) and refuses stale artifacts whose
template source hash differs from the current templates: a tuned config of an edited kernel could be
wrong or slow, so the caller gets an ``ArtifactError`` (or, with ``load_artifact_or_none``, a warning
and None, i.e. the heuristic default), never a silent wrong kernel.

``assess_artifact`` is the one usability verdict that both the runtime (``autotune.load``) and
``autotune show`` act on: it never raises, and adds the origin checks (the file's GPU against its
folder, the requested GPU and the running one; compute capability; library versions).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import BUCKETS, DISTRIBUTIONS, MAX_BATCH, MAX_HEADS
from kernel_templates.config_types import config_type_error

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO_ROOT / "artifacts"
DTYPES = ("bfloat16", "float16", "float32")
MASKS = ("causal", "targets", "context", "context+targets", "window")  # == autotune.tuning.tasks.MASKS (import-free)
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024  # ~100x the largest tuned file; a bigger one is not an artifact
# Versions whose drift is worth a warning (configs may no longer be the fastest), not a rejection.
VERSION_KEYS = ("torch", "triton", "cutlass_dsl", "cuda", "driver", "sm_count")

TOP_KEYS = {
    "schema_version": int,
    "kernel": str,
    "gpu": str,
    "environment": dict,
    "template_hash": dict,
    "search_space_hash": str,
    "created": str,
    "entries": list,
}
ENV_KEYS = ("gpu_name", "compute_capability", "sm_count", "driver", "cuda", "torch", "triton", "cutlass_dsl")
_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
ENTRY_KEYS: dict[str, tuple] = {
    "dtype": (str,),
    "dqk": (int,),
    "dv": (int,),
    "num_heads": (int,),
    "bucket": (int,),
    "distribution": (str,),
    "mask": (str,),
    "backend": (str,),
    "config": (dict,),
    "median_ms": _NUM,
    "spread_ms": _NUM,
    "tflops": _NUM,
    "default_ms": _OPT_NUM,
    "default_tflops": _OPT_NUM,
    "speedup": _OPT_NUM,
    "trials": (int,),
    "tuning_s": _NUM,
}
# Keys an entry may carry beyond ENTRY_KEYS (older artifacts lack them).
# "verified": the re-check cases the config passed before it was written; "samples": timed samples
# behind median_ms; "compare": the interleaved winner/default verdict (rounds, speedup, spread);
# "lengths": the sample of real lengths (``autotune run --lengths``) the batches were drawn from;
# "fill": the timed batch's fill ratio; "batch": the sequences of the batch it was timed on (a re-measure,
# ``autotune run --from-artifact``, times that batch again).
OPTIONAL_ENTRY_KEYS: dict[str, tuple] = {
    "timing": (str,),
    "verified": (list,),
    "samples": (int,),
    "compare": (dict,),
    "lengths": (dict,),  # descriptor of the real-lengths sample a jagged entry was tuned on
    "fill": _NUM,  # L / (B x max_len) of the batch the entry was timed on (dispatch matches calls on it)
    "batch": (int,),  # sequences in the batch the entry was timed on (older entries lack it)
}
ENTRY_KEY_FIELDS = ("dtype", "dqk", "dv", "num_heads", "bucket", "distribution", "mask")
# Measured numbers that are never negative (None where the schema allows it).
NON_NEGATIVE = ("tflops", "default_ms", "default_tflops", "speedup", "tuning_s")


class ArtifactError(ValueError):
    """A corrupt, invalid or stale artifact; the message says which and what to do."""


def current_template_hash(kernel: str, backend: str = "triton") -> str:
    """sha256 over the (path, content) of the template sources of (kernel, backend), as its op spec lists them.

    A pair no op spec declares hashes no file (a hash no tuned artifact records, so its entries read as stale):
    the names come from artifact files and never become paths (a backend '../..' hashed whatever lay there).
    """
    from autotune.spec import sources

    files = sources(kernel, backend)
    h = hashlib.sha256()
    for rel in sorted(files):
        p = Path(rel) if Path(rel).is_absolute() else REPO_ROOT / rel
        h.update(str(rel).encode() + b"\0")
        h.update(p.read_bytes() if p.is_file() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()


def artifact_path(gpu: str, kernel: str, root: str | Path | None = None) -> Path:
    return Path(root or DEFAULT_ROOT) / gpu / f"{kernel}.json"


def artifact_files(gpus: Iterable[str], root: str | Path | None = None) -> set[Path]:
    """Every registered kernel's artifact path for ``gpus`` under ``root``, resolved: the files ``autotune.load``
    reads, which no command's output may replace."""
    from autotune.spec import kernels

    return {artifact_path(g, k, root).resolve() for g in gpus for k in kernels()}


def entry_key(entry: dict[str, Any]) -> tuple:
    return tuple(entry[k] for k in ENTRY_KEY_FIELDS)


@dataclass
class Artifact:
    """One kernel's tuned configs on one GPU."""

    kernel: str
    gpu: str
    environment: dict[str, Any]
    template_hash: dict[str, str]
    search_space_hash: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    schema_version: int = SCHEMA_VERSION

    def lookup(
        self,
        dtype: str,
        dqk: int,
        dv: int,
        bucket: int,
        distribution: str | None = None,
        num_heads: int | None = None,
        mask: str | None = None,
        among: Callable[[dict[str, Any]], bool] | None = None,
    ) -> dict[str, Any] | None:
        """The entry for these shapes, or None. ``distribution``, ``num_heads`` and ``mask`` must match
        when given (entries are keyed by them: a config tuned for 4 causal heads is not the exact answer
        for 8 windowed ones). Unset, 'uniform' is preferred, then 'causal', then the first recorded one.
        ``among``: only entries it accepts answer (dispatch's entries verified for another dtype), so the
        preference order runs over those rather than picking one that is then refused."""
        hits = [
            e
            for e in self.entries
            if e["dtype"] == dtype and e["dqk"] == dqk and e["dv"] == dv and e["bucket"] == bucket
            if distribution is None or e["distribution"] == distribution
            if num_heads is None or e["num_heads"] == num_heads
            if mask is None or e["mask"] == mask
            if among is None or among(e)
        ]
        if not hits:
            return None
        hits.sort(key=lambda e: (e["distribution"] != "uniform", e["mask"] != "causal"))
        return hits[0]

    def upsert(self, entry: dict[str, Any]) -> None:
        """Add ``entry``, replacing the one with the same (dtype, dims, heads, bucket, distribution, mask)."""
        _validate_entry(entry, f"entry {entry_key(entry) if all(k in entry for k in ENTRY_KEY_FIELDS) else '?'}")
        key = entry_key(entry)
        self.entries = [e for e in self.entries if entry_key(e) != key] + [entry]
        self.entries.sort(key=lambda e: tuple(str(x) for x in entry_key(e)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "kernel": self.kernel,
            "gpu": self.gpu,
            "environment": self.environment,
            "template_hash": self.template_hash,
            "search_space_hash": self.search_space_hash,
            "created": self.created,
            "entries": self.entries,
        }


def _check_type(value: Any, types: tuple, where: str) -> None:
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = "/".join("null" if t is type(None) else t.__name__ for t in types)
        raise ArtifactError(f"{where} must be {names}, got {value!r}")
    if isinstance(value, float | int) and not isinstance(value, bool) and not _finite(value):
        raise ArtifactError(f"{where} must be finite, got {value!r:.40}")


_GPU_KEY = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def is_gpu_key(name: str) -> bool:
    """Whether ``name`` can be a GPU folder name: lower case, no separators (nor '..'), at most 64 characters."""
    return _GPU_KEY.fullmatch(name) is not None


def _finite(x: float | int) -> bool:
    """A float that is not inf/NaN, or an int a float can hold (10**400 is valid JSON and overflows a format)."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _config_class(kernel: str, backend: str) -> type | None:
    """The config class the op spec names for (kernel, backend); None when the spec has none.

    Config modules are pure Python (no cutlass, no GPU), so validating an artifact stays cheap.
    """
    from autotune.spec import kernel as kernel_spec
    from autotune.spec import resolve

    try:
        target = kernel_spec(kernel).backend(backend).config
    except ValueError:
        return None
    return resolve(target) if target else None


def _declared_backends(kernel: str) -> tuple[str, ...] | None:
    """The backends the op spec declares for ``kernel``; None for a kernel no spec registers here."""
    from autotune.spec import kernel as kernel_spec

    try:
        return tuple(b.name for b in kernel_spec(kernel).backends)
    except ValueError:
        return None


def validate_config(kernel: str, backend: str, config: dict[str, Any], where: str) -> None:
    """``ArtifactError`` unless ``config`` is what ``autotune.load`` takes for (kernel, backend): JSON scalars of
    the config class's field types, every field and no other, a config the class builds."""
    for k, v in config.items():
        if not isinstance(k, str) or not isinstance(v, (int, float, str, bool)):
            raise ArtifactError(f"{where}.config: {k!r}={v!r} is not a JSON scalar")
    cls = _config_class(kernel, backend)
    if cls is not None:
        problem = config_type_error(cls, config)
        if problem:
            raise ArtifactError(f"{where}.config.{problem}")
        try:
            cls.from_dict(config)
        except Exception as e:  # noqa: BLE001 - any failure to build it (huge ints: OverflowError) = invalid
            raise ArtifactError(f"{where}.config is not a valid {cls.__name__}: {e}") from None


def _validate_entry(entry: Any, where: str, kernel: str | None = None) -> None:
    if not isinstance(entry, dict):
        raise ArtifactError(f"{where} must be an object")
    missing = set(ENTRY_KEYS) - set(entry)
    unknown = set(entry) - set(ENTRY_KEYS) - set(OPTIONAL_ENTRY_KEYS)
    if missing or unknown:
        raise ArtifactError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    for k, types in {**ENTRY_KEYS, **OPTIONAL_ENTRY_KEYS}.items():
        if k in entry:
            _check_type(entry[k], types, f"{where}.{k}")
    for k in ("config", "compare", "lengths"):
        if k in entry:
            _check_finite_within(entry[k], f"{where}.{k}")
    if entry["dtype"] not in DTYPES:
        raise ArtifactError(f"{where}.dtype must be one of {DTYPES}, got {entry['dtype']!r}")
    if entry["bucket"] not in BUCKETS:
        raise ArtifactError(f"{where}.bucket must be one of {BUCKETS}, got {entry['bucket']!r}")
    if entry["distribution"] not in DISTRIBUTIONS:
        raise ArtifactError(f"{where}.distribution must be one of {DISTRIBUTIONS}, got {entry['distribution']!r}")
    if entry["mask"] not in MASKS:
        raise ArtifactError(f"{where}.mask must be one of {MASKS}, got {entry['mask']!r}")
    if min(entry["dqk"], entry["dv"], entry["num_heads"]) < 1:
        raise ArtifactError(f"{where}: dqk, dv and num_heads must be >= 1")
    if entry["median_ms"] <= 0 or entry["spread_ms"] < 0 or entry["trials"] < 0:
        raise ArtifactError(f"{where}: median_ms must be > 0, spread_ms and trials >= 0")
    for k in NON_NEGATIVE:
        if entry.get(k) is not None and entry[k] < 0:
            raise ArtifactError(f"{where}.{k} must be >= 0, got {entry[k]!r}")
    if "fill" in entry:
        _check_fill(entry["fill"], f"{where}.fill")
    # The limits of a task (a re-measure builds one from the entry): past them a hand edit failed in the tuner,
    # without naming the entry.
    if entry["num_heads"] > MAX_HEADS:
        raise ArtifactError(f"{where}.num_heads must be <= {MAX_HEADS}, got {entry['num_heads']!r}")
    if "batch" in entry and not 1 <= entry["batch"] <= MAX_BATCH:
        raise ArtifactError(f"{where}.batch must be in [1, {MAX_BATCH}], got {entry['batch']!r}")
    if "lengths" in entry and "batch_fill" in entry["lengths"]:
        _check_fill(entry["lengths"]["batch_fill"], f"{where}.lengths.batch_fill")
    for i, case in enumerate(entry.get("verified", ())):
        if not isinstance(case, str):
            raise ArtifactError(f"{where}.verified[{i}] must be a string (a re-check case), got {case!r}")
    if entry["backend"] == "reference":
        raise ArtifactError(f"{where}.backend 'reference' is the fp32 oracle, never a tuned backend")
    if kernel is not None:
        declared = _declared_backends(kernel)
        if declared is not None and entry["backend"] not in declared:
            raise ArtifactError(
                f"{where}.backend {entry['backend']!r} is not a backend of {kernel} (declared: {', '.join(declared)})"
            )
        validate_config(kernel, entry["backend"], entry["config"], where)


def _check_finite_within(value: Any, where: str) -> None:
    """``ArtifactError`` naming the first inf/NaN number inside a dict or list: the top-level numbers are checked by
    type, but one nested in ``compare`` or ``lengths`` loaded as usable and was saved as non-standard ``Infinity``."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite_within(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite_within(v, f"{where}[{i}]")
    elif isinstance(value, float | int) and not isinstance(value, bool) and not _finite(value):
        raise ArtifactError(f"{where} must be finite, got {value!r:.40}")


def _check_fill(value: Any, where: str) -> None:
    """A fill ratio L / (B x max_len): a finite number in (0, 1]."""
    _check_type(value, _NUM, where)
    if not 0 < value <= 1:
        raise ArtifactError(f"{where} must be in (0, 1], got {value!r}")


def validate_artifact(
    data: Any, source: str = "artifact", check_stale: bool = True, check_configs: bool = True
) -> Artifact:
    """An ``Artifact`` from parsed JSON, or ``ArtifactError`` naming the first problem. ``check_configs=False``
    leaves entry configs unbuilt: the tuner's warm starts read winners written before a tunable existed."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: top level must be a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{source}: schema_version {version!r} is not supported (expected {SCHEMA_VERSION}); re-run `autotune run`"
        )
    missing = set(TOP_KEYS) - set(data)
    unknown = set(data) - set(TOP_KEYS)
    if missing or unknown:
        raise ArtifactError(f"{source}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    for k, t in TOP_KEYS.items():
        _check_type(data[k], (t,), f"{source}: {k}")
    if not _GPU_KEY.fullmatch(data["gpu"]):  # it names the folder a merge writes: no separators, no "..", lower case
        raise ArtifactError(f"{source}: gpu must be a lower-case GPU key such as 'h100', got {data['gpu']!r:.60}")
    env_missing = set(ENV_KEYS) - set(data["environment"])
    if env_missing:
        raise ArtifactError(f"{source}: environment lacks {sorted(env_missing)}")
    # Every value, not only the known keys: an extra key holding NaN or a nested object loaded as usable, and the
    # next save of the file (merge, verify --write) failed on it; the known ones are compared with this process's.
    for k, v in data["environment"].items():
        types = (int, type(None)) if k == "sm_count" else (str, type(None))
        _check_type(v, types, f"{source}: environment.{str(k):.60}")
    kernel = data["kernel"]
    declared = _declared_backends(kernel) if check_configs else None
    for backend, h in data["template_hash"].items():
        if declared is not None and backend not in declared:
            raise ArtifactError(
                f"{source}: template_hash key {backend!r:.60} is not a backend of {kernel} "
                f"(declared: {', '.join(declared)})"
            )
        _check_type(h, (str,), f"{source}: template_hash.{backend:.60}")
    seen = set()
    for i, entry in enumerate(data["entries"]):
        where = f"{source}: entries[{i}]"
        _validate_entry(entry, where, kernel if check_configs else None)
        if entry["backend"] not in data["template_hash"]:
            raise ArtifactError(f"{where}: backend {entry['backend']!r} has no template_hash")
        if entry_key(entry) in seen:
            raise ArtifactError(f"{where}: duplicate entry for {entry_key(entry)}")
        seen.add(entry_key(entry))
    artifact = Artifact(
        kernel=kernel,
        gpu=data["gpu"],
        environment=data["environment"],
        template_hash=data["template_hash"],
        search_space_hash=data["search_space_hash"],
        entries=data["entries"],
        created=data["created"],
        schema_version=version,
    )
    if check_stale:
        problem = stale_reason(artifact, source)
        if problem:
            raise ArtifactError(problem)
    return artifact


def changed_templates(artifact: Artifact) -> tuple[list[str], list[str]]:
    """(backends used by entries, backends no entry uses) whose template hash differs from the current
    sources. Only the first make the artifact stale: an unused backend's hash is a record, not a config."""
    used = {e["backend"] for e in artifact.entries}
    changed = [b for b, h in sorted(artifact.template_hash.items()) if h != current_template_hash(artifact.kernel, b)]
    return [b for b in changed if b in used], [b for b in changed if b not in used]


def stale_reason(artifact: Artifact, source: str = "artifact") -> str | None:
    """Why ``artifact`` is stale (a template its entries use changed since tuning), or None.

    A kernel no registered spec declares hashes no sources: that is said as such, not as a changed template
    (a plugin's fresh artifact read where its module was not imported)."""
    from autotune.spec import kernels

    used, _ = changed_templates(artifact)
    if not used:
        return None
    if artifact.kernel not in kernels():
        return (
            f"{source}: no registered op spec declares kernel {artifact.kernel!r}; import the module that "
            f"registers it first (the autotune CLI: AUTOTUNE_PLUGINS=module)"
        )
    b = used[0]
    return (
        f"{source}: stale artifact: the {b} template of {artifact.kernel} changed since it was tuned "
        f"(template_hash {artifact.template_hash[b][:12]}... != current "
        f"{current_template_hash(artifact.kernel, b)[:12]}...); "
        f"re-run `autotune run --gpu {artifact.gpu} --kernel {artifact.kernel}`"
    )


def read_regular_file(path: str | Path, max_bytes: int = MAX_ARTIFACT_BYTES) -> bytes:
    """The bytes of ``path``, or ``ArtifactError`` naming it: a FIFO or device would block or never end a
    read, and a file of GBs would be read whole into memory. Opened non-blocking (a FIFO with no writer
    cannot hang the open) and checked on the open descriptor, so a swap after the check is no way around it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read artifact ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # checked before fdopen, which raises IsADirectoryError on a folder
        os.close(fd)
        raise ArtifactError(
            f"{path}: not a regular file (a directory, FIFO, device or socket); an artifact is a JSON file"
        )
    with os.fdopen(fd, "rb") as f:
        if st.st_size > max_bytes:
            raise ArtifactError(f"{path}: {st.st_size} bytes, larger than an artifact may be ({max_bytes} bytes)")
        try:
            data = f.read(max_bytes + 1)  # the file may grow after fstat
        except OSError as e:
            raise ArtifactError(f"{path}: cannot read artifact ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise ArtifactError(f"{path}: larger than an artifact may be ({max_bytes} bytes)")
    return data


def load_artifact(path: str | Path, check_stale: bool = True, check_configs: bool = True) -> Artifact:
    """Read and validate an artifact; ``ArtifactError`` for missing, corrupt, invalid, oversized, non-regular
    or stale files."""
    path = Path(path)
    raw = read_regular_file(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: corrupt artifact, not UTF-8 text ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: corrupt artifact, not valid JSON ({e})") from None
    except (ValueError, RecursionError) as e:  # an int of > 4300 digits, nesting deeper than the stack
        raise ArtifactError(f"{path}: corrupt artifact, JSON not readable ({type(e).__name__}: {e})") from None
    return validate_artifact(data, str(path), check_stale, check_configs)


def load_artifact_or_none(path: str | Path, check_stale: bool = True, check_configs: bool = True) -> Artifact | None:
    """``load_artifact``, but a missing file gives None and a bad one a warning and None (fall back to defaults)."""
    if not Path(path).exists():
        return None
    try:
        return load_artifact(path, check_stale, check_configs)
    except ArtifactError as e:
        warnings.warn(f"ignoring artifact, using heuristic defaults: {e}", RuntimeWarning, stacklevel=2)
        return None


@dataclass(frozen=True)
class Verdict:
    """Whether one artifact file may be used in this process, and why: the single decision that
    ``autotune.load`` acts on and ``autotune show`` prints, so the two can never disagree.

    ``reason``: why it is rejected ("" when usable). ``notes``: what to say once when it is used
    (version drift, a same-architecture fallback). ``info``: facts that change nothing (a template
    hash that no entry uses). ``artifact``: the parsed file whenever it is valid, rejected or not.
    ``same_arch``: rejected only because it was tuned on another GPU of the same architecture, so
    ``allow_same_arch=True`` would make it usable.
    """

    path: str
    usable: bool
    reason: str = ""
    notes: tuple[str, ...] = ()
    info: tuple[str, ...] = ()
    artifact: Artifact | None = None
    same_arch: bool = False


def _registry_cc(key: str | None) -> str | None:
    from autotune.runtime.gpus import GPUS  # stdlib-only module; imported late to keep this one import-free

    spec = GPUS.get(key.lower()) if isinstance(key, str) else None
    return spec.cc if spec else None


def interpreter_made(env: dict[str, Any]) -> bool:
    """Whether an artifact's environment is the Triton interpreter / a CPU (no compute capability):
    its timings say nothing about a GPU, and a GPU host's ``check_origin`` rejects it."""
    name = env.get("gpu_name")
    return env.get("compute_capability") is None or (isinstance(name, str) and name.startswith("triton-interpreter"))


def _gpu_key(name: Any) -> str | None:
    from autotune.runtime.gpus import gpu_from_name

    return gpu_from_name(name) if isinstance(name, str) else None


def _version_drift(gpu: str, env: dict[str, Any], running: dict[str, Any]) -> str | None:
    """A note naming every version that differs between the tuning run and this process (None: same).
    Unknown values (None on either side, e.g. no driver on a CPU machine) are not compared."""
    diffs = [
        f"{k} {env[k]} (tuned) vs {running[k]} (here)"
        for k in VERSION_KEYS
        if env.get(k) is not None and running.get(k) is not None and str(env[k]) != str(running[k])
    ]
    if not diffs:
        return None
    return (
        f"artifacts for '{gpu}' were tuned with other versions than this process runs: {', '.join(diffs)}; "
        "they are used, but may no longer hold the fastest configs (re-tune to be sure)"
    )


def check_origin(
    artifact: Artifact,
    folder: str | None,
    requested: str | None,
    running: dict[str, Any] | None,
    allow_same_arch: bool = False,
) -> tuple[str | None, list[str], bool]:
    """(rejection reason or None, notes to say once, rejected only for a same-architecture GPU).

    The file names its GPU twice (``gpu`` and ``environment.gpu_name``); both must agree with the
    folder it lives in (when that is a registry GPU key), the GPU asked for and the GPU running here (``running`` is
    ``autotune.runtime.gpus.environment()``; without a CUDA device it has no compute capability and only the
    folder and the request are checked). Another architecture is always rejected; another GPU of the
    same compute capability only when not allowed; other library versions are a note.
    """
    env, own = artifact.environment, artifact.gpu.lower()
    name_key = _gpu_key(env.get("gpu_name"))
    if name_key is not None and name_key != own:
        said = f"environment.gpu_name {env['gpu_name']!r} is a {name_key}"
        return f"the file contradicts itself: gpu '{own}' but {said}", [], False
    file_cc = env.get("compute_capability") or _registry_cc(own)
    run_cc = (running or {}).get("compute_capability")
    if run_cc and name_key is None:
        said = f"environment.gpu_name {env.get('gpu_name')!r} is no registry GPU (a Triton interpreter / CPU run?)"
        return f"{said}; re-tune with `autotune run --gpu auto`", [], False
    run_name = (running or {}).get("gpu_name") if run_cc else None
    run_key = _gpu_key(run_name)
    tuned = f"artifact tuned on '{own}' ({env.get('gpu_name') or 'device name not recorded'}, sm {file_cc or '?'})"
    if run_cc and file_cc and str(run_cc) != str(file_cc):
        reason = f"{tuned} but this process runs on {run_name} (sm {run_cc}), another architecture"
        return f"{reason}; re-tune with `autotune run --gpu auto`", [], False
    others: dict[str, str] = {}
    if folder and _registry_cc(folder) and folder != own:
        others[folder] = f"it lives under '{folder}/'"
    if requested and requested != own:
        others.setdefault(requested, f"GPU '{requested}' was asked for")
    if run_key and run_key != own:
        others[run_key] = f"this process runs on {run_name} ('{run_key}')"
    notes: list[str] = []
    if others:
        ccs = {_registry_cc(k) for k in others} | ({str(run_cc)} if run_key in others else set())
        same_arch = file_cc is not None and ccs == {str(file_cc)}
        where = "; ".join(others.values())
        if not same_arch:
            return f"{tuned} but {where}; re-tune for this GPU with `autotune run --gpu auto`", [], False
        if not allow_same_arch:
            hint = f"same architecture (sm {file_cc}): pass allow_same_arch=True to use it anyway, or re-tune"
            return f"{tuned} but {where}; {hint}", [], True
        notes.append(
            f"using artifacts tuned on '{own}' for {', '.join(repr(k) for k in sorted(others))}: same architecture "
            f"(sm {file_cc}), allowed by allow_same_arch=True; re-tune on this GPU for its own best configs"
        )
    drift = _version_drift(own, env, running) if running else None
    return None, notes + ([drift] if drift else []), False


def assess_artifact(
    path: str | Path,
    gpu: str | None = None,
    running: dict[str, Any] | None = None,
    allow_same_arch: bool = False,
) -> Verdict:
    """The usability verdict of one artifact file here; never raises, whatever the file holds.

    ``gpu``: the GPU key asked for (default: the folder the file lives in); ``running``: the
    running process's ``autotune.runtime.gpus.environment()`` (None: not known, origin checked against the
    folder and ``gpu`` only, versions not compared). Invalid and stale files are rejected; origin
    rules are ``check_origin``'s.
    """
    path = Path(path)
    folder = path.parent.name if _registry_cc(path.parent.name) else None  # artifacts/<gpu>/<kernel>.json
    try:
        artifact = load_artifact(path, check_stale=False)
    except ArtifactError as e:
        return Verdict(str(path), False, str(e))
    except Exception as e:  # noqa: BLE001 - the promise is "never raises": anything else is a bad file too
        return Verdict(str(path), False, f"{path}: artifact not readable ({type(e).__name__}: {e})")
    if artifact.kernel != path.stem:
        reason = f"{path}: the file holds kernel {artifact.kernel!r}, not {path.stem!r} (its file name)"
        return Verdict(str(path), False, reason)
    try:
        _, unused = changed_templates(artifact)
        info = tuple(f"the {b} template changed since tuning, but no entry uses {b}" for b in unused)
        stale = stale_reason(artifact, str(path))
        if stale:
            return Verdict(str(path), False, stale, info=info, artifact=artifact)
        reason, notes, same_arch = check_origin(artifact, folder, gpu or folder, running, allow_same_arch)
    except Exception as e:  # noqa: BLE001 - e.g. an unreadable template source: refuse, do not crash
        return Verdict(str(path), False, f"{path}: cannot check artifact ({type(e).__name__}: {e})", artifact=artifact)
    if reason:
        return Verdict(str(path), False, f"{path}: {reason}", info=info, artifact=artifact, same_arch=same_arch)
    return Verdict(str(path), True, notes=tuple(notes), info=info, artifact=artifact)


def save_artifact(artifact: Artifact, path: str | Path, check_configs: bool = True) -> Path:
    """Validate, then write atomically (temp file in the same directory + os.replace). ``check_configs=False``:
    entry configs are not built, so a re-write of a file read that way (``autotune verify --write``) keeps an
    entry ``autotune.load`` refuses as it was instead of refusing the whole file."""
    path = Path(path)
    data = artifact.to_dict()
    validate_artifact(data, str(path), check_stale=False, check_configs=check_configs)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False, allow_nan=False)  # strict JSON, never Infinity/NaN
            f.write("\n")

    return write_atomically(path, write)


def write_atomically(path: Path, write: Callable[[str], None]) -> Path:
    """``write(tmp)`` fills a temporary file beside ``path`` (its folder must exist), which then replaces
    ``path`` in one rename: a reader sees the old file or the whole new one, and a failing or interrupted
    writer leaves ``path`` as it was and no temporary file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the file is read by others like any written one
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process's umask: from /proc where it is there (no process-wide change another thread could see),
    else by setting it and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
