"""Random calls of the public attention op and the Triton template, drawn per case from a seeded generator:
head dims with and without kernels of their own (zero-padded), Dv != Dqk, 1-16 heads, jagged lengths with
empty, length-1 and full sequences, a loose max_seq_len, every mask (targets, context, window), a divisor,
alpha, half dtypes and both sources. Forward and every gradient against the fp32 reference under the
project's tolerance rule. fp32/fp16 under the CPU interpreter (small shapes), bf16/fp16 on a GPU, where
``source="tuned"`` reads the shipped artifacts (the CuTe kernels on an H100/H200)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention import hstu_attention
from kernel_templates.hstu_attention.testing import check_call_and_grads, make_jagged_inputs

KERNEL_DIMS = (32, 64, 128, 256)
PADDED_DIMS = (16, 48, 80, 96, 160, 192)


def _case(seed: int, gpu: bool) -> dict:
    """One call's arguments; sizes small enough for the interpreter off the GPU."""
    rng = random.Random(f"attention-case:{seed}")
    call = rng.choice(["default", "tuned", "template"])
    dims = KERNEL_DIMS if call == "template" else KERNEL_DIMS + PADDED_DIMS
    dqk = rng.choice(dims)
    dv = dqk if rng.random() < 0.7 else rng.choice(dims)
    cap = rng.choice([1, 7, 64, 130, 700] if gpu else [1, 7, 40])
    batch = rng.choice([1, 2, 5, 17] if gpu else [1, 2, 4])
    lengths = [rng.choice([0, 1, rng.randint(0, cap), cap]) for _ in range(batch)]
    return dict(
        call=call, dqk=dqk, dv=dv, heads=rng.choice([1, 2, 3, 8, 16] if gpu else [1, 2, 3]), lengths=lengths,
        max_seq_len=max(max(lengths), 1) + rng.choice([0, 0, 1, 1000]),
        dtype=rng.choice([torch.bfloat16, torch.float16] if gpu else [torch.float32, torch.float16]),
        targets=rng.random() < 0.4, ctx=rng.choice([0, 0, 1, 5]), win=rng.choice([0, 0, 1, 7]),
        scaling=rng.choice([None, None, 50]), alpha=rng.choice([None, 0.05]),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(16))
def test_random_call_matches_the_reference(device, seed):
    c = _case(seed, device == "cuda")
    dispatch.reset()
    if c["call"] == "tuned" and device == "cuda":
        dispatch.load()
    inp = make_jagged_inputs(
        c["lengths"], c["heads"], c["dqk"], c["dv"], c["dtype"], device, seed=seed, max_seq_len=c["max_seq_len"],
        targets=c["targets"], requires_grad=True,
    )  # fmt: skip
    args = (inp.seq_offsets, inp.max_seq_len, c["alpha"], inp.num_targets, c["ctx"], c["win"], c["scaling"])
    if c["call"] == "template":
        out = hstu_attention(inp.q, inp.k, inp.v, *args)
    else:
        out = ops.hstu_attention(inp.q, inp.k, inp.v, *args, source=c["call"])
    alpha = c["alpha"] if c["alpha"] is not None else 1.0 / math.sqrt(c["dqk"])
    ref_args = (inp.seq_offsets, inp.max_seq_len, alpha, inp.num_targets, c["ctx"], c["win"], c["scaling"])
    check_call_and_grads(str(c), out, (inp.q, inp.k, inp.v), ref_args, c["dtype"], seed)
