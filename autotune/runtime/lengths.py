"""Sequence lengths of the user's data: read a sample, describe it, tune on batches drawn from it.

``autotune run --lengths FILE`` tunes the jagged entries on representative batches drawn from a
sample of real lengths instead of the synthetic jagged law (``autotune.runtime.buckets``), and
records a descriptor of the sample in each entry. Accepted files:

- ``.npy``: a 1-D integer array of lengths (known by its suffix, in any case, or by its contents), of any size
  (memory-mapped);
- JSON: a list of lengths, a list of batches (lists of lengths), a histogram ``{"512": 30, ...}``,
  or ``{"lengths": [...], "counts": [...]}`` with no other key (a key repeated in one object is refused);
- text (UTF-8, or UTF-16 with a byte-order mark): lengths separated by spaces, commas or newlines (``#``
  starts a comment); in a file of several lines where a line holds more than one length, each non-empty
  line is a batch.

A JSON or text file is read whole, so one over ``MAX_TEXT_BYTES`` (256 MiB) is refused: save such a sample as
an ``.npy`` array or a histogram.

A list of batches (JSON, or text lines) also gives the batch size and whether batches are uniform:
``autotune run --from-model/--from-onnx`` reads them where the graph does not fix those. This module is
the one reader of lengths files: for the grid tasks, the graph tasks and the model's data config
(``models.config.ModelConfig.lengths_file``, whose synthetic batches then draw their lengths from it).

Every length must be a non-negative integer no longer than the largest bucket (32768); the sample
kept must hold at least one non-zero length (past 1M lengths, an evenly strided 1M are kept; a
histogram's are taken from its counts, never expanded). A file holding one length (JSON or text) is a
sample of one. Every error is a ``LengthsError`` that names the file and the bad value.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import BUCKETS

MAX_LENGTH = BUCKETS[-1]
MAX_SAMPLE = 1_000_000  # lengths kept from a larger file (an evenly strided subsample)
MAX_TEXT_BYTES = 256 * 2**20  # a larger JSON or text file is refused (an .npy of any size is read, memory-mapped)


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
    if isinstance(data, dict) and ("lengths" in data or "counts" in data):
        extra = [k for k in data if k not in ("lengths", "counts")]
        if extra or "lengths" not in data:  # a histogram's keys beside them were dropped without a word
            what = f"unknown keys {_show(extra)} beside" if extra else "'counts' without"
            raise LengthsError(
                f'{where}: {what} \'lengths\'; write {{"lengths": [...], "counts": [...]}} or a histogram '
                '{"512": 30, ...}, not both'
            )
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
    # Sample i is the expansion's element floor(i * total / MAX_SAMPLE), in integers: a count of 10**400 (JSON
    # allows 4300 digits) overflows a float.
    out: list[int] = []
    end, taken = 0, 0
    for n, c in zip(values, counts, strict=True):
        end += c
        upto = min(MAX_SAMPLE, -(-end * MAX_SAMPLE // total))  # samples i with i * total / MAX_SAMPLE < end
        out += [n] * (upto - taken)
        taken = upto
    return out


_CHUNK = 1 << 20  # characters of text split into lines at a time
_WORD = re.compile(r"[^\s,]+")  # a length in a line: what str.split() gives once commas are spaces


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` (``str.splitlines``), split a chunk at a time: one list of every line of a large file
    held gigabytes."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK)
        end = len(text) if end < 0 else end + 1
        yield from text[start:end].splitlines()
        start = end


def _int(word: str, where: str) -> int:
    try:
        return int(word)
    except ValueError:
        raise LengthsError(f"{where}: {_show(word)} is not an integer length (not JSON either)") from None


def _parse_text(text: str, where: str) -> tuple[array, list[list[int]] | None]:
    """(lengths, batches or None) of a text file: lengths separated by spaces or commas (``#`` starts a comment),
    each checked as read into one compact array (a list of words per line made a 68 MB file of 12M lengths, one a
    line, take 28 s and 4.4 GB). In a file of several non-empty lines where one holds more than one length, each
    non-empty line is a batch."""
    values, sizes, multi = array("q"), array("q"), False
    for line in _lines(text):
        try:
            words: Iterable[int] = (int(line),)  # one length a line, the common file: no split
        except ValueError:  # no list of words: a line may hold millions
            words = (_int(m.group(), where) for m in _WORD.finditer(line.split("#", 1)[0]))
        count = 0
        for n in words:
            if not 0 <= n <= MAX_LENGTH:
                check_length(n, where)
            values.append(n)
            count += 1
        if count:
            multi = multi or count > 1
            sizes.append(count)
    if not (multi and len(sizes) > 1):
        return values, None
    flat, batches, start = values.tolist(), [], 0
    for size in sizes:
        batches.append(flat[start : start + size])
        start += size
    return values, batches


def read_length_sample(path: str | Path) -> list[int]:
    """The lengths of ``path`` (see the module docstring), validated."""
    return read_lengths_file(path).sample


def read_lengths_file(path: str | Path) -> LengthsFile:
    """The lengths of ``path`` and its batches when it lists some (see the module docstring), validated."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a lengths file path (str or os.PathLike), got {type(path).__name__}")
    if isinstance(path, str) and not path.strip():  # Path("") is the working directory
        raise LengthsError(f"--lengths {path!r}: an empty path; name a lengths file")
    path = Path(path)
    where = f"--lengths {path}"
    if path.is_dir():
        raise LengthsError(f"{where}: is a directory; pass a lengths file")
    # A FIFO (`<(cmd)`) or a device was "no such file"; a pipe also cannot give the two reads below (the format
    # sniff of _is_numpy, then the parse).
    if path.exists() and not path.is_file():
        raise LengthsError(f"{where}: not a regular file (a pipe or device?); save the lengths to a file first")
    if not path.is_file():
        raise LengthsError(f"{where}: no such file")
    counts: list[int] | None = None
    batches: list[list[int]] | None = None
    if _is_numpy(path):
        raw, total = _read_npy(path, where)
    else:
        raw, counts, batches = _read_text(path, where)  # every length checked
        total = len(raw) if counts is None else sum(counts)
    raw = list(_subsample(raw)) if counts is None else _expand(raw, counts)
    if not any(raw):  # checked on the sample kept: a subsample of zeros would tune on no real length
        kept = f" (the {len(raw)} lengths kept of its {total}, evenly strided)" if total > len(raw) else ""
        raise LengthsError(f"{where}: no non-zero length in the sample{kept}")
    if batches is not None and not all(batches):
        raise LengthsError(f"{where}: batch {[len(b) for b in batches].index(0)} is empty")
    return LengthsFile(raw, batches)


