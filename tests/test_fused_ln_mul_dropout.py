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


# --- explicit configs, output buffers, the torch backend (the op's spec) -------------------------
def _cfgs(device):
    from kernel_templates.fused_ln_mul_dropout.config import LnMulDropoutBwdConfig, LnMulDropoutFwdConfig

    warps = 4 if device == "cuda" else 1
    return LnMulDropoutFwdConfig(4, warps), LnMulDropoutBwdConfig(2, warps, 2)


@pytest.mark.parametrize("rows", [0, 1, 37, 130])
def test_triton_and_torch_backends_agree_with_dropout(device, rows):
    """Both backends drop the same elements (one mask from the seed), forward and backward."""
    from kernel_templates.fused_ln_mul_dropout.torch_impl import ln_mul_dropout_bwd_torch, ln_mul_dropout_fwd_torch
    from kernel_templates.fused_ln_mul_dropout.triton_ln_mul_dropout import ln_mul_dropout_bwd, ln_mul_dropout_fwd

    fcfg, bcfg = _cfgs(device)
    x, u, w, b = _inputs(device, rows=rows, d=96)
    seed = torch.tensor([77], device=device)
    out, mean, rstd = ln_mul_dropout_fwd(x, u, w, b, 1e-5, 0.3, seed, config=fcfg)
    ref, rmean, rrstd = ln_mul_dropout_fwd_torch(x, u, w, b, 1e-5, 0.3, seed)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    go = torch.randn_like(x)
    wide = torch.full((rows, 4 * 96), 5.0, device=device)
    bufs = (torch.empty_like(x), wide[:, 96:192], torch.empty_like(w), torch.empty_like(b))
    got = ln_mul_dropout_bwd(go, x, u, w, b, mean, rstd, 0.3, seed, config=bcfg, out=bufs)
    want = ln_mul_dropout_bwd_torch(go, x, u, w, b, rmean, rrstd, 0.3, seed)
    assert got[1].data_ptr() == wide[:, 96:192].data_ptr()
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    assert (wide[:, :96] == 5).all() and (wide[:, 192:] == 5).all()


def test_keep_mask_fraction_and_seed(device):
    from kernel_templates.fused_ln_mul_dropout.triton_ln_mul_dropout import dropout_keep_mask

    s1, s2 = torch.tensor([1], device=device), torch.tensor([2], device=device)
    k1 = dropout_keep_mask(256, 64, 0.25, s1)
    assert abs(k1.float().mean().item() - 0.75) < 0.02
    assert torch.equal(k1, dropout_keep_mask(256, 64, 0.25, s1))
    assert not torch.equal(k1, dropout_keep_mask(256, 64, 0.25, s2))


def test_bad_arguments_name_the_argument(device):
    from kernel_templates.fused_ln_mul_dropout.triton_ln_mul_dropout import ln_mul_dropout_fwd

    x, u, w, b = _inputs(device, rows=8, d=64)
    seed = torch.tensor([1], device=device)
    with pytest.raises(ValueError, match="dropout p"):
        ln_mul_dropout_fwd(x, u, w, b, 1e-5, 1.0, seed)
    with pytest.raises(ValueError, match="x and u"):
        ln_mul_dropout_fwd(x, u[:4], w, b, 1e-5, 0.1, seed)
    with pytest.raises(ValueError, match="weight and bias"):
        ln_mul_dropout_fwd(x, u, w[:3], b, 1e-5, 0.1, seed)


def test_launchers_refuse_short_buffers_and_bad_eps_and_read_strided_weights(device):
    """A short dout / mean / rstd would be read out of bounds by the kernel: refused by name. A strided
    weight is read as a contiguous copy (the kernel indexes it densely)."""
    from kernel_templates.fused_ln_mul_dropout.launch import ln_mul_dropout_bwd, ln_mul_dropout_fwd

    x, u, w, b = _inputs(device, rows=17, d=48)
    seed = torch.tensor([3], device=device)
    out, mean, rstd = ln_mul_dropout_fwd(x, u, w, b, 1e-5, 0.2, seed)
    ws = torch.stack([w, -w], 1)[:, 0]
    out_s, _, _ = ln_mul_dropout_fwd(x, u, ws, b, 1e-5, 0.2, seed)
    assert torch.equal(out, out_s)
    dout = torch.randn_like(x)
    grads = ln_mul_dropout_bwd(dout, x, u, w, b, mean, rstd, 0.2, seed)
    grads_s = ln_mul_dropout_bwd(dout, x, u, ws, b, torch.stack([mean, mean], 1)[:, 0], rstd, 0.2, seed)
    assert all(torch.equal(g, h) for g, h in zip(grads, grads_s, strict=True))
    with pytest.raises(ValueError, match="dout must have shape"):
        ln_mul_dropout_bwd(dout[:3], x, u, w, b, mean, rstd, 0.2, seed)
    with pytest.raises(ValueError, match="mean must be float32 of shape"):
        ln_mul_dropout_bwd(dout, x, u, w, b, mean[:3], rstd, 0.2, seed)
    for eps in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="eps must be a positive finite number"):
            ln_mul_dropout_fwd(x, u, w, b, eps, 0.2, seed)


