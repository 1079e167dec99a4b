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
