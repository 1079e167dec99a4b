"""Backward of the uvqk projection (Triton SiLU' pass + GEMMs) against autograd; fp32/fp16 on CPU, bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernel_templates.gemm_silu.bwd_config import GemmSiluBwdConfig, check_bwd_config, default_bwd_config
from kernel_templates.gemm_silu.torch_impl import gemm_silu_bwd_reference, gemm_silu_bwd_torch
from kernel_templates.gemm_silu.triton_bwd import gemm_silu_bwd


def _cfg(device: str) -> GemmSiluBwdConfig:
    return GemmSiluBwdConfig(16, 64, 4, 2) if device == "cuda" else GemmSiluBwdConfig(4, 32, 1, 1)


def _dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32, torch.float16]


def _inputs(device, m, n=80, k=48, dtype=torch.float32, seed=0, wide_dy=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = (0.5 * torch.randn(n, generator=gen)).to(device, dtype)
    dy_full = torch.randn(m, 2 * n if wide_dy else n, generator=gen).to(device, dtype)
    return dy_full[:, :n], x, w, b


def _err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _amax(t) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


@pytest.mark.parametrize("m", [0, 1, 37, 130])
@pytest.mark.parametrize("wide_dy", [False, True])
def test_matches_autograd(device, m, wide_dy):
    for dtype in _dtypes(device):
        dy, x, w, b = _inputs(device, m, dtype=dtype, wide_dy=wide_dy)
        got = gemm_silu_bwd(dy, x, w, b, config=_cfg(device))
        ref32 = gemm_silu_bwd_reference(dy, x, w, b, torch.float32)
        reflo = gemm_silu_bwd_reference(dy, x, w, b, dtype) if dtype != torch.float16 or device == "cuda" else None
        for name, g, r32, i in zip(("dx", "dw", "db"), got, ref32, range(3), strict=True):
            assert g.shape == r32.shape and g.dtype == dtype, name
            if reflo is None:  # fp16 matmul on CPU: compare to fp32 with a dtype-sized bound
                assert _err(g, r32) <= 2e-2 * max(1.0, _amax(r32)), name
            else:
                assert _err(g, r32) <= 2 * _err(reflo[i], r32) + 1e-4 * max(1.0, _amax(r32)), name


def test_given_pre_and_output_buffers(device):
    dy, x, w, b = _inputs(device, 37)
    pre = torch.addmm(b, x, w.t())
    out = (torch.empty(37, 48, device=device), torch.empty_like(w), torch.empty_like(b))
    got = gemm_silu_bwd(dy, x, w, b, config=_cfg(device), pre=pre, out=out)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, out, strict=True))
    ref = gemm_silu_bwd_torch(dy, x, w, b)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_bad_arguments_name_the_argument(device):
    dy, x, w, b = _inputs(device, 8)
    with pytest.raises(ValueError, match="dy must be"):
        gemm_silu_bwd(dy[:4], x, w, b, config=_cfg(device))
    with pytest.raises(ValueError, match="bias must have shape"):
        gemm_silu_bwd(dy, x, w, b[:3], config=_cfg(device))
    with pytest.raises(ValueError, match="weight must be"):
        gemm_silu_bwd(dy, x, w[:, :5], b, config=_cfg(device))
    with pytest.raises(ValueError, match="pre must be"):
        gemm_silu_bwd(dy, x, w, b, config=_cfg(device), pre=dy[:2])
    with pytest.raises(ValueError, match="block_m"):
        GemmSiluBwdConfig(3, 64)


def test_resource_model():
    assert check_bwd_config(default_bwd_config(4096), 4096) is None
    assert check_bwd_config(GemmSiluBwdConfig(32, 512, 1, 1), 4096) is not None
    assert check_bwd_config(GemmSiluBwdConfig(1, 32, 8, 1), 4096) is not None


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_launchers_refuse_wrong_output_buffers_and_dtypes(device, backend):
    """``torch.mm(out=)`` resized a dx / dW buffer of the wrong shape with a warning, zero rows returned a given dx
    of any shape as dx, a db buffer without a bias stayed unwritten, and an integer ``pre`` was read truncated:
    the spec's launchers refuse each by name."""
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd as triton_launch
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd_torch as torch_launch

    launch = triton_launch if backend == "triton" else torch_launch
    dy, x, w, b = _inputs(device, 8)
    k, n = x.shape[1], w.shape[0]
    kw = {"config": _cfg(device)} if backend == "triton" else {}
    ok = (torch.empty_like(x), torch.empty_like(w), torch.empty_like(b))
    for i, bad in ((0, x.new_empty(7, k)), (1, w.new_empty(n + 1, k)), (2, b.new_empty(n - 1)), (0, x.int())):
        out = tuple(bad if j == i else t for j, t in enumerate(ok))
        with pytest.raises(ValueError, match=rf"out\[{i}\] must be"):
            launch(dy, x, w, b, out=out, **kw)
    with pytest.raises(ValueError, match=r"out\[0\] must be"):
        launch(dy[:0], x[:0], w, b, out=(x.new_empty(3, k), *ok[1:]), **kw)
    with pytest.raises(ValueError, match=r"out\[2\] \(dbias\) must be None without a bias"):
        launch(dy, x, w, None, out=ok, **kw)
    with pytest.raises(ValueError, match="pre must be a floating-point tensor"):
        launch(dy, x, w, b, pre=dy.int(), **kw)
    with pytest.raises(ValueError, match="out must be a tuple"):
        launch(dy, x, w, b, out=ok[:2], **kw)
    got = launch(dy, x, w, b, out=ok, **kw)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, ok, strict=True))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("c", [0, 32, 80])
