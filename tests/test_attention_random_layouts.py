"""Random calls of the public attention call, its module and the Triton template on what
``test_attention_random_cases`` leaves fixed: q, k and v as column slices of one packed uvqk buffer, as
views at a storage offset or in head-major (H, L, D) memory; int32 offsets and targets; gradients of only
some inputs; zero or all targets per sequence; contexts and windows longer than the sequences; alpha 0 or
negative; empty, all-empty and many-tiny-sequence batches; every validate mode. Forward and the gradients
of the inputs that require them, against the fp32 reference under the tolerance rule (fp32/fp16 on CPU under
the interpreter, bf16/fp16 on a GPU)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention import hstu_attention, hstu_attention_reference
from kernel_templates.hstu_attention.testing import check_tolerance, offsets_from_lengths

LAYOUTS = ("plain", "uvqk", "storage_offset", "head_major")


def _case(seed: int, gpu: bool) -> dict:
    """One call's arguments, drawn from ``seed``; sizes small enough for the interpreter off the GPU."""
    rng = random.Random(f"attention-layout:{seed}")
    call = rng.choice(["default", "tuned", "reference", "module", "template"])
    dims = (32, 64, 128) if call == "template" else (8, 24, 32, 40, 64, 96, 128)
    dqk = rng.choice(dims)
    batch = rng.choice([0, 1, 2, 5, 12, 40])
    cap = rng.choice([1, 3, 17, 40] if batch < 40 else [0, 1, 2])
    lengths = [rng.choice([0, 1, cap, rng.randint(0, cap)]) for _ in range(batch)]
    return dict(
        call=call, dqk=dqk, dv=dqk if rng.random() < 0.6 else rng.choice(dims), lengths=lengths,
        heads=rng.choice([1, 2, 3, 5, 8]), max_seq_len=max(lengths + [1]) + rng.choice([0, 0, 1, 37, 5000]),
        dtype=rng.choice([torch.bfloat16, torch.float16] if gpu else [torch.float32, torch.float16]),
        targets=rng.choice([None, None, "random", "zero", "all"]), ctx=rng.choice([0, 0, 1, 3, 100]),
        win=rng.choice([0, 0, 1, 2, 1000]), scaling=rng.choice([None, None, 7]),
        alpha=rng.choice([None, 0.3, -0.7, 0.0]), index=rng.choice([torch.int64, torch.int32]),
        layout=rng.choice(LAYOUTS), grad=rng.choice(["qkv", "qkv", "v", "qk", ""]),
        validate=rng.choice(["async", "full", "none"]),
    )  # fmt: skip


def _inputs(c: dict, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v in the case's memory layout (leaves of their own, requiring grad as the case says)."""
    gen = torch.Generator().manual_seed(seed)
    rows, h, dqk, dv = sum(c["lengths"]), c["heads"], c["dqk"], c["dv"]
    if c["layout"] == "uvqk":  # v, q, k: column slices of one (L, H, 8 + Dv + 2 Dqk) buffer
        buf = torch.randn(rows, h, 8 + dv + 2 * dqk, generator=gen).to(device, c["dtype"])
        parts = (buf[..., 8 + dv : 8 + dv + dqk], buf[..., 8 + dv + dqk :], buf[..., 8 : 8 + dv])
    elif c["layout"] == "storage_offset":  # contiguous views 13 elements into one flat buffer
        flat = torch.randn(13 + rows * h * (2 * dqk + dv), generator=gen).to(device, c["dtype"])
        ends = [13, 13 + rows * h * dqk, 13 + 2 * rows * h * dqk, flat.numel()]
        parts = tuple(flat[a:b].view(rows, h, d) for a, b, d in zip(ends[:-1], ends[1:], (dqk, dqk, dv), strict=True))
    elif c["layout"] == "head_major":  # (H, L, D) memory seen as (L, H, D)
        parts = tuple(torch.randn(h, rows, d, generator=gen).to(device, c["dtype"]).transpose(0, 1)
                      for d in (dqk, dqk, dv))  # fmt: skip
    else:
        parts = tuple(torch.randn(rows, h, d, generator=gen).to(device, c["dtype"]) for d in (dqk, dqk, dv))
    return tuple(t.detach().requires_grad_(n in c["grad"]) for n, t in zip("qkv", parts, strict=True))


def _targets(c: dict, device: str, seed: int) -> torch.Tensor | None:
    if c["targets"] is None:
        return None
    rng = random.Random(seed)
    per = {"zero": lambda n: 0, "all": lambda n: n, "random": lambda n: rng.randint(0, n)}[c["targets"]]
    return torch.tensor([per(n) for n in c["lengths"]], dtype=c["index"], device=device)


def _call(c: dict, q, k, v, off, nt) -> torch.Tensor:
    args = (off, c["max_seq_len"], c["alpha"], nt, c["ctx"], c["win"], c["scaling"])
    if c["call"] == "template":
        return hstu_attention(q, k, v, *args, validate=c["validate"])
    if c["call"] == "module":
        module = ops.HSTUAttention("default", None, c["ctx"], c["win"], validate=c["validate"])
        return module(q, k, v, off, c["max_seq_len"], c["alpha"], nt, c["scaling"])
    return ops.hstu_attention(q, k, v, *args, source=c["call"], validate=c["validate"])


@pytest.mark.parametrize("seed", range(64))
def test_random_layouts_match_the_reference(device, seed):
    c = _case(seed, device == "cuda")
    dispatch.reset()
    if c["call"] == "tuned" and device == "cuda":
        dispatch.load()
    q, k, v = _inputs(c, device, seed)
    off = offsets_from_lengths(c["lengths"], device, c["index"])
    nt = _targets(c, device, seed)
    out = _call(c, q, k, v, off, nt)
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], v.shape[2])
    alpha = c["alpha"] if c["alpha"] is not None else 1.0 / math.sqrt(c["dqk"])
    ref_args = (off, c["max_seq_len"], alpha, nt, c["ctx"], c["win"], c["scaling"])
    r32 = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    rlo = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = hstu_attention_reference(*r32, *ref_args)
    own = hstu_attention_reference(*rlo, *ref_args, compute_dtype=c["dtype"])
    check_tolerance(f"out {c}", out, ref, own)
    wanted = [i for i, t in enumerate((q, k, v)) if t.requires_grad]
    if not wanted:
        assert out.grad_fn is None
        return
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed)).to(device)
    got = torch.autograd.grad(out, [(q, k, v)[i] for i in wanted], go.to(out.dtype))
    refs = torch.autograd.grad(ref, [r32[i] for i in wanted], go, allow_unused=True)
    owns = torch.autograd.grad(own, [rlo[i] for i in wanted], go.to(own.dtype), allow_unused=True)
    for i, g, r, t in zip(wanted, got, refs, owns, strict=True):
        x = (q, k, v)[i]
        assert g.shape == x.shape and g.dtype == x.dtype
        r = torch.zeros_like(r32[i]) if r is None else r  # no rows: the reference's graph never reached it
        t = torch.zeros_like(rlo[i]) if t is None else t
        check_tolerance(f"d{'qkv'[i]} {c}", g, r, t)
