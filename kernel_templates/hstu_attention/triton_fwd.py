"""Triton template: jagged HSTU attention forward.

One program per (query block, sequence, head). The key loop is split in two: a mask-free part over
key blocks every row may fully see, then a masked part (diagonal, targets, window, context). Heavy
query blocks (late in causal order) are launched first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_templates.launch_checks import config_of, outputs_apart

from .config import HSTUFwdConfig
from .input_check import check_launch, check_out, launch_lengths, launch_mask_lengths
from .reference import score_scale
from .triton_common import interpreter_bf16, query_block_setup, row_head_strides, valid_mask


@triton.jit
def _fwd_tile(
    acc,
    q,
    k_ptrs,
    v_ptrs,
    start_n,
    offs_m,
    offs_n,
    n,
    alpha,
    contextual_seq_len,
    max_attn_len,
    m_id,
    stride_kn,
    stride_vn,
    MASKED: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    cols = start_n + offs_n
    if MASKED:
        kt = tl.load(k_ptrs + start_n * stride_kn, mask=(cols < n)[None, :], other=0.0)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=(cols < n)[:, None], other=0.0)
    else:
        kt = tl.load(k_ptrs + start_n * stride_kn)
        v = tl.load(v_ptrs + start_n * stride_vn)
    s = tl.dot(q, kt, input_precision=PRECISION) * alpha
    p = s * tl.sigmoid(s)
    if MASKED:
        valid = valid_mask(
            offs_m, cols, n, contextual_seq_len, max_attn_len, m_id, HAS_CONTEXT, HAS_TARGETS, HAS_WINDOW
        )
        p = tl.where(valid, p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc


# num_m_blocks follows max_seq_len and L the batch's row count, which may change every batch: no
# recompiles for them.
@triton.jit(do_not_specialize=["num_m_blocks", "L"])
def _hstu_fwd_kernel(
    Q,
    K,
    V,
    O,
    seq_offsets,
    num_targets,
    stride_qm,
    stride_qh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_om,
    stride_oh,
    alpha,
    inv_scale,
    L,
    H,
    contextual_seq_len,
    max_attn_len,
    num_m_blocks,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    L2_GROUP: tl.constexpr,
):
    h, seq_start, n, m_id, start_m, lo, full_end, hi = query_block_setup(
        seq_offsets,
        num_targets,
        L,
        H,
        num_m_blocks,
        contextual_seq_len,
        max_attn_len,
        BLOCK_M,
        BLOCK_N,
        HAS_CONTEXT,
        HAS_TARGETS,
        HAS_WINDOW,
        L2_GROUP,
    )
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, D_QK)
    offs_dv = tl.arange(0, D_V)
    row_ok = offs_m < n
    q_ptrs = Q + seq_start * stride_qm + h * stride_qh + offs_m[:, None] * stride_qm + offs_dqk[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    # K is read transposed: (D_QK, BLOCK_N) tiles.
    k_ptrs = K + seq_start * stride_km + h * stride_kh + offs_n[None, :] * stride_km + offs_dqk[:, None]
    v_ptrs = V + seq_start * stride_vm + h * stride_vh + offs_n[:, None] * stride_vm + offs_dv[None, :]
    acc = tl.zeros((BLOCK_M, D_V), dtype=tl.float32)
    for start_n in range(lo, full_end, BLOCK_N):
        acc = _fwd_tile(
            acc,
            q,
            k_ptrs,
            v_ptrs,
            start_n,
            offs_m,
            offs_n,
            n,
            alpha,
            contextual_seq_len,
            max_attn_len,
            m_id,
            stride_km,
            stride_vm,
            False,
            HAS_CONTEXT,
            HAS_TARGETS,
            HAS_WINDOW,
            PRECISION,
        )
    for start_n in range(full_end, hi, BLOCK_N):
        acc = _fwd_tile(
            acc,
            q,
            k_ptrs,
            v_ptrs,
            start_n,
            offs_m,
            offs_n,
            n,
            alpha,
            contextual_seq_len,
            max_attn_len,
            m_id,
            stride_km,
            stride_vm,
            True,
            HAS_CONTEXT,
            HAS_TARGETS,
            HAS_WINDOW,
            PRECISION,
        )
    acc = acc * inv_scale
    o_ptrs = O + seq_start * stride_om + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact (ieee) products; half types use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def hstu_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    config: HSTUFwdConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the forward template with an explicit tile config. The offsets' contents are assumed validated
    (the kernels clamp them); shapes, dtypes, devices, scalars and ``out`` are checked here (``check_launch``).

    ``out`` lets callers (the tuner's poisoned-buffer check) pass the output buffer.
    """
    check_launch(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len,
                 scaling_seqlen)  # fmt: skip
    config_of(config, HSTUFwdConfig)
    if out is not None:
        check_out("out", out, (q.shape[0], q.shape[1], v.shape[2]), q.device)
        outputs_apart({"q": q, "k": k, "v": v}, {"out": out})
    return hstu_attention_fwd_validated(
        q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
        config, out,
    )  # fmt: skip


def hstu_attention_fwd_validated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    config: HSTUFwdConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``hstu_attention_fwd`` without its checks: the runtime launcher (the spec's), for callers that validated
    every argument ``check_launch``, the config check and the ``out`` checks cover (``autotune.runtime.ops`` and
    ``op.hstu_attention`` unless told ``validate="none"``, the fused layer on its own buffers). About 2 us a
    launch less; direct callers take the checked entry."""
    if interpreter_bf16(q):
        args = (seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen)
        res = hstu_attention_fwd_validated(q.float(), k.float(), v.float(), *args, config)
        return res.to(q.dtype) if out is None else out.copy_(res)
    L, H, dqk = q.shape
    # Window and context capped as every call path caps them: the kernels add them to position ids in int32.
    contextual_seq_len, max_attn_len = launch_mask_lengths(int(contextual_seq_len), int(max_attn_len), L)
    # A max_seq_len past the rows sized the grid for blocks that cannot exist (past CUDA's 65535: a launch error).
    max_seq_len, scaling_seqlen = launch_lengths(int(max_seq_len), scaling_seqlen, L)
    dv = v.shape[2]
    if out is None:
        out = torch.empty((L, H, dv), dtype=q.dtype, device=q.device)
    batch = seq_offsets.numel() - 1
    if L == 0 or batch == 0 or max_seq_len == 0:
        return out.zero_()
    scale = score_scale(max_seq_len, scaling_seqlen)
    num_m_blocks = triton.cdiv(max_seq_len, config.block_m)
    grid = (batch * H, num_m_blocks)
    _hstu_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        seq_offsets,
        num_targets if num_targets is not None else seq_offsets,
        *row_head_strides(q, k, v, out),
        float(alpha),
        1.0 / float(scale),
        L,
        H,
        int(contextual_seq_len),
        int(max_attn_len),
        num_m_blocks,
        HAS_CONTEXT=contextual_seq_len > 0,
        HAS_TARGETS=num_targets is not None,
        HAS_WINDOW=max_attn_len > 0,
        D_QK=dqk,
        D_V=dv,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        L2_GROUP=config.l2_group,
    )
    return out