def test_done_cols_skip_the_pass_and_write_d_pre_in_place(device, backend, c):
    """dy whose first ``c`` columns already hold d pre (their fp32 bias gradient given): the same gradients as
    the whole pass; the Triton backend writes d pre over dy's other columns."""
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd as triton_launch
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd_torch as torch_launch
    from kernel_templates.gemm_silu.reference import silu_grad

    launch = triton_launch if backend == "triton" else torch_launch
    kw = {"config": _cfg(device)} if backend == "triton" else {}
    dy, x, w, b = _inputs(device, 70)
    pre = torch.randn(70, 80, generator=torch.Generator().manual_seed(2)).to(device)
    want = launch(dy, x, w, b, pre=pre, **kw)
    head = (dy[:, :c].float() * silu_grad(pre[:, :c])).to(dy.dtype)
    buf = torch.cat([head, dy[:, c:]], dim=1)
    got = launch(buf, x, w, b, pre=pre, done_cols=c, done_db=head.float().sum(0), **kw)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    if backend == "triton" and c:
        torch.testing.assert_close(buf, (dy.float() * silu_grad(pre)).to(dy.dtype), atol=1e-6, rtol=1e-5)


def test_done_cols_are_checked():
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd as triton_launch
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd_torch as torch_launch

    dy, x, w, b = _inputs("cpu", 8)
    for launch in (triton_launch, torch_launch):
        with pytest.raises(ValueError, match=r"done_cols must be an int in \[0, 80\]"):
            launch(dy, x, w, b, done_cols=81, done_db=torch.zeros(81))
        with pytest.raises(ValueError, match="done_cols must be an int"):
            launch(dy, x, w, b, done_cols=True, done_db=torch.zeros(1))
        with pytest.raises(ValueError, match=r"done_db must be the \(16,\) bias gradient"):
            launch(dy, x, w, b, done_cols=16)
        with pytest.raises(ValueError, match="done_db must be float32"):
            launch(dy, x, w, b, done_cols=16, done_db=torch.zeros(16, dtype=torch.float64))
        with pytest.raises(ValueError, match="dy must be torch.float32 like x with done_cols"):
            launch(dy.double(), x, w, b, done_cols=16, done_db=torch.zeros(16))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_launchers_refuse_an_output_over_an_input(device, backend):
    """The Triton backend wrote dx into ``out[0]`` before reading x for dW = d_pre^T x: with ``out[0]`` over x the
    weight gradient came back wrong (errors of order 10) without a word. An output sharing memory with an input is
    refused by name, by both backends' launchers (one set of rules)."""
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd as triton_launch
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd_torch as torch_launch

    launch = triton_launch if backend == "triton" else torch_launch
    kw = {"config": _cfg(device)} if backend == "triton" else {}
    dy, x, w, b = _inputs(device, 8)
    with pytest.raises(ValueError, match=r"out\[0\] shares memory with the input x"):
        launch(dy, x, w, b, out=(x, torch.empty_like(w), torch.empty_like(b)), **kw)
    with pytest.raises(ValueError, match=r"out\[1\] shares memory with the input weight"):
        launch(dy, x, w, b, out=(torch.empty_like(x), w, torch.empty_like(b)), **kw)
    with pytest.raises(ValueError, match=r"out\[2\] shares memory with the input bias"):
        launch(dy, x, w, b, out=(torch.empty_like(x), torch.empty_like(w), b), **kw)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_done_cols_needs_a_dy_of_its_own_memory(device, backend):
    """With ``done_cols`` the Triton backend writes d_pre over dy: a row-expanded dy (all rows one memory) gave
    gradients wrong by ~13 without a word, and a dy over x or the kept pre-activation is read after it is written.
    Refused by name by both backends (one set of rules: the caller gives dy up); the same dy read-only (no
    done_cols) is an input like any other, and right."""
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd as triton_launch
    from kernel_templates.gemm_silu.launch import gemm_silu_bwd_torch as torch_launch

    launch = triton_launch if backend == "triton" else torch_launch
    kw = {"config": _cfg(device)} if backend == "triton" else {}
    dy, x, w, b = _inputs(device, 8)
    pre = x @ w.t() + b
    done = {"done_cols": 16, "done_db": torch.zeros(16, device=device)}
    with pytest.raises(ValueError, match=r"dy \(written with done_cols\) has elements that share memory"):
        launch(dy[:1].expand(8, 80), x, w, b, pre=pre, **done, **kw)
    with pytest.raises(ValueError, match=r"dy \(written with done_cols\) shares memory with the input pre"):
        launch(pre, x, w, b, pre=pre, **done, **kw)
    buf = torch.randn(8 * 80 + 8 * 48, device=device)
    with pytest.raises(ValueError, match=r"dy \(written with done_cols\) shares memory with the input x"):
        launch(buf[: 8 * 80].view(8, 80), buf[8 * 40 : 8 * 40 + 8 * 48].view(8, 48), w, b, pre=pre, **done, **kw)
    expanded = dy[:1].expand(8, 80)
    got = launch(expanded, x, w, b, pre=pre, **kw)
    want = gemm_silu_bwd_reference(expanded.contiguous(), x, w, b)
    for g, t in zip(got, want, strict=True):
        assert _err(g, t) < 1e-4
