"""Fused dropout(LN(x) * u) Triton kernel vs its PyTorch reference (interpreter, fp32 on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernel_templates.fused_ln_mul_dropout import fused_ln_mul_dropout, ln_mul_dropout_reference


def _inputs(device: str, rows: int = 37, d: int = 96, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen).to(device)
    uvqk = torch.randn(rows, 3 * d, generator=gen).to(device)
    u = uvqk[:, d : 2 * d]  # a strided view, as the model passes it
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)
    b = (0.1 * torch.randn(d, generator=gen)).to(device)
    return x, u, w, b


def _grads(fn, x, u, w, b, go, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, u, w, b)]
    out = fn(*leaves, **kw)
    return out, torch.autograd.grad(out, leaves, go)


@pytest.mark.parametrize("d", [64, 96])
def test_matches_reference_without_dropout(device, d):
    x, u, w, b = _inputs(device, d=d)
    go = torch.randn_like(x)
    out, grads = _grads(fused_ln_mul_dropout, x, u, w, b, go, p=0.0)
    ref, ref_grads = _grads(ln_mul_dropout_reference, x, u, w, b, go, p=0.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, r in zip(("dx", "du", "dweight", "dbias"), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_dropout_statistics_and_replayed_mask(device):
    p = 0.3
    x, u, w, b = _inputs(device, rows=64, d=128)
    go = torch.randn_like(x)
    out, grads = _grads(fused_ln_mul_dropout, x, u, w, b, go, p=p, seed=1234)
    keep = out != 0
    dropped = 1.0 - keep.float().mean().item()
    assert abs(dropped - p) < 0.03, dropped  # 8192 draws: std ~0.005
    # Kept values are the reference scaled by 1/(1-p), and the backward regenerated the same mask.
    ref, ref_grads = _grads(ln_mul_dropout_reference, x, u, w, b, go, p=p, keep=keep)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    # Same seed, same mask; another seed, another mask; eval mode, no dropout.
    again = fused_ln_mul_dropout(x, u, w, b, p=p, seed=1234)
    other = fused_ln_mul_dropout(x, u, w, b, p=p, seed=99)
    torch.testing.assert_close(again, out)
    assert not torch.equal(other != 0, keep)
    evaluated = fused_ln_mul_dropout(x, u, w, b, p=p, training=False)
    torch.testing.assert_close(evaluated, ln_mul_dropout_reference(x, u, w, b, p=0.0), atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise(device):
    x, u, w, b = _inputs(device)
    with pytest.raises(ValueError, match="share a shape"):
        fused_ln_mul_dropout(x, u[:, :10], w, b)
    with pytest.raises(ValueError, match="dropout p"):
        fused_ln_mul_dropout(x, u, w, b, p=1.0)


def test_custom_ops_pass_opcheck(device):
    x, u, w, b = _inputs(device, rows=9, d=32)
    seed = torch.tensor([7], device=device)
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    torch.library.opcheck(torch.ops.hstu.ln_mul_dropout_fwd.default, (x, u, w, b, 1e-5, 0.25, seed))
    mean, rstd = x.mean(1).detach(), x.var(1).add(1e-5).rsqrt().detach()
    args = (torch.randn_like(x), x.detach(), u, w.detach(), b, mean, rstd, 0.25, seed)
    torch.library.opcheck(torch.ops.hstu.ln_mul_dropout_bwd.default, args)
