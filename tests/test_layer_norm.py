"""Input LayerNorm kernels (Triton) against the PyTorch reference; fp32/fp16 on CPU, bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernel_templates.layer_norm import LayerNormBwdConfig, LayerNormFwdConfig, layer_norm_bwd, layer_norm_fwd
from kernel_templates.layer_norm.config import check_config, default_bwd_config, default_fwd_config
from kernel_templates.layer_norm.reference import layer_norm_bwd_torch, layer_norm_reference

EPS = 1e-5


def _dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32, torch.float16]


def _cfgs(device: str) -> tuple[LayerNormFwdConfig, LayerNormBwdConfig]:
    if device == "cuda":
        return LayerNormFwdConfig(4, 4), LayerNormBwdConfig(4, 4, 2)
    return LayerNormFwdConfig(4, 1), LayerNormBwdConfig(4, 1, 4)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _inputs(device, rows, d, dtype, wide=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, 3 * d if wide else d, generator=gen) * 2 + 0.5
    x = (base[:, d : 2 * d] if wide else base).to(device, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)
    b = (0.1 * torch.randn(d, generator=gen)).to(device)
    return x, w, b


@pytest.mark.parametrize("rows", [0, 1, 37, 130])
@pytest.mark.parametrize("d", [64, 96])
def test_forward_matches_reference(device, rows, d):
    fcfg, _ = _cfgs(device)
    for dtype in _dtypes(device):
        for wide in (False, True):
            x, w, b = _inputs(device, rows, d, dtype, wide)
            y, mean, rstd = layer_norm_fwd(x, w, b, EPS, config=fcfg)
            y32, m32, r32 = layer_norm_reference(x.float(), w, b, EPS)
            ylo, _, _ = layer_norm_reference(x, w, b, EPS, compute_dtype=dtype)
            assert y.dtype == dtype and y.shape == (rows, d)
            assert _err(y, y32) <= 2 * _err(ylo, y32) + 1e-5
            assert _err(mean, m32) <= 1e-4 and _err(rstd, r32) <= 1e-3 * float(r32.abs().max() if rows else 1)


def test_forward_writes_the_gemm_dtype_from_an_fp32_stream(device):
    fcfg, _ = _cfgs(device)
    x, w, b = _inputs(device, 33, 64, torch.float32)
    lo = torch.bfloat16 if device == "cuda" else torch.float16
    y, _, _ = layer_norm_fwd(x, w, b, EPS, config=fcfg, out_dtype=lo)
    ref, _, _ = layer_norm_reference(x, w, b, EPS)
    assert y.dtype == lo and _err(y, ref) <= 2e-2


@pytest.mark.parametrize("rows", [0, 1, 37, 130])
@pytest.mark.parametrize("residual", [False, True])
def test_backward_matches_reference(device, rows, residual):
    d = 96
    _, bcfg = _cfgs(device)
    for dtype in _dtypes(device):
        x, w, b = _inputs(device, rows, d, dtype, wide=True, seed=1)
        _, mean, rstd = layer_norm_reference(x, w, b, EPS)
        gen = torch.Generator().manual_seed(2)
        dy = torch.randn(rows, d, generator=gen).to(device, dtype)
        rg = torch.randn(rows, d, generator=gen).to(device, dtype) if residual else None
        dx, dw, db = layer_norm_bwd(dy, x, w, b, mean, rstd, config=bcfg, residual_grad=rg)
        # fp32 oracle through autograd, and PyTorch's own error in the kernel's dtype
        xr = x.float().clone().requires_grad_(True)
        wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        torch.nn.functional.layer_norm(xr, (d,), wr, br, EPS).backward(dy.float())
        dx32 = xr.grad + (rg.float() if residual else 0) if rows else torch.zeros(0, d, device=device)
        dxlo, _, _ = layer_norm_bwd_torch(dy, x, w, b, mean, rstd, residual_grad=rg)
        assert dx.dtype == dtype
        assert _err(dx, dx32) <= 2 * _err(dxlo, dx32) + 1e-4
        gw = wr.grad if rows else torch.zeros_like(w)
        gb = br.grad if rows else torch.zeros_like(b)
        assert _err(dw, gw) <= 1e-3 * max(1.0, float(gw.abs().max())) + (0.05 if dtype != torch.float32 else 0)
        assert _err(db, gb) <= 1e-3 * max(1.0, float(gb.abs().max())) + (0.05 if dtype != torch.float32 else 0)


@pytest.mark.parametrize("rows", [0, 1, 37, 130])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_residual_grad_sum_is_its_column_sum(device, rows, backend):
    """``residual_grad_sum``: a 4th result, residual_grad's fp32 column sum (the fused layer's output-projection
    bias gradient), from every backend, with or without output buffers; the other results unchanged."""
    from kernel_templates.layer_norm.launch import layer_norm_bwd as triton_launch
    from kernel_templates.layer_norm.launch import layer_norm_bwd_torch as torch_launch

    launch = triton_launch if backend == "triton" else torch_launch
    kw = {"config": _cfgs(device)[1]} if backend == "triton" else {}
    d = 96
    for dtype in _dtypes(device):
        x, w, b = _inputs(device, rows, d, dtype, wide=True, seed=3)
        _, mean, rstd = layer_norm_reference(x, w, b, EPS)
        gen = torch.Generator().manual_seed(4)
        dy, rg = (torch.randn(rows, d, generator=gen).to(device, dtype) for _ in range(2))
        base = launch(dy, x, w, b, mean, rstd, residual_grad=rg, **kw)
        got = launch(dy, x, w, b, mean, rstd, residual_grad=rg, residual_grad_sum=True, **kw)
        assert len(base) == 3 and len(got) == 4
        for g, r in zip(got[:3], base, strict=True):
            assert torch.equal(g, r)
        want = rg.double().sum(0)
        assert got[3].dtype == torch.float32 and got[3].shape == (d,)
        assert float((got[3].double() - want).abs().max()) <= 1e-4 * max(1.0, rows**0.5)
        out = (torch.empty_like(x), torch.empty_like(w), torch.empty_like(b))
        got_out = launch(dy, x, w, b, mean, rstd, residual_grad=rg, residual_grad_sum=True, out=out, **kw)
        assert got_out[0].data_ptr() == out[0].data_ptr() and torch.equal(got_out[3], got[3])
    with pytest.raises(ValueError, match="residual_grad_sum=True needs residual_grad"):
        launch(dy, x, w, b, mean, rstd, residual_grad_sum=True, **kw)
    with pytest.raises(ValueError, match="residual_grad_sum must be a bool"):
        launch(dy, x, w, b, mean, rstd, residual_grad=rg, residual_grad_sum=1, **kw)


def test_backward_writes_into_given_buffers(device):
    _, bcfg = _cfgs(device)
    x, w, b = _inputs(device, 40, 64, torch.float32)
    _, mean, rstd = layer_norm_reference(x, w, b, EPS)
    dy = torch.randn_like(x)
    wide = torch.full((40, 192), 7.0, device=device)
    out = (wide[:, 64:128], torch.empty_like(w), torch.empty_like(b))
    dx, dw, db = layer_norm_bwd(dy, x, w, b, mean, rstd, config=bcfg, out=out)
    ref = layer_norm_bwd_torch(dy, x, w, b, mean, rstd)
    assert dx.data_ptr() == out[0].data_ptr()
    torch.testing.assert_close(dx, ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw, ref[1], atol=1e-4, rtol=1e-4)
    assert (wide[:, :64] == 7).all() and (wide[:, 128:] == 7).all()


def test_bad_arguments_name_the_argument(device):
    fcfg, bcfg = _cfgs(device)
    x, w, b = _inputs(device, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="weight and bias"):
        layer_norm_fwd(x, w[:10], b, EPS, config=fcfg)
    with pytest.raises(ValueError, match="x must be 2-D"):
        layer_norm_fwd(x[None], w, b, EPS, config=fcfg)
    with pytest.raises(ValueError, match="eps"):
        layer_norm_fwd(x, w, b, 0.0, config=fcfg)
    _, mean, rstd = layer_norm_reference(x, w, b, EPS)
    with pytest.raises(ValueError, match="mean must be float32"):
        layer_norm_bwd(x, x, w, b, mean.half(), rstd, config=bcfg)
    with pytest.raises(ValueError, match="dy must have shape"):
        layer_norm_bwd(x[:4], x, w, b, mean, rstd, config=bcfg)
    with pytest.raises(ValueError, match="block_rows"):
        LayerNormFwdConfig(3, 4)


def test_resource_model_accepts_defaults_and_rejects_oversized_tiles():
    for d in (64, 256, 1024, 4096):
        assert check_config(default_fwd_config(d), d) is None
        assert check_config(default_bwd_config(d), d) is None
    assert check_config(LayerNormFwdConfig(16, 1), 1024) is not None
    assert check_config(LayerNormFwdConfig(1, 16), 64) is not None


def test_strided_parameters_and_statistics_read_like_contiguous_ones(device):
    """The kernels index weight, bias, mean and rstd densely: the launchers hand them contiguous copies."""
    fcfg, bcfg = _cfgs(device)
    x, w, b = _inputs(device, 37, 64, torch.float32)
    ws, bs = (torch.stack([t, -t], 1)[:, 0] for t in (w, b))  # stride 2
    assert ws.stride() == (2,)
    y, mean, rstd = layer_norm_fwd(x, w, b, EPS, config=fcfg)
    y_s, _, _ = layer_norm_fwd(x, ws, bs, EPS, config=fcfg)
    assert torch.equal(y, y_s)
    dy = torch.randn_like(x)
    dx, dw, db = layer_norm_bwd(dy, x, w, b, mean, rstd, config=bcfg)
    means, rstds = (torch.stack([t, t], 1)[:, 0] for t in (mean, rstd))
    dx_s, dw_s, db_s = layer_norm_bwd(dy, x, ws, bs, means, rstds, config=bcfg)
    assert torch.equal(dx, dx_s) and torch.equal(dw, dw_s) and torch.equal(db, db_s)


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1.0, "1e-5"])
def test_eps_must_be_a_positive_finite_number(device, eps):
    fcfg, _ = _cfgs(device)
    x, w, b = _inputs(device, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
        layer_norm_fwd(x, w, b, eps, config=fcfg)


def test_short_statistics_and_parameter_grad_buffers_are_refused(device):
    _, bcfg = _cfgs(device)
    x, w, b = _inputs(device, 8, 64, torch.float32)
    _, mean, rstd = layer_norm_reference(x, w, b, EPS)
    with pytest.raises(ValueError, match="rstd must be float32 of shape"):
        layer_norm_bwd(x, x, w, b, mean, rstd[:3], config=bcfg)
    with pytest.raises(ValueError, match=r"out\[1\] must have shape"):
        layer_norm_bwd(x, x, w, b, mean, rstd, config=bcfg, out=(torch.empty_like(x), w.new_empty(3), b.new_empty(64)))


def test_output_buffers_with_strided_columns_or_overlapping_rows_are_refused(device):
    """The kernels write ``out`` at ``row * stride(0) + col``: a transposed or row-expanded buffer was written
    wrongly without an error (the expanded one kept only the last row)."""
    fcfg, bcfg = _cfgs(device)
    x, w, b = _inputs(device, 5, 48, torch.float32)
    y, mean, rstd = layer_norm_fwd(x, w, b, EPS, config=fcfg)
    for bad in (torch.empty(48, 5, device=device).t(), torch.empty(1, 48, device=device).expand(5, 48)):
        with pytest.raises(ValueError, match="out must have contiguous, non-overlapping rows"):
            layer_norm_fwd(x, w, b, EPS, config=fcfg, out=bad)
        with pytest.raises(ValueError, match=r"out\[0\] must have contiguous, non-overlapping rows"):
            layer_norm_bwd(x, x, w, b, mean, rstd, config=bcfg, out=(bad, torch.empty_like(w), torch.empty_like(b)))
    rows = torch.full((5, 60), 7.0, device=device)[:, 6:54]  # strided rows, contiguous columns: fine
    assert torch.equal(layer_norm_fwd(x, w, b, EPS, config=fcfg, out=rows)[0], y)


def test_integer_tensors_and_mismatched_grad_buffers_are_refused(device):
    """An integer x or dy was normalised into a truncated integer output; ``out=(dx, dw, None)`` raised an
    AttributeError and ``out=(dx, None, db)`` returned a fresh dbias, leaving ``db`` unwritten."""
    fcfg, bcfg = _cfgs(device)
    x, w, b = _inputs(device, 6, 48, torch.float32)
    _, mean, rstd = layer_norm_fwd(x, w, b, EPS, config=fcfg)
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        layer_norm_fwd(x.int(), w, b, EPS, config=fcfg)
    with pytest.raises(ValueError, match="weight must be a floating-point tensor"):
        layer_norm_fwd(x, w.int(), b, EPS, config=fcfg)
    with pytest.raises(ValueError, match="out_dtype must be a floating-point dtype"):
        layer_norm_fwd(x, w, b, EPS, config=fcfg, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="x must be 2-D .* D >= 1"):
        layer_norm_fwd(x[:, :0], w[:0], b[:0], EPS, config=fcfg)
    with pytest.raises(ValueError, match="dy must be a floating-point tensor"):
        layer_norm_bwd(x.int(), x, w, b, mean, rstd, config=bcfg)
    with pytest.raises(ValueError, match="residual_grad must be a floating-point tensor"):
        layer_norm_bwd(x, x, w, b, mean, rstd, config=bcfg, residual_grad=x.int())
    dx = torch.empty_like(x)
    for out in ((dx, torch.empty_like(w), None), (dx, None, torch.empty_like(b))):
        with pytest.raises(ValueError, match=r"out\[1\] and out\[2\] .* both"):
            layer_norm_bwd(x, x, w, b, mean, rstd, config=bcfg, out=out)
    with pytest.raises(ValueError, match="out must be a tuple of 3"):
        layer_norm_bwd(x, x, w, b, mean, rstd, config=bcfg, out=(dx, torch.empty_like(w)))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_zero_rows_give_an_empty_dx_and_zero_parameter_grads(device, backend):
    """x of shape (0, D): autograd hands the backward the gradient of the empty output as an expanded (0, 0)-strided
    view, which the Triton launcher refused ("dy must have contiguous columns"). Every launcher and the runtime
    LayerNorm now give dx of shape (0, D) and zero dweight and dbias of shape (D,), also into ``out`` buffers."""
    from autotune.runtime.layer import layer_norm, plan_layer
    from kernel_templates.layer_norm import launch

    d = 64
    fwd = launch.layer_norm_fwd if backend == "triton" else launch.layer_norm_fwd_torch
    bwd = launch.layer_norm_bwd if backend == "triton" else launch.layer_norm_bwd_torch
    kw = {"config": LayerNormBwdConfig()} if backend == "triton" else {}
    fkw = {"config": LayerNormFwdConfig()} if backend == "triton" else {}
    empty = torch.zeros((), device=device).expand(0, d)  # strides (0, 0), as autograd's gradient of an empty output
    w, b = torch.randn(d, device=device), torch.randn(d, device=device)
    y, mean, rstd = fwd(empty, w, b, EPS, **fkw)
    assert y.shape == (0, d) and mean.shape == rstd.shape == (0,)
    for args in ((empty, torch.empty(0, d, device=device)), (torch.empty(0, d, device=device), empty)):
        dx, dw, db = bwd(*args, w, b, mean, rstd, **kw)
        assert dx.shape == (0, d) and dw.shape == db.shape == (d,) and not dw.any() and not db.any()
        out = (torch.empty(0, d, device=device), torch.full((d,), 7.0, device=device), torch.full_like(b, 7.0))
        got = bwd(*args, w, b, mean, rstd, residual_grad=empty, residual_grad_sum=True, out=out, **kw)
        assert got[1] is out[1] and not out[1].any() and not out[2].any() and not got[3].any()
    if backend == "torch":
        return
    for dtype in (torch.float32, torch.float16):
        plan = plan_layer(dtype, 2, 32, 16, 1.0, EPS, 0.0, source="default")
        x = torch.randn(0, d, device=device, dtype=dtype, requires_grad=True)
        wr, br = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        layer_norm(x, wr, br, EPS, plan).float().sum().backward()
        assert x.grad.shape == (0, d) and x.grad.dtype == dtype
        assert wr.grad.shape == br.grad.shape == (d,) and not wr.grad.any() and not br.grad.any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_output_buffers_over_an_input_or_each_other_are_refused(device, backend):
    """The kernels read x, dy and residual_grad row block by row block while they write ``out``: an ``out`` one row
    past x came back wrong without a word (a later block read rows an earlier one had overwritten), and
    ``out=(dx, dw, dw)`` returned dbias in both, as did a dweight over dx's first row."""
    from kernel_templates.layer_norm import launch

    fcfg, bcfg = _cfgs(device)
    fwd = launch.layer_norm_fwd if backend == "triton" else launch.layer_norm_fwd_torch
    bwd = launch.layer_norm_bwd if backend == "triton" else launch.layer_norm_bwd_torch
    x, w, b = _inputs(device, 8, 16, torch.float32)
    buf = torch.empty(9, 16, device=device)
    buf[:8] = x
    with pytest.raises(ValueError, match="out shares memory with the input x"):
        fwd(buf[:8], w, b, EPS, config=fcfg, out=buf[1:])
    with pytest.raises(ValueError, match="out shares memory with the input weight"):
        fwd(x[:1], w, b, EPS, config=fcfg, out=w.view(1, 16))
    _, mean, rstd = layer_norm_fwd(x, w, b, EPS, config=fcfg)
    dy, flat, dwb = torch.randn_like(x), torch.empty(8 * 16, device=device), torch.empty_like(w)
    bad = [
        ({"out": (torch.empty_like(x), dwb, dwb)}, r"out\[1\] and out\[2\] must be different tensors"),
        ({"out": (flat.view(8, 16), flat[:16], torch.empty_like(b))}, r"out\[0\] and out\[1\] must be different"),
        ({"out": (dy, None, None)}, r"out\[0\] shares memory with the input dy"),
        ({"out": (flat.view(8, 16), None, None), "residual_grad": flat.view(8, 16)}, "input residual_grad"),
        ({"out": (torch.empty_like(x), torch.empty_like(w), b)}, r"out\[2\] shares memory with the input bias"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            bwd(dy, x, w, b, mean, rstd, config=bcfg, **kw)
    got = bwd(dy, x, w, b, mean, rstd, config=bcfg, out=(torch.empty_like(x), torch.empty_like(w), dwb))
    want = layer_norm_bwd_torch(dy, x, w, b, mean, rstd)
    for g, t in zip(got, want, strict=True):
        assert _err(g, t) < 1e-4
