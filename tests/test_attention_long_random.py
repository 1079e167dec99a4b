"""Random calls of the public attention op at the tuned buckets' lengths (1K-9K), on a GPU: the committed entries'
configs (the CuTe kernels on an H100/H200) on batches they were not tuned on. ``test_attention_random_cases`` keeps
to short sequences; here each case draws a length law (uniform, one long sequence beside short ones, Pareto, u^3, or
tiles' edge lengths), head dim 64/128/256, 1-8 heads, bf16 or fp16, targets, context and window, a loose
``max_seq_len``, and the tuned or default source. Forward and every gradient against the fp32 reference under the
project's tolerance rule."""

from __future__ import annotations

import math
import random

import pytest
import torch

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention.testing import check_call_and_grads, make_jagged_inputs

MAX_TOKENS = 40_000  # per case: the fp32 reference's time and memory stay small


def _lengths(rng: random.Random, law: str, cap: int, batch: int) -> list[int]:
    if law == "uniform":
        lengths = [cap] * batch
    elif law == "one-long":
        lengths = [cap] + [rng.randint(0, 64) for _ in range(batch - 1)]
    elif law == "pareto":
        lengths = [min(cap, int(rng.paretovariate(1.2) * 50)) for _ in range(batch)]
    elif law == "u3":
        lengths = [int(cap * rng.random() ** 3) for _ in range(batch)]
    else:  # tile edges
        lengths = [rng.choice([0, 1, 2, 63, 65, 127, 129]) for _ in range(batch)]
    while sum(lengths) > MAX_TOKENS and len(lengths) > 1:
        lengths.pop()
    return lengths


def _case(seed: int) -> dict:
    rng = random.Random(f"long:{seed}")
    cap = rng.choice([1000, 1024, 1500, 2048, 3000, 4096, 5000, 8192, 9000])
    law = rng.choice(["uniform", "one-long", "pareto", "u3", "edges"])
    lengths = _lengths(rng, law, cap, rng.choice([1, 2, 3, 8, 16]))
    return dict(
        lengths=lengths, law=law, d=rng.choice([64, 128, 256]), heads=rng.choice([1, 2, 4, 8]),
        dtype=rng.choice([torch.bfloat16, torch.bfloat16, torch.float16]), targets=rng.random() < 0.3,
        ctx=rng.choice([0, 0, 7]), win=rng.choice([0, 0, 0, 300]), source=rng.choice(["tuned", "tuned", "default"]),
        max_seq_len=max(lengths + [1]) + rng.choice([0, 0, 1, 333]),
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1000, 1016))
def test_long_random_call_matches_the_reference(device, seed):
    c = _case(seed)
    dispatch.reset()
    if c["source"] == "tuned":
        dispatch.load()
    inp = make_jagged_inputs(
        c["lengths"], c["heads"], c["d"], c["d"], c["dtype"], device, seed=seed, max_seq_len=c["max_seq_len"],
        targets=c["targets"], requires_grad=True,
    )  # fmt: skip
    args = (inp.seq_offsets, inp.max_seq_len, None, inp.num_targets, c["ctx"], c["win"], None)
    out = ops.hstu_attention(inp.q, inp.k, inp.v, *args, source=c["source"])
    ref_args = (inp.seq_offsets, inp.max_seq_len, 1.0 / math.sqrt(c["d"]), inp.num_targets, c["ctx"], c["win"], None)
    tag = {k: v for k, v in c.items() if k != "lengths"} | {"batch": len(c["lengths"]), "first": c["lengths"][:4]}
    check_call_and_grads(str(tag), out, (inp.q, inp.k, inp.v), ref_args, c["dtype"], seed)
