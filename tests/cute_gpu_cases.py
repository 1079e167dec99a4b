"""The GPU cases the CuTe forward and backward tests share: mask settings, jagged lengths, and the
every-mask x both-dtypes x head-dims grid a kernel variant is checked on."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

MASKS = {
    "causal": dict(ctx=0, targets=False, window=0),
    "targets": dict(ctx=0, targets=True, window=0),
    "context": dict(ctx=5, targets=False, window=0),
    "window": dict(ctx=0, targets=False, window=37),
    "all": dict(ctx=3, targets=True, window=50),
}
# Empty and length-1 sequences, lengths that are not tile multiples, one longer than two tiles.
LENGTHS = [0, 1, 70, 129, 0, 257, 64, 3, 300]


def every_mask_and_dtype(dims: Sequence[int]) -> Callable:
    """Mark a test as sm90 GPU-only and run it for every mask, bf16 and fp16, and each head dim in ``dims``
    (the test takes ``mask``, ``dtype`` and ``d``)."""

    def wrap(test: Callable) -> Callable:
        for mark in (
            pytest.mark.parametrize("d", list(dims)),
            pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"]),
            pytest.mark.parametrize("mask", list(MASKS)),
            pytest.mark.sm90,
            pytest.mark.gpu,
        ):
            test = mark(test)
        return test

    return wrap
