"""Sequence-length buckets and the representative length distributions each bucket is tuned on.

Contract (docs/CONTRACTS.md): buckets are the powers of two 256 .. 32768 and ``bucket_for`` maps a
batch's max_seq_len to the smallest bucket >= it, clamped. A bucket is tuned on a declared length
distribution, because the best tiles of a skewed jagged batch differ from those of uniform lengths.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import random

from kernel_templates.grid_limits import GRID_X_MAX, GRID_YZ_MAX

BUCKETS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DISTRIBUTIONS: tuple[str, ...] = ("uniform", "jagged", "sparse")
JAGGED_EXPONENT = 3.0  # lengths = bucket * u**3: median ~bucket/8, mean ~bucket/4, tail up to bucket
SPARSE_DIVISOR = 8  # sparse: the jagged law's lengths / 8 beside one full-length sequence
# The most sequences a task's batch may hold: the CuTe attention kernels' grid order puts the batch in the
# launch grid's y dimension (``GRID_YZ_MAX``); a larger batch could not launch every config the task
# measures (and its lengths alone would take minutes to draw).
MAX_BATCH = GRID_YZ_MAX
# The most heads: the Triton attention grids put batch x heads in x, which any batch up to ``MAX_BATCH``
# times this many heads fits.
MAX_HEADS = GRID_X_MAX // MAX_BATCH


def bucket_for(max_seq_len: int) -> int:
    """The smallest bucket >= max_seq_len, clamped to [BUCKETS[0], BUCKETS[-1]]."""
    # NaN compared False with every bucket (-> the largest), and a negative length fell in the smallest.
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, numbers.Integral) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a non-negative int, got {max_seq_len!r}")
    for b in BUCKETS:
        if max_seq_len <= b:
            return b
    return BUCKETS[-1]


def parse_bucket(text: str) -> int:
    """'4K', '4k', '4096' -> 4096; ValueError unless it is one of BUCKETS."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise ValueError(f"bad bucket {text!r}: use e.g. 1K, 4096") from None
    # Compared unrounded: '4.0001K' is not 4096 (int() would truncate it to that), 'infK' is no bucket (int() raised
    # OverflowError, not this ValueError).
    if value not in BUCKETS:
        raise ValueError(f"bucket {text!r} is not one of {', '.join(format_bucket(b) for b in BUCKETS)}")
    return int(value)


def format_bucket(bucket: int) -> str:
    return f"{bucket // 1024}K" if bucket >= 1024 and bucket % 1024 == 0 else str(bucket)


def neighbours(bucket: int) -> tuple[int, ...]:
    """Buckets next to ``bucket`` (their winners warm-start its study)."""
    i = BUCKETS.index(bucket)
    return tuple(BUCKETS[j] for j in (i - 1, i + 1) if 0 <= j < len(BUCKETS))


def sequence_lengths(max_len: int, batch: int, distribution: str, seed: int) -> list[int]:
    """Deterministic lengths of a representative batch whose longest sequence is exactly ``max_len``.

    ``uniform``: every length = max_len. ``jagged``: heavy-tailed, ``ceil(max_len * u**3)`` with
    u ~ U(0, 1) from ``seed``, and one sequence (at a seeded position) of length max_len. ``sparse``:
    the same law with lengths divided by ``SPARSE_DIVISOR`` beside the one full-length sequence, so
    the batch's work is mostly that sequence's (fill ~0.06 at batch 32, against ~0.25 for ``jagged``):
    tiles there are bound by the longest sequence's critical path, not by the batch's total work.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")
    max_len, batch = _sizes(max_len, batch)
    if distribution == "uniform":
        return [max_len] * batch
    rng = random.Random(f"{seed}:{max_len}:{batch}")
    scale = max_len / (SPARSE_DIVISOR if distribution == "sparse" else 1)
    lengths = [max(1, min(max_len, math.ceil(scale * rng.random() ** JAGGED_EXPONENT))) for _ in range(batch)]
    lengths[rng.randrange(batch)] = max_len
    return lengths


def _sizes(max_len: int, batch: int) -> tuple[int, int]:
    """(max_len, batch) as plain ints (NumPy's taken), else a ValueError naming the one that is no integer >= 1:
    a float, NaN or bool came back as lengths ([nan] * batch, [1024.0, ...], [True, True]) no kernel launch takes."""
    out = []
    for name, value in (("max_len", max_len), ("batch", batch)):
        try:
            n = operator.index(value) if not isinstance(value, bool) else 0
        except TypeError:
            n = 0
        if n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        out.append(n)
    return out[0], out[1]


def batch_fill(lengths: list[int], max_len: int) -> float:
    """L / (B x max_len): the share of a padded batch that holds tokens (what dispatch matches on)."""
    return sum(lengths) / (len(lengths) * max_len) if lengths and max_len else 0.0


@functools.cache
def law_fill(bucket: int, distribution: str = "jagged", batch: int = 32, seed: int = 0) -> float:
    """The fill of a synthetic law's representative batch (the tuner's default batch and seed)."""
    return batch_fill(sequence_lengths(bucket, batch, distribution, seed), bucket)


def sample_lengths(sample: tuple[int, ...] | list[int], max_len: int, batch: int, seed: int) -> list[int]:
    """A representative batch drawn from a sample of real lengths for the bucket whose longest
    sequence is ``max_len``: ``batch`` seeded draws from the sample's lengths in [1, max_len], the
    longest then raised to the sample's longest length in (max_len / 2, max_len] (``max_len`` when the
    sample has none), so the batch belongs to the bucket it tunes."""
    max_len, batch = _sizes(max_len, batch)
    pool = sorted(n for n in sample if 0 < n <= max_len)
    top = [n for n in pool if n > max_len // 2]
    longest = top[-1] if top else max_len
    if not pool:
        return [longest] * batch
    rng = random.Random(f"sample:{seed}:{max_len}:{batch}:{len(pool)}:{pool[len(pool) // 2]}")
    lengths = [pool[rng.randrange(len(pool))] for _ in range(batch)]
    i = max(range(batch), key=lambda j: lengths[j])
    lengths[i] = max(lengths[i], longest)
    return lengths
