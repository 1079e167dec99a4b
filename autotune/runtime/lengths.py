"""Sequence lengths of the user's data: read a sample, describe it, tune on batches drawn from it.

``autotune run --lengths FILE`` tunes the jagged entries on representative batches drawn from a
sample of real lengths instead of the synthetic jagged law (``autotune.runtime.buckets``), and
records a descriptor of the sample in each entry. Accepted files:

- ``.npy``: a 1-D integer array of lengths;
- JSON: a list of lengths, a list of batches (lists of lengths), a histogram ``{"512": 30, ...}``,
  or ``{"lengths": [...], "counts": [...]}``;
- text: lengths separated by spaces, commas or newlines (``#`` starts a comment); in a file of several
  lines where a line holds more than one length, each non-empty line is a batch.

A list of batches (JSON, or text lines) also gives the batch size and whether batches are uniform:
``autotune run --from-model/--from-onnx`` reads them where the graph does not fix those. This module is
the one reader of lengths files: for the grid tasks, the graph tasks and the model's data config
(``models.config.ModelConfig.lengths_file``, whose synthetic batches then draw their lengths from it).

Every length must be a non-negative integer no longer than the largest bucket (32768); the sample
must hold at least one non-zero length; a histogram whose counts add up past 1M is subsampled from its
counts. A file holding one length (JSON or text) is a sample of one. Every error is a ``LengthsError``
that names the file and the bad value.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import BUCKETS

MAX_LENGTH = BUCKETS[-1]
MAX_SAMPLE = 1_000_000  # lengths kept from a larger file (an evenly strided subsample)


class LengthsError(ValueError):
    """A lengths file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class LengthsFile:
    """What a lengths file holds: every length (``sample``) and, when the file lists batches, those."""

    sample: list[int]
    batches: list[list[int]] | None = None

    @property
    def uniform(self) -> bool:
        """Every batch's sequences equally long (a flat sample: one length only)."""
        if self.batches is not None:
            return all(min(b) == max(b) for b in self.batches)
        return min(self.sample) == max(self.sample)

    @property
    def batch(self) -> int | None:
        """The largest batch of the file, None for a flat sample."""
        return max(len(b) for b in self.batches) if self.batches else None


def _batches_json(data: Any) -> list[Any] | None:
    if isinstance(data, list) and data and all(isinstance(b, list) for b in data):
        return data
    return None