def check_length(n: Any, where: str) -> None:
    """A non-negative integer no longer than the largest bucket, else a ``LengthsError`` naming it."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise LengthsError(f"{where}: length {_show(n)} is not an integer")
    if n < 0:
        raise LengthsError(f"{where}: negative length {n}")
    if n > MAX_LENGTH:
        raise LengthsError(f"{where}: length {n} is longer than the largest bucket ({MAX_LENGTH})")


def _is_numpy(path: Path) -> bool:
    """Whether ``path`` holds NumPy data: by its suffix in any case (``L.NPY``, ``.npz``) or by its magic bytes
    (an ``np.save`` file under another name), so a binary array is never decoded as text and called garbage."""
    if path.suffix.lower() in (".npy", ".npz"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(6).startswith((b"\x93NUMPY", b"PK\x03\x04"))
    except OSError:
        return False  # the text reader names the problem


def _read_npy(path: Path, where: str) -> tuple[list[Any], int]:
    """(lengths, how many the file holds) of a 1-D integer ``.npy`` array, range-checked and strided to
    ``MAX_SAMPLE`` in NumPy before they become Python ints (``tolist`` of 20M lengths took 10 s and 840 MB).
    The array is memory-mapped, not loaded: a file larger than the host's memory is read a page at a time."""
    import numpy as np

    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any failure to read it (truncated, pickled, not numpy) is the file's
        raise LengthsError(f"{where}: not a readable .npy array ({type(e).__name__}: {e})") from None
    if not isinstance(arr, np.ndarray):
        arr.close()
        raise LengthsError(f"{where}: not a .npy array (an .npz archive?); save one 1-D array with np.save")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise LengthsError(f"{where}: expected a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
    if len(arr) and (arr.min() < 0 or arr.max() > MAX_LENGTH):
        check_length(int(arr[((arr < 0) | (arr > MAX_LENGTH)).argmax()]), where)  # the first bad one
    return (arr[_strided(len(arr))] if len(arr) > MAX_SAMPLE else arr).tolist(), len(arr)


def _read_text(path: Path, where: str) -> tuple[list[Any], list[int] | None, list[list[int]] | None]:
    """(lengths, counts or None, batches or None) of a JSON or text file."""
    try:
        size = path.stat().st_size
        if size > MAX_TEXT_BYTES:  # parsed as a whole, it took gigabytes of memory
            raise LengthsError(
                f"{where}: the file is {size / 2**20:.0f} MiB, over the {MAX_TEXT_BYTES // 2**20} MiB a JSON or "
                "text lengths file may be; save the lengths as a 1-D .npy array (np.save) or as a histogram"
            )
        text = _decode(path.read_bytes())
    except (OSError, UnicodeDecodeError) as e:
        raise LengthsError(f"{where}: cannot read it as text ({e})") from None
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, where))
    except json.JSONDecodeError:
        values, batches = _parse_text(text, where)
        return values, None, batches
    except LengthsError:
        raise
    except (ValueError, RecursionError) as e:  # an int of > 4300 digits, nesting deeper than the stack
        raise LengthsError(f"{where}: JSON not readable ({type(e).__name__}: {_show(str(e), 120)})") from None
    raw, counts = _from_json(data, where)
    for n in raw:
        check_length(n, where)
    return raw, counts, _batches_json(data)


def _unique_keys(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    """A JSON object whose keys are all distinct: ``json`` keeps the last of a repeated key, so a histogram
    ``{"512": 3, "512": 5}`` silently lost the first count."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise LengthsError(f"{where}: key {_show(key)} appears twice in one JSON object")
        out[key] = value
    return out


def _decode(data: bytes) -> str:
    """UTF-8 text, or UTF-16 when it starts with that byte-order mark (Windows PowerShell's ``>``); a UTF-8 BOM
    (Notepad, PowerShell's ``-Encoding UTF8``) is dropped: left in, it turns valid JSON into "not an integer"."""
    return data.decode("utf-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8-sig")


def _strided(size: int) -> list[int]:
    """Indices of the evenly strided ``MAX_SAMPLE`` subsample of ``size`` (> ``MAX_SAMPLE``) items."""
    step = size / MAX_SAMPLE
    return [int(i * step) for i in range(MAX_SAMPLE)]


def _subsample(raw: list[int] | array) -> list[int] | array:
    """``raw``, or its evenly strided ``MAX_SAMPLE`` subsample when longer."""
    return [raw[i] for i in _strided(len(raw))] if len(raw) > MAX_SAMPLE else raw


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
