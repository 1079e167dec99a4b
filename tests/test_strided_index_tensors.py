"""Strided ``seq_offsets`` and ``num_targets``: a column of a per-sequence table (``table[:, 0]``) is a valid
input, and every entry point must read its elements, not the memory behind its first element.

The Triton kernels (and the device check kernel) index these tensors densely, so a stride-2 view used to
read the neighbouring column: wrong rows, uninitialised output rows and wrong gradients with no error.
"""

from __future__ import annotations

import math

import pytest
import torch

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention import hstu_attention, hstu_attention_reference
from kernel_templates.hstu_attention import input_check as ic

LENGTHS = [5, 7, 0, 8]
OFFSETS = [0, 5, 12, 12, 20]
TARGETS = [1, 2, 0, 3]
N, ALPHA = 16, 1.0 / math.sqrt(32)


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _column(values: list[int], device: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as column 0 of a (B, 2) table: a stride-2 view, its neighbour column all 1s."""
    t = torch.tensor(values, dtype=dtype, device=device)
    view = torch.stack([t, torch.ones_like(t)], dim=1)[:, 0]
    assert view.stride() == (2,)
    return view


def _qkv(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(20, 2, 32, generator=gen).to(device).requires_grad_(True) for _ in range(3)]


def _check(out: torch.Tensor, qkv: list[torch.Tensor], targets: bool, device: str) -> None:
    ref_in = [t.detach().float().requires_grad_(True) for t in qkv]
    off = torch.tensor(OFFSETS, device=device)
    nt = torch.tensor(TARGETS, device=device) if targets else None
    ref = hstu_attention_reference(*ref_in, off, N, ALPHA, nt)
    tol = 3e-2 if device == "cuda" else 1e-5
    assert (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(out, qkv, do.to(out.dtype))
    for name, g, r in zip("qkv", grads, torch.autograd.grad(ref, ref_in, do), strict=True):
        assert (g.float() - r).abs().max().item() <= tol * r.abs().max().item(), f"d{name}"


@pytest.mark.parametrize("mode", ["async", "full", "none"])
@pytest.mark.parametrize("source", ["default", "tuned", "reference"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_public_call_reads_strided_offsets_and_targets(device, source, mode, index_dtype):
    qkv = _qkv(device)
    off, nt = _column(OFFSETS, device, index_dtype), _column(TARGETS, device, index_dtype)
    out = ops.hstu_attention(*qkv, off, N, ALPHA, nt, source=source, validate=mode)
    _check(out, qkv, True, device)


def test_custom_op_reads_strided_offsets(device):
    """The traced path (the custom op) as well as the eager one."""
    qkv = _qkv(device)
    fb, fc, bb, bc = ops._choose(qkv[0].dtype, 32, 32, 2, N, None, "default", "targets", None)
    off, nt = _column(OFFSETS, device), _column(TARGETS, device)
    out = torch.ops.hstu.attention_fwd(*qkv, off, nt, N, ALPHA, 0, 0, None, fb, fc, bb, bc)
    _check(out, qkv, True, device)


def test_template_call_reads_strided_offsets(device):
    qkv = _qkv(device)
    out = hstu_attention(*qkv, _column(OFFSETS, device), N, ALPHA, _column(TARGETS, device))
    _check(out, qkv, True, device)


@pytest.mark.interpreter
def test_device_check_kernel_reads_strided_offsets():
    """Valid strided offsets and targets pass the device check; a bad value in them is still found."""
    err = torch.full((1,), -1, dtype=torch.int32)
    ic.launch_offsets_check(_column(OFFSETS, "cpu"), _column(TARGETS, "cpu"), 20, N, err=err, assert_on_device=False)
    assert int(err) == 0
    ic.launch_offsets_check(_column([0, 5, 4, 12, 20], "cpu"), None, 20, N, err=err, assert_on_device=False)
    assert int(err) == ic.DECREASING


def test_fused_layer_reads_strided_offsets(device):
    from autotune.runtime.layer import hstu_layer, plan_layer
    from models.config import get_config
    from models.hstu import HSTULayer

    cfg = get_config("tiny", dropout=0.0, max_seq_len=N, layer="fused")
    layer = HSTULayer(cfg).to(device)
    x = torch.randn(20, cfg.hidden_dim, device=device)
    plan = plan_layer(x.dtype, cfg.num_heads, cfg.head_dim, N, layer.alpha, cfg.eps, 0.0, "default")
    params = {"ln1_w": layer.input_norm.weight, "ln1_b": layer.input_norm.bias, "w_uvqk": layer.uvqk.weight,
              "b_uvqk": layer.uvqk.bias, "ln2_w": layer.attn_norm.weight, "ln2_b": layer.attn_norm.bias,
              "w_o": layer.out_proj.weight, "b_o": layer.out_proj.bias}  # fmt: skip
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    want = hstu_layer(x, params, torch.tensor(OFFSETS, device=device), plan, seed)
    got = hstu_layer(x, params, _column(OFFSETS, device), plan, seed)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
