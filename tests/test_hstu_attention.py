"""Triton HSTU attention vs the PyTorch reference: forward and dq/dk/dv, every mask feature.

On CPU this runs under the Triton interpreter in fp32 and fp16; on a GPU (``gpu`` marker) in bf16
and fp16 at larger shapes. Tolerance: 2x PyTorch's own error in the kernel's dtype + a small atol.
"""

from __future__ import annotations

import pytest
import torch

from kernel_templates.hstu_attention import (
    HSTUBwdConfig,
    HSTUFwdConfig,
    hstu_attention,
    hstu_attention_reference,
)
from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs

HAS_CUDA = torch.cuda.is_available()


def _run_case(lengths, heads, dqk, dv, dtype, device, ctx=0, targets=False, window=0, fc=None, bc=None, seed=0):
    inp = make_jagged_inputs(lengths, heads, dqk, dv, dtype, device, seed=seed, targets=targets, requires_grad=True)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / dqk**0.5, inp.num_targets, ctx, window)
    out = hstu_attention(inp.q, inp.k, inp.v, *args, fwd_config=fc, bwd_config=bc)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(out.shape, generator=g).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, (inp.q, inp.k, inp.v), do)
    ref = hstu_attention_reference(inp.q, inp.k, inp.v, *args).float()
    ref_grads = torch.autograd.grad(ref, (inp.q, inp.k, inp.v), do.float())
    low = hstu_attention_reference(inp.q, inp.k, inp.v, *args, compute_dtype=dtype)
    low_grads = torch.autograd.grad(low, (inp.q, inp.k, inp.v), do)
    for name, a, r, lo in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), (low, *low_grads), strict=True
    ):
        check_tolerance(name, a, r, lo)


SMALL_FWD = HSTUFwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_BWD = HSTUBwdConfig(block_m=16, block_n=32, num_warps=4, num_stages=1, dq_mode="atomic")
SMALL_BWD_SEP = HSTUBwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, dq_mode="separate")
MASKS = [
    dict(),
    dict(ctx=3),
    dict(targets=True),
    dict(window=5),
    dict(ctx=2, targets=True, window=7),
]
MASK_IDS = ["causal", "context", "targets", "window", "all"]


@pytest.mark.interpreter
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cpu_jagged_every_mask(mask, dtype):
    # empty sequences, length 1, lengths that are not tile multiples (tiles 16/32)
    _run_case([5, 0, 37, 1, 50, 0], 2, 32, 32, dtype, "cpu", fc=SMALL_FWD, bc=SMALL_BWD, seed=3, **mask)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "fc,bc",
    [
        (SMALL_FWD, SMALL_BWD_SEP),
        (SMALL_FWD, HSTUBwdConfig(16, 32, 4, 1, "separate", 32)),
        (HSTUFwdConfig(32, 16, 4, 1), HSTUBwdConfig(16, 16, 4, 1, "atomic")),
        (SMALL_FWD, HSTUBwdConfig(16, 32, 4, 1, "separate", dkv_split=True)),
        (SMALL_FWD, HSTUBwdConfig(32, 16, 4, 1, "atomic", dkv_split=True)),
        (SMALL_FWD, HSTUBwdConfig(16, 32, 4, 1, "separate", 32, dkv_split=True, dq_block_n=16)),
        (None, None),
    ],
    ids=["sep", "sep-dq32", "tiles32x16", "sep-dkv-split", "atomic-dkv-split", "sep-dq32x16", "default"],
)
def test_cpu_configs_and_mixed_head_dims(fc, bc):
    _run_case([33, 1, 0, 17], 2, 64, 32, torch.float32, "cpu", ctx=1, targets=True, fc=fc, bc=bc, seed=5)


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [1, 4, 16])
def test_cpu_l2_grouped_launch_order(group):
    """5 sequences x 2 heads = 10 sequence-heads: groups of 4 leave a partial last group of 2."""
    fc = HSTUFwdConfig(32, 16, 4, 1, l2_group=group)
    bc = HSTUBwdConfig(16, 32, 4, 1, "separate", 16, l2_group=group)
    _run_case([33, 1, 0, 47, 9], 2, 32, 32, torch.float32, "cpu", ctx=1, window=20, fc=fc, bc=bc, seed=17)


@pytest.mark.interpreter
def test_cpu_scaling_seqlen_and_max_len_above_lengths():
    inp = make_jagged_inputs([9, 4], 1, 32, 32, torch.float32, "cpu", seed=7, max_seq_len=40)
    args = (inp.seq_offsets, inp.max_seq_len, 0.3, None, 0, 0, 11)
    out = hstu_attention(inp.q, inp.k, inp.v, *args, fwd_config=SMALL_FWD)
    ref = hstu_attention_reference(inp.q, inp.k, inp.v, *args)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_cpu_all_sequences_empty():
    inp = make_jagged_inputs([0, 0], 1, 32, 32, torch.float32, "cpu", requires_grad=True)
    out = hstu_attention(inp.q, inp.k, inp.v, inp.seq_offsets, 4)
    assert out.shape == (0, 1, 32)