def test_launchers_refuse_bad_seeds_and_out_buffers(device):
    """The kernels load element 0 of ``seed`` as an integer and write ``out``/``dx``/``du`` at
    ``row * stride(0) + col``: an empty seed was read out of bounds (a segfault under the interpreter), a float
    seed failed inside the kernel, and a transposed or row-expanded ``out`` was silently written wrongly."""
    from kernel_templates.fused_ln_mul_dropout.launch import ln_mul_dropout_bwd, ln_mul_dropout_fwd

    x, u, w, b = _inputs(device, rows=5, d=48)
    seed = torch.tensor([3], device=device)
    _, mean, rstd = ln_mul_dropout_fwd(x, u, w, b, 1e-5, 0.2, seed)
    for bad in (torch.tensor([3.0]), torch.tensor([1, 2]), torch.tensor([True]), torch.empty(0, dtype=torch.int64)):
        with pytest.raises(ValueError, match="seed must be"):
            ln_mul_dropout_fwd(x, u, w, b, 1e-5, 0.2, bad.to(device))
        with pytest.raises(ValueError, match="seed must be"):
            ln_mul_dropout_bwd(x, x, u, w, b, mean, rstd, 0.2, bad.to(device))
    for bad in (torch.empty(48, 5, device=device).t(), torch.empty(1, 48, device=device).expand(5, 48)):
        with pytest.raises(ValueError, match="out must have contiguous, non-overlapping rows"):
            ln_mul_dropout_fwd(x, u, w, b, 1e-5, 0.2, seed, out=bad)
        with pytest.raises(ValueError, match=r"out\[1\] must have contiguous, non-overlapping rows"):
            ln_mul_dropout_bwd(x, x, u, w, b, mean, rstd, 0.2, seed, out=(torch.empty_like(x), bad, None, None))
    with pytest.raises(ValueError, match="u must be a floating-point tensor"):
        ln_mul_dropout_fwd(x, u.int(), w, b, 1e-5, 0.2, seed)
    with pytest.raises(ValueError, match=r"out\[2\] and out\[3\] .* both"):
        ln_mul_dropout_bwd(x, x, u, w, b, mean, rstd, 0.2, seed, out=(x.clone(), x.clone(), None, b.clone()))
    with pytest.raises(ValueError, match="seed must be an int or a one-element integer tensor"):
        fused_ln_mul_dropout(x, u, w, b, p=0.2, seed=torch.tensor([1.5], device=device))


@pytest.mark.parametrize("p", ["0.1", True, float("nan"), 1.0, -0.1])
def test_dropout_p_must_be_a_number_in_range(device, p):
    """A string, bool, NaN or out-of-range p is a ValueError naming p, in the public op and both launchers."""
    from kernel_templates.fused_ln_mul_dropout import launch

    x, u = (torch.randn(4, 8, device=device) for _ in range(2))
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="dropout p must be"):
        launch.ln_mul_dropout_fwd(x, u, w, b, 1e-5, p, seed)
    with pytest.raises(ValueError, match="dropout p must be"):
        launch.ln_mul_dropout_bwd(x, x, u, w, b, torch.zeros(4, device=device), torch.ones(4, device=device), p, seed)
    for training in (True, False):
        with pytest.raises(ValueError, match="dropout p must be"):
            fused_ln_mul_dropout(x, u, w, b, p=p, training=training)


