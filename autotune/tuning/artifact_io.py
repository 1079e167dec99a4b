"""What a tuning run reads from and writes to the artifacts: warm starts from the winners they record,
and the locked merge of new entries (many tuners may write one file).

Apart from ``tuner.py`` (the search itself), so the farm, the CLI's ``merge`` and the tuner share one
reading of recorded winners and one writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from autotune.runtime import artifacts as art
from autotune.runtime.buckets import DISTRIBUTIONS, neighbours
from autotune.tuning.registry import backends_for
from autotune.tuning.tasks import Task, family_key, split_heads

# What makes two timings comparable besides the code: the device and the software stack that ran it.
TIMING_ENV_KEYS = ("gpu_name", "compute_capability", "sm_count", "driver", "cuda", "torch", "triton", "cutlass_dsl")


def search_space_hash(kernel: str) -> str:
    """One hash over every registered backend's space of ``kernel``."""
    parts = [f"{b.name}:{b.space.hash()}" for b in backends_for(kernel, available_only=False)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class EnvironmentMismatch(ValueError):
    """Merging would drop the entries of an artifact tuned in another timing environment."""


def environment_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The timing-environment keys whose values differ between two ``environment`` blocks, described."""
    return [f"{k} {a.get(k)!r} != {b.get(k)!r}" for k in TIMING_ENV_KEYS if a.get(k) != b.get(k)]


@contextlib.contextmanager
def artifact_lock(path: Path) -> Iterator[None]:
    """The exclusive lock every writer of the artifact ``path`` holds from its re-read to its write (its folder must
    exist): a tuning run, a farm worker, ``autotune merge`` and ``autotune verify --write`` never lose another's
    entries."""
    import fcntl

    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def merge_entries(
    kernel: str,
    gpu: str,
    entries: list[dict[str, Any]],
    root: Path,
    env: dict[str, Any],
    replace: bool = True,
) -> Path:
    """Upsert ``entries`` into artifacts/<gpu>/<kernel>.json without lost updates.

    Many tuners (farm workers, two runs) write one file: under an exclusive ``fcntl`` lock the file is
    re-read, merged and replaced atomically, so no writer overwrites another's entries. Entries of an
    artifact written in another timing environment (GPU, SMs, driver, versions) are dropped with a
    warning instead of being relabelled with this one, the old file kept aside (``replace=False``:
    ``EnvironmentMismatch`` and nothing written); a stale or invalid file is replaced, its old content kept aside
    too (``keep_aside``).
    """
    # Both names become path parts: checked before anything is created ('../..' would escape ``root``).
    if not isinstance(gpu, str) or not art.is_gpu_key(gpu):
        raise ValueError(f"gpu must be a lower-case GPU key such as 'h100', got {gpu!r:.60}")
    backends = backends_for(kernel, available_only=False)  # ValueError for a kernel no op spec declares
    path = art.artifact_path(gpu, kernel, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with artifact_lock(path):
        existing = None
        if os.path.lexists(path):
            try:
                existing = art.load_artifact(path)
            except art.ArtifactError as e:
                warnings.warn(f"replacing unusable artifact: {e}; {keep_aside(path)}", RuntimeWarning, stacklevel=3)
        if existing is not None and (existing.kernel, existing.gpu) != (kernel, gpu):
            # Another kernel's (or GPU's) file under this name: dispatch rejects it, its entries are not ours.
            what = f"kernel {existing.kernel!r} of gpu {existing.gpu!r}, not {kernel!r} of {gpu!r}"
            warnings.warn(
                f"replacing unusable artifact: {path} holds {what}; {keep_aside(path)}", RuntimeWarning, stacklevel=3
            )
            existing = None
        hashes = {b.name: art.current_template_hash(kernel, b.name) for b in backends}
        artifact = art.Artifact(kernel, gpu, env, hashes, search_space_hash(kernel))
        if existing is not None:
            differ = environment_differences(existing.environment, env)
            if differ and existing.entries:
                what = f"{len(existing.entries)} entries of {path} tuned in another environment ({', '.join(differ)})"
                if not replace:
                    raise EnvironmentMismatch(f"merging would drop {what}")
                # Kept aside as an invalid file is: a run after a torch or driver update wrote one new entry and
                # every tuned entry of the file was gone, the warning the only trace.
                warnings.warn(f"dropping {what}; {keep_aside(path)}", RuntimeWarning, stacklevel=3)
            else:
                artifact.entries = list(existing.entries)
        for entry in entries:
            artifact.upsert(entry)
        return art.save_artifact(artifact, path)


def keep_aside(path: Path) -> str:
    """Copy an unusable artifact that a write replaces to ``<kernel>.json.unusable-<UTC time>`` (no ``*.json``: load,
    show and verify ignore it) and say where: a hand-edit typo in one entry made the file invalid, and replacing it
    dropped every other entry with it. A copy, not a rename: the write's atomic replace swaps the new content in,
    so a write that then fails (an invalid entry, a full disk) leaves the old file in place, and a concurrent load
    never finds no file."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    aside = path.with_name(f"{path.name}.unusable-{stamp}")
    shutil.copy2(path, aside)
    return f"its old content is kept as {aside}"


def completed_hints(values: dict[str, Any], choices: dict[str, tuple], cap: int = 4) -> list[dict[str, Any]]:
    """A warm start from before some tunables existed, completed once per choice of the missing ones (the
    old winner under each value of the new knob, at most ``cap``); a complete one is returned as it is."""
    missing = [p for p in choices if p not in values]
    combos = itertools.islice(itertools.product(*(choices[p] for p in missing)), cap)
    return [{**values, **dict(zip(missing, c, strict=True))} for c in combos]


WARM_START_SCOPES = ("all", "own")


def warm_starts_for(
    task: Task, winners: dict[tuple, dict[int, tuple[str, dict]]], scope: str = "all"
) -> list[tuple[str, dict]]:
    """The bucket's own last winner (a re-tune starts from it), its neighbours' winners, the same
    bucket's winners on the other length laws, then its winners at other head counts (nearest first).
    A study of a skewed law or a new head count then measures what dispatch ran on such calls before
    it (the nearest entry), so its entry is at least as fast there. ``scope="own"`` keeps the bucket's
    own last winner only: a re-measure after a change that leaves the device code as it was (the default
    and that winner, compared again), which costs a fraction of the compiles and timings on long buckets."""
    if scope not in WARM_START_SCOPES:
        raise ValueError(f"scope must be one of {WARM_START_SCOPES}, got {scope!r}")
    fam = winners.get(task.family, {})
    if scope == "own":
        return [fam[task.bucket]] if task.bucket in fam else []
    hints = [fam.get(b) for b in (task.bucket, *neighbours(task.bucket))]
    for other in DISTRIBUTIONS:
        if other != task.distribution:
            hints.append(winners.get(task.family_on(other), {}).get(task.bucket))
    hints += [winners[f].get(task.bucket) for f in _other_heads(task, winners)]
    starts: list[tuple[str, dict]] = []
    for hint in hints:
        if hint is not None and hint not in starts:
            starts.append(hint)
    return starts


def _other_heads(task: Task, winners: dict[tuple, dict[int, tuple[str, dict]]]) -> list[tuple]:
    """Families of ``task``'s shape, law and mask at other head counts, nearest head count first."""
    shape, heads = split_heads(task.family)
    others = [(h, f) for f in winners for s, h in [split_heads(f)] if s == shape and h != heads]
    return [f for _, f in sorted(others, key=lambda hf: (abs(math.log2(hf[0] / heads)), hf[0]))]


def artifact_winners(tasks: list[Task], root: Path) -> dict[tuple, dict[int, tuple[str, dict]]]:
    """Winners recorded in existing artifacts, keyed by task family then bucket (warm starts).

    Stale artifacts count too: their configs are only hints, enqueued and re-measured on the current
    templates (configs the current space rejects are dropped by ``_Study.enqueue``), and a re-tune after
    a template edit is exactly when the last winners are the best first guesses. Configs are read as
    written, so a winner from before a new tunable is completed by ``completed_hints``, not dropped."""
    out: dict[tuple, dict[int, tuple[str, dict]]] = {}
    for kernel, gpu in sorted({(t.kernel, t.gpu) for t in tasks}):
        a = art.load_artifact_or_none(art.artifact_path(gpu, kernel, root), check_stale=False, check_configs=False)
        for e in a.entries if a else []:
            fam = family_key(kernel, gpu, e["dtype"], e["dqk"], e["dv"], e["num_heads"], e["distribution"], e["mask"])
            out.setdefault(fam, {})[e["bucket"]] = (e["backend"], dict(e["config"]))
    return out