GPU_CASES = [
    ([300, 0, 1, 257, 129, 64], 2, 128, 128, {}),
    ([300, 0, 1, 257, 129, 64], 2, 256, 256, dict(ctx=5, targets=True)),
    ([200, 77, 1], 2, 64, 32, dict(window=33)),
    ([513, 2, 190], 4, 32, 128, dict(ctx=3, targets=True, window=40)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=["d128", "d256-ctx-tgt", "d64x32-window", "d32x128-all"])
def test_gpu_default_configs(case, dtype):
    lengths, heads, dqk, dv, mask = case
    _run_case(lengths, heads, dqk, dv, dtype, "cuda", seed=11, **mask)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fc,bc",
    [
        (HSTUFwdConfig(64, 32, 4, 2), HSTUBwdConfig(32, 64, 4, 2, "separate", 64)),
        (HSTUFwdConfig(128, 128, 8, 3), HSTUBwdConfig(64, 128, 8, 1, "atomic")),
        (HSTUFwdConfig(64, 64, 4, 4), HSTUBwdConfig(128, 64, 8, 2, "atomic")),
        (HSTUFwdConfig(128, 64, 8, 2, l2_group=2), HSTUBwdConfig(64, 64, 8, 2, "separate", l2_group=4)),
        (HSTUFwdConfig(64, 64, 4, 2), HSTUBwdConfig(64, 128, 8, 1, "tma")),
        (HSTUFwdConfig(64, 64, 4, 2), HSTUBwdConfig(32, 64, 4, 2, "tma", l2_group=0)),
        (HSTUFwdConfig(64, 64, 4, 2), HSTUBwdConfig(64, 128, 8, 2, "separate", dkv_split=True)),
        (HSTUFwdConfig(64, 64, 4, 2), HSTUBwdConfig(64, 64, 8, 2, "tma", dkv_split=True)),
    ],
    ids=["small", "large", "mixed", "l2-grouped", "tma", "tma-small", "dkv-split", "dkv-split-tma"],
)
def test_gpu_other_configs(fc, bc):
    _run_case([400, 3, 0, 131], 2, 128, 128, torch.bfloat16, "cuda", ctx=2, targets=True, fc=fc, bc=bc, seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_tma_dq_d256_every_mask(dtype):
    """The TMA reduce-add of dQ at D=256 (one 64 KB fp32 box per tile), rows crossing sequence ends."""
    bc = HSTUBwdConfig(32, 64, 8, 2, "tma")
    _run_case([300, 0, 1, 257, 129, 64], 2, 256, 256, dtype, "cuda", ctx=5, targets=True, window=70, bc=bc, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "bc",
    [
        HSTUBwdConfig(64, 64, 8, 2, "separate", dkv_split=True),
        HSTUBwdConfig(32, 128, 8, 2, "separate", dkv_split=True),
        HSTUBwdConfig(32, 128, 8, 2, "separate", 64, dkv_split=True, dq_block_n=64),
        HSTUBwdConfig(32, 128, 8, 3, "separate", 128, dkv_split=True, dq_block_n=32),
    ],
    ids=["64x64", "32x128", "32x128-dq64x64", "32x128s3-dq128x32"],
)
def test_gpu_dkv_split_d256_every_mask(dtype, bc):
    """dV and dK in separate key-block passes at D=256 (the register-bound case), with the dQ
    kernel on the key-block kernel's tiles or its own."""
    _run_case([300, 0, 1, 257, 129, 64], 2, 256, 256, dtype, "cuda", ctx=5, targets=True, window=70, bc=bc, seed=5)


def test_cpu_tma_dq_mode_is_refused_off_gpu():
    from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd

    inp = make_jagged_inputs([5, 3], 2, 32, 32, torch.float32, "cpu", seed=1)
    args = (inp.seq_offsets, inp.max_seq_len, 0.2, None, 0, 0, None)
    with pytest.raises(ValueError, match="dq_mode='tma'"):
        hstu_attention_bwd(torch.ones_like(inp.v), inp.q, inp.k, inp.v, *args, HSTUBwdConfig(16, 16, 4, 1, "tma"))


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["atomic", "separate"])
def test_cpu_backward_writes_every_element_of_given_buffers(mode):
    """Poisoned (NaN) output buffers: every valid element must be overwritten."""
    from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd
    from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd

    inp = make_jagged_inputs([19, 0, 1, 40], 2, 32, 32, torch.float32, "cpu", seed=9)
    args = (inp.seq_offsets, inp.max_seq_len, 0.2, None, 1, 0, None)
    out = hstu_attention_fwd(inp.q, inp.k, inp.v, *args, SMALL_FWD, out=torch.full_like(inp.v, float("nan")))
    bufs = tuple(torch.full_like(t, float("nan")) for t in (inp.q, inp.k, inp.v))
    cfg = HSTUBwdConfig(16, 16, 4, 1, mode)
    grads = hstu_attention_bwd(torch.ones_like(out), inp.q, inp.k, inp.v, *args, cfg, out=bufs)
    assert torch.isfinite(out).all()
    for g, b in zip(grads, bufs, strict=True):
        assert g.data_ptr() == b.data_ptr() and torch.isfinite(g).all()