@pytest.mark.parametrize("rows", [0, 1, 37, 130])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_silu_pre_carries_du_through_silu_grad(device, rows, backend):
    """With ``silu_pre`` (u = silu(pre)) du comes out as d pre = du * silu'(pre) (rounded once) and a fifth output
    holds its column sums in fp32; the other outputs are those of the plain call. The spec's launchers of both
    backends, into a strided du slice of a wider buffer, with dropout."""
    from kernel_templates.fused_ln_mul_dropout.launch import ln_mul_dropout_bwd, ln_mul_dropout_bwd_torch
    from kernel_templates.fused_ln_mul_dropout.torch_impl import ln_mul_dropout_fwd_torch
    from kernel_templates.gemm_silu.reference import silu_grad

    launch = ln_mul_dropout_bwd if backend == "triton" else ln_mul_dropout_bwd_torch
    kw = {"config": _cfgs(device)[1]} if backend == "triton" else {}
    x, u, w, b = _inputs(device, rows=rows, d=96, seed=3)
    pre = torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(8)).to(device)[:, 96:]
    seed = torch.tensor([5], device=device)
    _, mean, rstd = ln_mul_dropout_fwd_torch(x, u, w, b, 1e-5, 0.2, seed)
    go = torch.randn_like(x)
    plain = launch(go, x, u, w, b, mean, rstd, 0.2, seed, **kw)
    wide = torch.full((rows, 3 * 96), 7.0, device=device)
    bufs = (torch.empty_like(x), wide[:, 96:192], torch.empty_like(w), torch.empty_like(b))
    got = launch(go, x, u, w, b, mean, rstd, 0.2, seed, out=bufs, silu_pre=pre, **kw)
    assert len(got) == 5 and got[1].data_ptr() == wide[:, 96:192].data_ptr()
    for i in (0, 2, 3):
        torch.testing.assert_close(got[i], plain[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], plain[1] * silu_grad(pre), atol=1e-5, rtol=1e-5)
    assert got[4].dtype == torch.float32 and got[4].shape == (96,)
    torch.testing.assert_close(got[4], got[1].float().sum(0), atol=1e-4, rtol=1e-5)
    assert (wide[:, :96] == 7).all() and (wide[:, 192:] == 7).all()
    with pytest.raises(ValueError, match="silu_pre"):
        launch(go, x, u, w, b, mean, rstd, 0.2, seed, silu_pre=pre[:, :50], **kw)


