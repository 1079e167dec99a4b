"""Output projection + residual: both cuBLAS formulations against the reference, fp32 and mixed residual."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_templates.linear_residual import LinearResidualConfig, linear_residual
from kernel_templates.linear_residual.impl import linear_residual_bwd


@pytest.mark.parametrize("mode", ["linear_add", "addmm"])
@pytest.mark.parametrize("m", [0, 1, 37])
def test_matches_reference(device, mode, m):
    gen = torch.Generator().manual_seed(0)
    y, w, b, r = (torch.randn(*s, generator=gen).to(device) for s in ((m, 48), (40, 48), (40,), (m, 40)))
    out = linear_residual(y, w, b, r, config=LinearResidualConfig(mode))
    torch.testing.assert_close(out, r + F.linear(y, w, b), atol=1e-5, rtol=1e-5)
    buf = torch.empty_like(r)
    assert linear_residual(y, w, b, r, config=LinearResidualConfig(mode), out=buf).data_ptr() == buf.data_ptr()


def test_wider_residual_keeps_its_dtype(device):
    lo = torch.bfloat16 if device == "cuda" else torch.float16
    y, w, b = torch.randn(8, 16, device=device).to(lo), torch.randn(12, 16, device=device).to(lo), None
    r = torch.randn(8, 12, device=device)
    if device == "cpu" and lo == torch.float16:
        y, w = y.float(), w.float()  # fp16 GEMMs are a GPU matter; the dtype rule is what is checked
    out = linear_residual(y, w, b, r, config=LinearResidualConfig("addmm"))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, r + (y.float() @ w.float().t()), atol=3e-2, rtol=3e-2)


def test_backward_and_bad_arguments(device):
    y, w = torch.randn(5, 6, device=device), torch.randn(4, 6, device=device)
    dout = torch.randn(5, 4, device=device)
    dy, dw, db = linear_residual_bwd(dout, y, w)
    torch.testing.assert_close(dy, dout @ w)
    torch.testing.assert_close(dw, dout.t() @ y)
    torch.testing.assert_close(db, dout.sum(0))
    with pytest.raises(ValueError, match="residual must have shape"):
        linear_residual(y, w, None, torch.zeros(5, 3, device=device), config=LinearResidualConfig())
    with pytest.raises(ValueError, match="mode"):
        LinearResidualConfig("fast")


@pytest.mark.parametrize("mode", ["linear_add", "addmm"])
def test_launcher_refuses_wrong_out_buffers_and_dtypes(device, mode):
    """``out=`` of the wrong shape was resized with a warning (the caller's buffer reallocated) and integer
    activations ran as an integer GEMM: the spec's launcher refuses each by name."""
    from kernel_templates.linear_residual.launch import linear_residual as launch

    cfg = LinearResidualConfig(mode)
    y, w, b = torch.randn(5, 6, device=device), torch.randn(4, 6, device=device), torch.randn(4, device=device)
    r = torch.randn(5, 4, device=device)
    for bad in (torch.empty(4, 4, device=device), torch.empty(5, 4, device=device, dtype=torch.float16)):
        with pytest.raises(ValueError, match="out must be a torch.float32 \\(5, 4\\) tensor on \\S+ like residual"):
            launch(y, w, b, r, config=cfg, out=bad)
    with pytest.raises(ValueError, match="y must be a floating-point tensor"):
        launch(y.int(), w.int(), None, r, config=cfg)
    with pytest.raises(ValueError, match="weight must be torch.float32 like y"):
        launch(y, w.half(), b, r, config=cfg)
    out = torch.empty_like(r)
    assert launch(y, w, b, r, config=cfg, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, r + F.linear(y, w, b))


@pytest.mark.parametrize("mode", ["linear_add", "addmm"])
def test_the_result_is_in_the_residuals_dtype_and_out_on_its_device(mode):
    """A residual narrower than y came back in the promoted dtype (fp32 beside an fp16 residual), and an ``out`` on
    another device failed inside the copy: the result is in the residual's dtype, and such an ``out`` is named."""
    from kernel_templates.linear_residual.launch import linear_residual as launch

    cfg = LinearResidualConfig(mode)
    y, w, b = torch.randn(5, 6), torch.randn(4, 6), torch.randn(4)
    r = torch.randn(5, 4).half()
    got = launch(y, w, b, r, config=cfg)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, (r.float() + F.linear(y, w, b)).half())
    with pytest.raises(ValueError, match="out must be a torch.float16 \\(5, 4\\) tensor on cpu"):
        launch(y, w, b, r, config=cfg, out=torch.empty(5, 4, dtype=torch.float16, device="meta"))


@pytest.mark.parametrize("mode", ["linear_add", "addmm"])
def test_launcher_refuses_an_out_over_its_gemm_operands(mode):
    """``addmm(out=y)`` read y after writing it and returned wrong values without a word (errors of order 10):
    an ``out`` sharing memory with y or the weight is refused by name; ``out=residual`` (an in-place
    residual add) stays right in both modes."""
    from kernel_templates.linear_residual.launch import linear_residual as launch

    cfg = LinearResidualConfig(mode)
    gen = torch.Generator().manual_seed(0)
    y, w, b, r = (torch.randn(*s, generator=gen) for s in ((6, 8), (8, 8), (8,), (6, 8)))
    want = r + F.linear(y, w, b)
    y2, w2 = y.clone(), w.clone()
    for name, args, out in (("y", (y2, w, b), y2), ("weight", (y, w2, b), w2[:6])):  # w2[:6]: the residual's shape
        with pytest.raises(ValueError, match=f"out shares memory with the input {name}"):
            launch(*args, r, config=cfg, out=out)
    r2 = r.clone()
    torch.testing.assert_close(launch(y, w, b, r2, config=cfg, out=r2), want)
    torch.testing.assert_close(r2, want)


@pytest.mark.parametrize("mode", ["linear_add", "addmm"])
def test_launcher_names_an_out_over_part_of_the_residual(mode):
    """``out`` one row past the residual, or its transpose, failed inside torch with a RuntimeError naming neither
    argument; it is a ValueError naming both. The residual itself (an in-place add) stays right."""
    from kernel_templates.linear_residual.launch import linear_residual as launch

    cfg = LinearResidualConfig(mode)
    gen = torch.Generator().manual_seed(0)
    y, w, b = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen), torch.randn(8, generator=gen)
    buf = torch.randn(9, 8, generator=gen)
    sq = torch.randn(8, 8, generator=gen)
    for r, out in ((buf[1:], buf[:8]), (buf[:8], buf[1:]), (sq, sq.t())):
        with pytest.raises(ValueError, match="out shares memory with the input residual"):
            launch(y, w, b, r, config=cfg, out=out)
    want = sq + F.linear(y, w, b)
    torch.testing.assert_close(launch(y, w, b, sq, config=cfg, out=sq), want)


def test_the_package_exports_the_checked_launchers():
    """``from kernel_templates.linear_residual import linear_residual`` gave the bare implementation: an ``out``
    over y came back wrong without a word. The package names are the launchers, which refuse it."""
    import kernel_templates.linear_residual as pkg
    from kernel_templates.linear_residual import launch

    assert pkg.linear_residual is launch.linear_residual and pkg.linear_residual_bwd is launch.linear_residual_bwd
    y, w, r = torch.randn(5, 4), torch.randn(4, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="out"):
        pkg.linear_residual(y, w, None, r, config=LinearResidualConfig(), out=y)
