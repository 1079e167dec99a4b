"""The fused layer sums the uvqk bias gradient in fp32 straight into the master bias's dtype."""

from __future__ import annotations

import pytest
import torch

from autotune.runtime import dispatch
from models.config import get_config
from models.hstu import HSTULayer

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.mark.parametrize(("recompute", "rounded"), [("none", False), ("uvqk", False), ("pre", True)])
def test_uvqk_bias_gradient_is_not_rounded_to_the_compute_dtype(recompute, rounded):
    """With the pre-activation kept, the backward's fp32 column sum lands in the fp32 master bias's gradient
    as it is (it used to be rounded to the compute dtype and cast back: values fp16 can hold exactly); when
    the backward recomputes the pre-activation it runs the compute-dtype bias, and the sum is rounded."""
    cfg = get_config("tiny", layer="fused", precision="bf16", dropout=0.0, recompute=recompute)
    lengths = [5, 17, 32, 9]
    off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    x, dout = (torch.randn(sum(lengths), cfg.hidden_dim, generator=gen) for _ in range(2))
    torch.manual_seed(0)
    layer = HSTULayer(cfg)
    with torch.autocast("cpu", dtype=torch.float16):
        out = layer(x, off)
    assert out.dtype == torch.float16
    out.float().backward(dout)
    g = layer.uvqk.bias.grad
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert torch.equal(g, g.half().float()) == rounded
    torch.testing.assert_close(layer.out_proj.bias.grad, dout.sum(0), rtol=1e-2, atol=1e-2)  # fp16 dout, fp32 sum
