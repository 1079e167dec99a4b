"""Tuning artifacts: ``artifacts/<gpu>/<kernel>.json``, exactly as docs/CONTRACTS.md defines them.

Stdlib only, so the runtime dispatch can load artifacts without the tuner's dependencies. Loading
validates everything (schema version, keys, types, configs) and refuses stale artifacts whose
template source hash differs from the current templates: a tuned config of an edited kernel could be
wrong or slow, so the caller gets an ``ArtifactError`` (or, with ``load_artifact_or_none``, a warning
and None, i.e. the heuristic default), never a silent wrong kernel.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO_ROOT / "artifacts"
BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384)  # == autotune.buckets.BUCKETS (kept import-free)
DISTRIBUTIONS = ("uniform", "jagged")
DTYPES = ("bfloat16", "float16", "float32")

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
OPTIONAL_ENTRY_KEYS: dict[str, tuple] = {"timing": (str,)}
ENTRY_KEY_FIELDS = ("dtype", "dqk", "dv", "num_heads", "bucket", "distribution", "mask")

# (kernel, backend) -> template source files (relative to the repo root) hashed into "template_hash".
# What every CuTe template also runs: the compile cache and launch helpers, the sm90 TMA/pipeline
# helpers, the config base.
CUTE_SHARED = ("kernel_templates/cute_runtime.py", "kernel_templates/cute_sm90.py", "kernel_templates/config_base.py")
TEMPLATE_SOURCES: dict[tuple[str, str], tuple[str, ...]] = {
    ("hstu_attention_fwd", "triton"): (
        "kernel_templates/config_base.py",
        *(f"kernel_templates/hstu_attention/{f}" for f in ("config.py", "triton_common.py", "triton_fwd.py")),
    ),
    ("hstu_attention_bwd", "triton"): (
        "kernel_templates/config_base.py",
        *(
            f"kernel_templates/hstu_attention/{f}"
            for f in ("config.py", "triton_common.py", "triton_fwd.py", "triton_bwd.py")
        ),
    ),
    ("hstu_attention_fwd", "cute"): (
        *(f"kernel_templates/cute/{f}" for f in ("config.py", "schedule.py", "hstu_fwd_sm90.py", "op.py")),
        *CUTE_SHARED,
    ),
    ("hstu_attention_bwd", "cute"): (
        *(
            f"kernel_templates/cute/{f}"
            for f in ("config.py", "schedule.py", "hstu_fwd_sm90.py", "bwd_config.py", "hstu_bwd_sm90.py", "bwd_op.py")
        ),
        *CUTE_SHARED,
    ),
    ("gemm_silu", "cute"): (
        *(f"kernel_templates/gemm_silu/{f}" for f in ("config.py", "gemm_silu_sm90.py", "op.py", "reference.py")),
        *CUTE_SHARED,
    ),
    ("gemm_silu", "torch"): ("kernel_templates/gemm_silu/reference.py", "autotune/gemm_ops.py"),
}


class ArtifactError(ValueError):
    """A corrupt, invalid or stale artifact; the message says which and what to do."""


def register_template_sources(kernel: str, backend: str, files: tuple[str, ...] | list[str]) -> None:
    """Declare the source files whose content defines (kernel, backend)'s template hash."""
    TEMPLATE_SOURCES[(kernel, backend)] = tuple(files)