def _show(value: Any, limit: int = 60) -> str:
    """A value for an error message, cut to ``limit`` characters (a bad value may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _from_json(data: Any, where: str) -> tuple[list[Any], list[int] | None]:
    """(lengths, counts per length or None) of parsed JSON."""
    if isinstance(data, dict) and "lengths" in data:
        lengths, counts = data["lengths"], data.get("counts")
        if not isinstance(lengths, list):
            raise LengthsError(f"{where}: 'lengths' must be a list of lengths, got {_show(lengths)}")
        if counts is None:
            return list(lengths), None
        if not isinstance(counts, list) or len(counts) != len(lengths):
            raise LengthsError(f"{where}: 'counts' must be a list as long as 'lengths'")
        return list(lengths), [_count(c, where) for c in counts]
    if isinstance(data, dict):  # histogram {"length": count}
        values, counts = [], []
        for k, c in data.items():
            try:
                n = int(k)
            except ValueError:
                raise LengthsError(f"{where}: histogram key {_show(k)} is not an integer length") from None
            values.append(n)
            counts.append(_count(c, where))
        return values, counts
    batches = _batches_json(data)
    if batches is not None:
        return [n for b in batches for n in b], None
    if isinstance(data, list):
        return data, None
    if isinstance(data, int) and not isinstance(data, bool):  # a file holding one length: a sample of one
        return [data], None
    raise LengthsError(f"{where}: expected a list, a list of lists or a histogram object, got {_show(data)}")


def _count(c: Any, where: str) -> int:
    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
        raise LengthsError(f"{where}: histogram count {_show(c)} is not a non-negative integer")
    return c


def _expand(values: list[int], counts: list[int]) -> list[int]:
    """``values[i]`` repeated ``counts[i]`` times, or, past ``MAX_SAMPLE`` in all, the evenly strided
    subsample of that expansion, built from the counts (a count of 3e9 is never expanded)."""
    total = sum(counts)
    if total <= MAX_SAMPLE:
        return [n for n, c in zip(values, counts, strict=True) for _ in range(c)]
    step = total / MAX_SAMPLE  # sample i is the expansion's element int(i * step)
    out: list[int] = []
    end, taken = 0, 0
    for n, c in zip(values, counts, strict=True):
        end += c
        upto = min(MAX_SAMPLE, math.ceil(end / step))  # samples i with i * step < end
        out += [n] * (upto - taken)
        taken = upto
    return out


def _text_lines(text: str) -> list[list[str]]:
    """The words of each non-empty line (``#`` starts a comment; commas separate like spaces)."""
    lines = [ln.split("#")[0].replace(",", " ").split() for ln in text.splitlines()]
    return [ln for ln in lines if ln]


def _ints(words: list[str], where: str) -> list[int]:
    out = []
    for w in words:
        try:
            out.append(int(w))
        except ValueError:
            raise LengthsError(f"{where}: {_show(w)} is not an integer length (not JSON either)") from None
    return out


def read_length_sample(path: str | Path) -> list[int]:
    """The lengths of ``path`` (see the module docstring), validated."""
    return read_lengths_file(path).sample


def read_lengths_file(path: str | Path) -> LengthsFile:
    """The lengths of ``path`` and its batches when it lists some (see the module docstring), validated."""
    path = Path(path)
    where = f"--lengths {path}"
    if not path.is_file():
        raise LengthsError(f"{where}: no such file")
    counts: list[int] | None = None
    if path.suffix == ".npy":
        import numpy as np

        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any failure to read it (truncated, pickled, not numpy) is the file's
            raise LengthsError(f"{where}: not a readable .npy array ({type(e).__name__}: {e})") from None
        if not isinstance(arr, np.ndarray):
            arr.close()
            raise LengthsError(f"{where}: not a .npy array (an .npz archive?); save one 1-D array with np.save")
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise LengthsError(f"{where}: expected a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
        raw: list[Any] = arr.tolist()
        batches = None
    else:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise LengthsError(f"{where}: cannot read it as text ({e})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            rows = [_ints(ln, where) for ln in _text_lines(text)]
            raw = [n for row in rows for n in row]
            batches = rows if len(rows) > 1 and any(len(row) > 1 for row in rows) else None
        except (ValueError, RecursionError) as e:  # an int of > 4300 digits, nesting deeper than the stack
            raise LengthsError(f"{where}: JSON not readable ({type(e).__name__}: {_show(str(e), 120)})") from None
        else:
            raw, counts = _from_json(data, where)
            batches = _batches_json(data)
    for n in raw:
        if isinstance(n, bool) or not isinstance(n, int):
            raise LengthsError(f"{where}: length {_show(n)} is not an integer")
        if n < 0:
            raise LengthsError(f"{where}: negative length {n}")
        if n > MAX_LENGTH:
            raise LengthsError(f"{where}: length {n} is longer than the largest bucket ({MAX_LENGTH})")
    if counts is not None:
        raw = _expand(raw, counts)
    if not any(raw):
        raise LengthsError(f"{where}: no non-zero length in the sample")
    if batches is not None and not all(batches):
        raise LengthsError(f"{where}: batch {[len(b) for b in batches].index(0)} is empty")
    if len(raw) > MAX_SAMPLE:
        step = len(raw) / MAX_SAMPLE
        raw = [raw[int(i * step)] for i in range(MAX_SAMPLE)]
    return LengthsFile(raw, batches)


def compact(sample: list[int], n: int = 4096) -> tuple[int, ...]:
    """At most ``n`` evenly spaced quantiles of the sample: the same distribution, small enough to
    travel with every task to the tuner's workers."""
    s = sorted(sample)
    if len(s) <= n:
        return tuple(s)
    return tuple(s[round(i * (len(s) - 1) / (n - 1))] for i in range(n))


def describe(sample: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """What an artifact entry records of the sample it was tuned on (a digest and quantiles)."""
    s = sorted(sample)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1)))]  # noqa: E731
    digest = hashlib.sha256(json.dumps(s).encode()).hexdigest()[:16]
    return {"sha256_16": digest, "count": len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1],
            "mean": round(sum(s) / len(s), 1)}  # fmt: skip
