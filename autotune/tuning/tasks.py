"""Tuning tasks: (kernel, GPU, dtype, head dims, heads, bucket, length distribution, mask features).

A task is what one Optuna study tunes and what one artifact entry records. Its representative batch
is deterministic (``sequence_lengths`` from the seed), so a resumed study measures the same inputs.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import (
    BUCKETS,
    DISTRIBUTIONS,
    MAX_BATCH,
    MAX_HEADS,
    format_bucket,
    sample_lengths,
    sequence_lengths,
)
from autotune.runtime.gpus import get_gpu

DTYPES = ("bfloat16", "float16", "float32")
# Mask features: name -> (contextual_seq_len, targets per sequence as a fraction of its length, window as a
# fraction of the longest sequence). Each feature is a separate template specialisation (constexpr).
MASKS: dict[str, tuple[int, float, float]] = {
    "causal": (0, 0.0, 0.0),
    "targets": (0, 0.05, 0.0),
    "context": (8, 0.0, 0.0),
    "context+targets": (8, 0.05, 0.0),
    "window": (0, 0.0, 0.25),
}


def family_key(
    kernel: str, gpu: str, dtype: str, dqk: int, dv: int, num_heads: int, distribution: str, mask: str
) -> tuple:
    """Key of a task family (everything but the bucket), for tasks and for artifact entries alike."""
    return (kernel, gpu, dtype, dqk, dv, num_heads, distribution, mask)


def split_heads(family: tuple) -> tuple[tuple, int]:
    """(the ``family_key`` without its head count, the head count): families equal but for heads."""
    return family[:5] + family[6:], family[5]


def _check_sample(sample: Any) -> None:
    """A task's lengths sample as a lengths file gives one: a tuple of int lengths in [0, MAX_LENGTH], one of them
    non-zero. An empty one (a task read back from a farm's storage) tuned the whole study, then failed to describe
    the sample in its entry (an IndexError); a list made the task unhashable."""
    from autotune.runtime.lengths import MAX_LENGTH

    if not isinstance(sample, tuple):
        raise ValueError(f"sample must be a tuple of lengths or None, got {type(sample).__name__}")
    bad = next((n for n in sample if type(n) is not int or not 0 <= n <= MAX_LENGTH), None)
    if bad is not None:
        raise ValueError(f"sample lengths must be ints in [0, {MAX_LENGTH}], got {bad!r:.40}")
    if not any(sample):
        raise ValueError("sample must hold at least one non-zero length")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class Task:
    """One tuning task. ``seq_cap`` (tests/CI only) caps the real lengths below the bucket."""

    kernel: str
    gpu: str
    dtype: str
    dqk: int
    dv: int
    num_heads: int
    bucket: int
    distribution: str
    mask: str = "causal"
    batch: int = 32
    seq_cap: int | None = None
    seed: int = 0
    sample: tuple[int, ...] | None = None  # real lengths (``--lengths FILE``): batches drawn from them

    def __post_init__(self) -> None:
        if self.bucket not in BUCKETS:
            raise ValueError(f"bucket {self.bucket} is not one of {BUCKETS}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution {self.distribution!r} is not one of {DISTRIBUTIONS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.mask not in MASKS:
            raise ValueError(f"mask {self.mask!r} is not one of {tuple(MASKS)}")
        for name, value, high in (("batch", self.batch, MAX_BATCH), ("num_heads", self.num_heads, MAX_HEADS)):
            if not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if not 1 <= value <= high:
                raise ValueError(f"{name} must be in [1, {high}], got {value}")
        # A zero head dim made empty inputs every config passed; a zero cap was no cap (the whole bucket).
        for name in ("dqk", "dv", "seq_cap"):
            value = getattr(self, name)
            if (value is not None or name != "seq_cap") and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.sample is not None:
            _check_sample(self.sample)
            if self.distribution != "jagged":
                raise ValueError("a task tuned on a lengths sample is a 'jagged' task")

    @property
    def max_len(self) -> int:
        """The longest sequence of the representative batch (= bucket unless capped)."""
        return min(self.bucket, self.seq_cap) if self.seq_cap else self.bucket

    @property
    def mask_features(self) -> tuple[int, float, float]:
        """(contextual_seq_len, target fraction, window fraction) of the task's mask: what op adapters read."""
        return MASKS[self.mask]

    def lengths(self) -> list[int]:
        if self.sample is not None:
            return sample_lengths(self.sample, self.max_len, self.batch, self.seed)
        return sequence_lengths(self.max_len, self.batch, self.distribution, self.seed)

    @property
    def sample_digest(self) -> str | None:
        """Short digest of the lengths sample (in the study name: another sample, another study)."""
        if self.sample is None:
            return None
        import hashlib
        import json

        return hashlib.sha256(json.dumps(sorted(self.sample)).encode()).hexdigest()[:12]

    @property
    def family(self) -> tuple:
        """Everything but the bucket: tasks of one family warm-start each other."""
        return self.family_on(self.distribution)

    def family_on(self, distribution: str) -> tuple:
        """The family of this task's shape tuned on another length law (``family_key``)."""
        return family_key(self.kernel, self.gpu, self.dtype, self.dqk, self.dv, self.num_heads, distribution, self.mask)

    @property
    def study_name(self) -> str:
        cap = f"-cap{self.seq_cap}" if self.seq_cap else ""
        cap += f"|lengths{self.sample_digest}" if self.sample is not None else ""
        return (
            f"{self.kernel}|{self.dtype}|dqk{self.dqk}|dv{self.dv}|h{self.num_heads}|b{self.batch}"
            f"|{format_bucket(self.bucket)}{cap}|{self.distribution}|{self.mask}|seed{self.seed}"
        )

    def label(self) -> str:
        return (
            f"{self.kernel} {self.dtype} d{self.dqk}/{self.dv} h{self.num_heads} "
            f"{format_bucket(self.bucket)} {self.distribution} {self.mask}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        d = dict(d)
        if d.get("sample") is not None:
            d["sample"] = tuple(d["sample"])
        return cls(**d)


def space_context(task: Task, interpret: bool) -> Any:
    """The feasibility context (GPU facts, dtype, head dims, longest sequence) of a task."""
    from search_spaces.base import SpaceContext

    return SpaceContext(get_gpu(task.gpu), task.dtype, task.dqk, task.dv, task.max_len, interpret, task.num_heads)


_DIMS = re.compile(r"([0-9]+)\s*(?:x\s*([0-9]+))?")


def parse_dims(text: str) -> list[tuple[int, int]]:
    """'256,128' -> [(256, 256), (128, 128)]; '128x64' -> (dqk=128, dv=64)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        m = _DIMS.fullmatch(part)
        dqk, dv = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
        if min(dqk, dv) < 1:
            raise ValueError(f"bad head dims {part!r}: use positive integers, e.g. 256 or 128x64")
        out.append((dqk, dv))
    if not out:
        raise ValueError("no head dims given")
    return out


def build_tasks(
    kernels: list[str],
    gpu: str,
    dtype: str,
    dims: list[tuple[int, int]],
    heads: int,
    buckets: list[int],
    distributions: list[str],
    masks: list[str],
    batch: int,
    seq_cap: int | None = None,
    seed: int = 0,
    sample: tuple[int, ...] | None = None,
) -> list[Task]:
    """All tasks, ordered so that buckets of one family run in ascending order (neighbour warm starts).
    With a lengths ``sample`` the jagged tasks draw their batches from it. A value named twice (``1K,1024``,
    ``128,128``) is one task: the same study tuned twice would only spend the budget twice."""
    tasks = [
        Task(
            kernel,
            gpu,
            dtype,
            dqk,
            dv,
            heads,
            bucket,
            dist,
            mask,
            batch,
            seq_cap,
            seed,
            sample if dist == "jagged" else None,
        )  # fmt: skip
        for kernel in kernels
        for dqk, dv in dims
        for mask in masks
        for dist in distributions
        for bucket in sorted(buckets)
    ]
    return list(dict.fromkeys(tasks))


def tasks_from_artifact(
    kernels: list[str],
    gpu: str,
    root: str | Path,
    batch: int,
    seq_cap: int | None = None,
    sample: tuple[int, ...] | None = None,
    force_batch: bool = False,
) -> list[Task]:
    """One task per entry of each kernel's artifact for ``gpu`` under ``root`` (a stale one too: after a source
    edit the same entries are measured again), in ``build_tasks``' order. An entry tuned on a lengths sample
    needs that ``sample`` back (``--lengths``): its digest is checked, since other lengths are another task.

    Each task times the batch size its entry records (a re-measure at another batch is another measurement);
    ``batch`` serves entries that record none (written before entries did), or every entry with ``force_batch``
    (the user asked for that batch)."""
    from autotune.runtime import artifacts as art
    from autotune.runtime.lengths import describe

    tasks = []
    for kernel in kernels:
        path = art.artifact_path(gpu, kernel, root)
        if not path.exists():
            raise ValueError(f"no artifact {path} to take the tasks from")
        for e in art.load_artifact(path, check_stale=False).entries:
            lengths = e.get("lengths")
            t = Task(
                kernel, gpu, e["dtype"], e["dqk"], e["dv"], e["num_heads"], e["bucket"], e["distribution"],
                e["mask"], batch if force_batch else e.get("batch", batch), seq_cap, 0,
                sample if lengths is not None else None,
            )  # fmt: skip
            if lengths is not None and (sample is None or describe(sample)["sha256_16"] != lengths.get("sha256_16")):
                raise ValueError(
                    f"{path}: the entry {t.label()} was tuned on a lengths sample"
                    f" (sha256 {lengths.get('sha256_16', '?')}); pass that sample with --lengths (a model's own"
                    " sample: write it with `autotune tasks --from-model/--from-onnx ... --lengths-out FILE`)"
                )
            tasks.append(t)
    order = {k: i for i, k in enumerate(kernels)}
    tasks.sort(key=lambda t: (order[t.kernel], t.dqk, t.dv, t.num_heads, t.mask, t.distribution, t.bucket))
    return list(dict.fromkeys(tasks))


_SHARD = re.compile(r"([0-9]+)/([0-9]+)")


def parse_shard(spec: str) -> tuple[int, int]:
    """(K, N) of a shard spec "K/N": ASCII digits only, 1 <= K <= N (shards are 1-based), no spaces or signs."""
    m = _SHARD.fullmatch(spec)
    k, n = (int(m[1]), int(m[2])) if m else (0, 0)
    if not 1 <= k <= n:
        raise ValueError(f"shard must be K/N with integers 1 <= K <= N, got {spec!r}")
    return k, n


def shard(tasks: list[Task], spec: str) -> list[Task]:
    """The tasks of families ``K``, ``K + N``, ... (1-based, in the list's order) for ``spec`` = "K/N": one
    device call's share of a long run. Families stay whole (a family's buckets warm-start each other in order),
    so a shard past the family count is empty."""
    k, n = parse_shard(spec)
    families = list(dict.fromkeys(t.family for t in tasks))
    mine = set(families[k - 1 :: n])
    return [t for t in tasks if t.family in mine]