def current_template_hash(kernel: str, backend: str = "triton") -> str:
    """sha256 over the (path, content) of the template sources of (kernel, backend).

    Unregistered backends hash every ``.py`` under ``kernel_templates/<backend>/`` (e.g. cute).
    """
    files = TEMPLATE_SOURCES.get((kernel, backend))
    if files is None:
        base = REPO_ROOT / "kernel_templates" / backend
        files = tuple(str(p.relative_to(REPO_ROOT)) for p in sorted(base.rglob("*.py"))) if base.is_dir() else ()
    h = hashlib.sha256()
    for rel in sorted(files):
        p = Path(rel) if Path(rel).is_absolute() else REPO_ROOT / rel
        h.update(str(rel).encode() + b"\0")
        h.update(p.read_bytes() if p.is_file() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()


def artifact_path(gpu: str, kernel: str, root: str | Path | None = None) -> Path:
    return Path(root or DEFAULT_ROOT) / gpu / f"{kernel}.json"


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
        self, dtype: str, dqk: int, dv: int, bucket: int, distribution: str | None = None
    ) -> dict[str, Any] | None:
        """The entry for these shapes, or None. Without ``distribution``, 'uniform' is preferred;
        among several head counts / masks, 'causal' and then the first recorded one win."""
        hits = [
            e
            for e in self.entries
            if e["dtype"] == dtype and e["dqk"] == dqk and e["dv"] == dv and e["bucket"] == bucket
            if distribution is None or e["distribution"] == distribution
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
    if isinstance(value, float) and not math.isfinite(value):
        raise ArtifactError(f"{where} must be finite, got {value!r}")


def _validate_config(kernel: str, backend: str, config: dict[str, Any], where: str) -> None:
    for k, v in config.items():
        if not isinstance(k, str) or not isinstance(v, (int, float, str, bool)):
            raise ArtifactError(f"{where}.config: {k!r}={v!r} is not a JSON scalar")
    cls = None
    if backend == "triton" and kernel in ("hstu_attention_fwd", "hstu_attention_bwd"):
        from kernel_templates.hstu_attention.config import HSTUBwdConfig, HSTUFwdConfig

        cls = HSTUFwdConfig if kernel == "hstu_attention_fwd" else HSTUBwdConfig
    elif backend == "cute" and kernel == "hstu_attention_fwd":
        from kernel_templates.cute.config import HSTUCuteFwdConfig as cls  # pure Python; no cutlass import
    elif backend == "cute" and kernel == "hstu_attention_bwd":
        from kernel_templates.cute.bwd_config import HSTUCuteBwdConfig as cls  # pure Python; no cutlass import
    elif backend == "cute" and kernel == "gemm_silu":
        from kernel_templates.gemm_silu.config import GemmSiluConfig as cls  # pure Python; no cutlass import
    if cls is not None:
        try:
            cls.from_dict(config)
        except (TypeError, ValueError) as e:
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
    if entry["dtype"] not in DTYPES:
        raise ArtifactError(f"{where}.dtype must be one of {DTYPES}, got {entry['dtype']!r}")
    if entry["bucket"] not in BUCKETS:
        raise ArtifactError(f"{where}.bucket must be one of {BUCKETS}, got {entry['bucket']!r}")
    if entry["distribution"] not in DISTRIBUTIONS:
        raise ArtifactError(f"{where}.distribution must be one of {DISTRIBUTIONS}, got {entry['distribution']!r}")
    if entry["median_ms"] <= 0 or entry["spread_ms"] < 0 or entry["trials"] < 0:
        raise ArtifactError(f"{where}: median_ms must be > 0, spread_ms and trials >= 0")
    if kernel is not None:
        _validate_config(kernel, entry["backend"], entry["config"], where)


def validate_artifact(data: Any, source: str = "artifact", check_stale: bool = True) -> Artifact:
    """An ``Artifact`` from parsed JSON, or ``ArtifactError`` naming the first problem."""
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
    env_missing = set(ENV_KEYS) - set(data["environment"])
    if env_missing:
        raise ArtifactError(f"{source}: environment lacks {sorted(env_missing)}")
    for backend, h in data["template_hash"].items():
        _check_type(h, (str,), f"{source}: template_hash.{backend}")
    kernel = data["kernel"]
    seen = set()
    for i, entry in enumerate(data["entries"]):
        where = f"{source}: entries[{i}]"
        _validate_entry(entry, where, kernel)
        if entry["backend"] not in data["template_hash"]:
            raise ArtifactError(f"{where}: backend {entry['backend']!r} has no template_hash")
        if entry_key(entry) in seen:
            raise ArtifactError(f"{where}: duplicate entry for {entry_key(entry)}")
        seen.add(entry_key(entry))
    if check_stale:
        for backend in sorted({e["backend"] for e in data["entries"]}):
            current = current_template_hash(kernel, backend)
            if data["template_hash"][backend] != current:
                raise ArtifactError(
                    f"{source}: stale artifact: the {backend} template of {kernel} changed since it was tuned "
                    f"(template_hash {data['template_hash'][backend][:12]}... != current {current[:12]}...); "
                    f"re-run `autotune run --gpu {data['gpu']} --kernel {kernel}`"
                )
    return Artifact(
        kernel=kernel,
        gpu=data["gpu"],
        environment=data["environment"],
        template_hash=data["template_hash"],
        search_space_hash=data["search_space_hash"],
        entries=data["entries"],
        created=data["created"],
        schema_version=version,
    )


def load_artifact(path: str | Path, check_stale: bool = True) -> Artifact:
    """Read and validate an artifact; ``ArtifactError`` for missing, corrupt, invalid or stale files."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read artifact ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: corrupt artifact, not valid JSON ({e})") from None
    return validate_artifact(data, str(path), check_stale)


def load_artifact_or_none(path: str | Path, check_stale: bool = True) -> Artifact | None:
    """``load_artifact``, but a missing file gives None and a bad one a warning and None (fall back to defaults)."""
    if not Path(path).exists():
        return None
    try:
        return load_artifact(path, check_stale)
    except ArtifactError as e:
        warnings.warn(f"ignoring artifact, using heuristic defaults: {e}", RuntimeWarning, stacklevel=2)
        return None


def save_artifact(artifact: Artifact, path: str | Path) -> Path:
    """Validate, then write atomically (temp file in the same directory + os.replace)."""
    path = Path(path)
    data = artifact.to_dict()
    validate_artifact(data, str(path), check_stale=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