def test_public_call_refuses_seeds_outside_int64_and_floats(device):
    """A Python seed becomes the int64 the kernels draw from: 2**64 raised an overflow that did not name it, and
    a float seed was truncated by int() (2.7 drew seed 2's mask)."""
    x, u, w, b = _inputs(device, rows=5, d=48)
    for bad in (2**63, -(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match="seed must fit in int64"):
            fused_ln_mul_dropout(x, u, w, b, 1e-5, 0.2, True, seed=bad)
    for bad in (2.7, "3", object()):
        with pytest.raises(ValueError, match="seed must be an int"):
            fused_ln_mul_dropout(x, u, w, b, 1e-5, 0.2, True, seed=bad)
    for edge in (-(2**63), 2**63 - 1):
        assert torch.isfinite(fused_ln_mul_dropout(x, u, w, b, 1e-5, 0.2, True, seed=edge)).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_zero_rows_give_empty_grads_and_zero_parameter_grads(device, backend):
    """No rows: empty dx and du, zero dweight and dbias, whatever strides the empty inputs have (an expanded
    (0, 0)-strided x or silu_pre was refused as "must have contiguous columns"), and through the autograd op."""
    from kernel_templates.fused_ln_mul_dropout import launch

    d = 64
    fwd = launch.ln_mul_dropout_fwd if backend == "triton" else launch.ln_mul_dropout_fwd_torch
    bwd = launch.ln_mul_dropout_bwd if backend == "triton" else launch.ln_mul_dropout_bwd_torch
    empty = torch.zeros((), device=device).expand(0, d)
    w, b = torch.randn(d, device=device), torch.randn(d, device=device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    out, mean, rstd = fwd(empty, empty, w, b, 1e-5, 0.1, seed)
    assert out.shape == (0, d) and mean.shape == rstd.shape == (0,)
    bufs = (torch.empty(0, d, device=device), torch.empty(0, d, device=device), torch.full_like(w, 7.0), b + 7)
    dx, du, dw, db, dbu = bwd(empty, empty, empty, w, b, mean, rstd, 0.1, seed, out=bufs, silu_pre=empty)
    assert dx.shape == du.shape == (0, d) and dw is bufs[2] and not dw.any() and not db.any() and not dbu.any()
    if backend == "torch":
        return
    x, u = (torch.randn(0, d, device=device, requires_grad=True) for _ in range(2))
    wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    fused_ln_mul_dropout(x, u, wr, br, p=0.1, seed=1).sum().backward()
    assert x.grad.shape == u.grad.shape == (0, d) and not wr.grad.any() and not br.grad.any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_output_buffers_over_an_input_or_each_other_are_refused(device, backend):
    """An ``out`` over u (or x, one row on) was read after the kernel wrote it, and ``out=(dx, du, dw, dw)`` returned
    dbias in both: silently wrong. Column blocks of one d(uvqk)-like buffer do not overlap: taken, and right."""
    from kernel_templates.fused_ln_mul_dropout import launch

    fwd = launch.ln_mul_dropout_fwd if backend == "triton" else launch.ln_mul_dropout_fwd_torch
    bwd = launch.ln_mul_dropout_bwd if backend == "triton" else launch.ln_mul_dropout_bwd_torch
    x, u, w, b = _inputs(device, rows=8, d=16)
    seed = torch.tensor([3], device=device)
    with pytest.raises(ValueError, match="out shares memory with the input u"):
        fwd(x, u, w, b, 1e-5, 0.2, seed, out=u)
    buf = torch.cat([x, x[-1:]])
    with pytest.raises(ValueError, match="out shares memory with the input x"):
        fwd(buf[:8], u, w, b, 1e-5, 0.2, seed, out=buf[1:])
    _, mean, rstd = launch.ln_mul_dropout_fwd(x, u, w, b, 1e-5, 0.2, seed)
    dout, dwb, d = torch.randn_like(x), torch.empty_like(w), torch.empty(8, 64, device=device)
    bad = [
        ((d[:, :16], d[:, 16:32], dwb, dwb), r"out\[2\] and out\[3\] must be different tensors"),
        ((d[:, :16], d[:, 8:24], None, None), r"out\[0\] and out\[1\] must be different tensors"),
        ((dout, d[:, :16], None, None), r"out\[0\] shares memory with the input dout"),
        ((d[:, :16], d[:, 16:32], torch.empty_like(w), b), r"out\[3\] shares memory with the input bias"),
    ]
    for out, match in bad:
        with pytest.raises(ValueError, match=match):
            bwd(dout, x, u, w, b, mean, rstd, 0.2, seed, out=out)
    got = bwd(dout, x, u, w, b, mean, rstd, 0.2, seed, out=(d[:, :16], d[:, 16:32], torch.empty_like(w), dwb))
    want = launch.ln_mul_dropout_bwd(dout, x, u, w, b, mean, rstd, 0.2, seed)
    for g, t in zip(got, want, strict=True):
        assert (g - t).abs().max() < 1e-4


def test_public_call_names_bad_tensors_eps_and_seeds(device):
    """A list for x was an AttributeError, x of width 0 a reshape error inside torch, an eps of None or "a" an error
    from ``float()`` naming nothing, and ``eps=True`` ran as eps 1.0, a bool seed as seed 1. A NumPy eps is a number."""
    import numpy as np

    x, u, w, b = _inputs(device, rows=4, d=16)
    for i, name in enumerate(("x", "u", "weight", "bias")):
        args = [x, u, w, b]
        args[i] = args[i].tolist()
        with pytest.raises(ValueError, match=f"{name} must be a torch.Tensor"):
            fused_ln_mul_dropout(*args)
    with pytest.raises(ValueError, match="x must have a last dimension of size >= 1"):
        fused_ln_mul_dropout(x[:, :0], u[:, :0], w[:0], b[:0])
    for eps in (None, "a", True, float("nan"), 0.0):
        with pytest.raises(ValueError, match="eps must be a positive finite number"):
            fused_ln_mul_dropout(x, u, w, b, eps=eps)
    with pytest.raises(ValueError, match="seed must be an int"):
        fused_ln_mul_dropout(x, u, w, b, p=0.2, seed=True)
    want = fused_ln_mul_dropout(x, u, w, b, eps=1e-5, p=0.2, seed=5)
    got = fused_ln_mul_dropout(x, u, w, b, eps=np.float32(1e-5), p=np.float64(0.2), seed=np.int64(5))
    assert torch.allclose(got, want, atol=1e-6)
