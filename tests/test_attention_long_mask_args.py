"""A window or context near 2**31 (the largest the call accepts: an "unbounded" window, a context longer than
any sequence) must mean what HSTU.md's mask says, not wrap in the kernels' int32 id arithmetic.

The Triton kernels compute ``id + max_attn_len`` (backward row range) and ``id - max_attn_len + context``
(forward key range) in int32: with ``max_attn_len = 2**31 - 1`` the backward dropped every gradient term
(errors of the gradients' own size), and with the context that large too the forward's key range wrapped to
rows outside the sequence (a segfault under the interpreter). The calls now cap both at ``rows + 1``, which
masks exactly as before; the kernels themselves (hashed) still wrap, recorded by the strict xfail below."""

from __future__ import annotations

import math

import pytest
import torch
from test_input_safety import memcheck  # noqa: F401  (the interpreter's memory checker fixture)

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention import HSTUBwdConfig, HSTUFwdConfig, hstu_attention, hstu_attention_reference
from kernel_templates.hstu_attention.testing import check_tolerance, offsets_from_lengths
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd
from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd

BIG = 2**31 - 1
LENGTHS = [9, 0, 30, 1, 17]
TARGETS = [1, 0, 3, 1, 2]


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _inputs(device: str, d: int = 32, grad: bool = True) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    return tuple(torch.randn(sum(LENGTHS), 2, d, generator=gen).to(device, dt).requires_grad_(grad) for _ in "qkv")


@pytest.mark.parametrize(
    ("ctx", "window", "targets"),
    [(0, BIG, False), (1, BIG, True), (BIG, 0, True), (BIG, BIG, False), (BIG, BIG, True), (2**30, 2**30, False)],
)
@pytest.mark.parametrize("call", ["default", "tuned", "template"])
def test_a_window_or_context_near_2_31_gives_the_reference_result(device, request, call, ctx, window, targets):
    """Output and every gradient against the fp32 reference (in Python ints, no wrap); on CPU under the
    interpreter's memory checker, so a read outside the tensors is an error rather than a crash."""
    if device == "cpu":
        request.getfixturevalue("memcheck")
    if call == "tuned" and device == "cuda":
        dispatch.load()
    d = 128 if device == "cuda" else 32
    q, k, v = _inputs(device, d)
    off = offsets_from_lengths(LENGTHS, device)
    nt = torch.tensor(TARGETS, device=device) if targets else None
    alpha = 1.0 / math.sqrt(d)
    args = (off, 30, alpha, nt, ctx, window)
    out = hstu_attention(q, k, v, *args) if call == "template" else ops.hstu_attention(q, k, v, *args, source=call)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    got = (out, *torch.autograd.grad(out, (q, k, v), go.to(out.dtype)))
    r32 = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    rlo = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = hstu_attention_reference(*r32, *args)
    own = hstu_attention_reference(*rlo, *args, compute_dtype=q.dtype)
    refs = (ref, *torch.autograd.grad(ref, r32, go))
    owns = (own, *torch.autograd.grad(own, rlo, go.to(own.dtype)))
    for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, refs, owns, strict=True):
        check_tolerance(f"{name} ctx={ctx} window={window}", g, r, t)


@pytest.mark.interpreter
@pytest.mark.parametrize("direction", ["bwd", "fwd"])
def test_the_triton_launchers_take_a_window_near_2_31(memcheck, direction):  # noqa: F811
    """The launchers called directly cap window and context as the calls do (the kernels add them to position ids
    in int32): uncapped, the backward with max_attn_len = 2**31 - 1 returned zero dK/dV rows, and the forward with
    context and window both 2**31 - 1 read keys outside the sequence (the memory checker's error)."""
    q, k, v = _inputs("cpu", grad=False)
    off = offsets_from_lengths(LENGTHS, "cpu")
    alpha = 1.0 / math.sqrt(32)
    if direction == "fwd":  # the memory checker raises an InterpreterError naming the out-of-bounds load
        nt = torch.zeros(5, dtype=torch.int64)
        out = hstu_attention_fwd(q, k, v, off, 30, alpha, nt, BIG, BIG, None, HSTUFwdConfig(16, 16, 4, 1))
        want = hstu_attention_reference(q, k, v, off, 30, alpha, nt, BIG, BIG)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        return
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
    dq, dk, dv = hstu_attention_bwd(do, q, k, v, off, 30, alpha, None, 0, BIG, None, HSTUBwdConfig(16, 16, 4, 1))
    r = [t.detach().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(hstu_attention_reference(*r, off, 30, alpha, None, 0, BIG), r, do)
    for g, w in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
