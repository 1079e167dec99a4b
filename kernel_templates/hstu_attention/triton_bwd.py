"""Triton template: jagged HSTU attention backward.

Parallel over key blocks of every sequence (grid: sequence*head x key block), so a long sequence
among short ones spreads over many programs instead of serialising on one. Each program keeps its
K/V tile, walks the query blocks that can see it, accumulates dK and dV in registers, and produces
dQ one of three ways (``HSTUBwdConfig.dq_mode``): fp32 atomics into a dQ accumulator (``atomic``,
one red per element), the same accumulator through a TMA reduce-add of the whole tile (``tma``,
Hopper, a tensor descriptor; rows past the sequence end add exact zeros, as dS is zero there), or a
second kernel over query blocks that recomputes S and dP (``separate``). No log-sum-exp is needed:
HSTU has no softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernel_templates.launch_checks import config_of, outputs_apart

from .config import HSTUBwdConfig
from .input_check import check_launch, check_out, launch_lengths, launch_mask_lengths, validate_hstu_grad
from .reference import score_scale
from .triton_common import (
    interpreter_bf16,
    key_block_setup,
    query_block_setup,
    row_head_strides,
    valid_mask,
)
from .triton_fwd import dot_precision


@triton.jit
def _bwd_kv_blocks(
    dk,
    dv,
    m_lo,
    m_hi,
    k,
    v,
    q_ptrs,
    do_ptrs,
    dq_ptrs,
    dq_desc,
    dq_row0,
    dq_col,
    offs_m,
    offs_n,
    n,
    alpha,
    dq_scale,
    contextual_seq_len,
    max_attn_len,
    m_id,
    stride_qm,
    stride_dom,
    stride_dqm,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    TMA_DQ: tl.constexpr,
    COMPUTE_DK: tl.constexpr,
    COMPUTE_DV: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dK / dV of one key block over the query blocks starting in [m_lo, m_hi), every one masked or none."""
    for start_m in range(m_lo, m_hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < n
        q = tl.load(q_ptrs + start_m * stride_qm, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptrs + start_m * stride_dom, mask=row_ok[:, None], other=0.0)
        # Transposed scores: (BLOCK_N, BLOCK_M), keys along rows.
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * alpha
        sig = tl.sigmoid(st)
        pt = st * sig
        dsilu = sig * (1.0 + st * (1.0 - sig))
        if MASKED:
            valid = tl.trans(
                valid_mask(
                    rows, offs_n, n, contextual_seq_len, max_attn_len, m_id, HAS_CONTEXT, HAS_TARGETS, HAS_WINDOW
                )
            )
            pt = tl.where(valid, pt, 0.0)
            dsilu = tl.where(valid, dsilu, 0.0)
        if COMPUTE_DV:
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        if COMPUTE_DK:
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dst = (dpt * dsilu).to(q.dtype)
            dk = tl.dot(dst, q, dk, input_precision=PRECISION)
            if ATOMIC_DQ:
                dq = tl.dot(tl.trans(dst), k, input_precision=PRECISION) * dq_scale
                if TMA_DQ:
                    dq_desc.atomic_add([dq_row0 + start_m, dq_col], dq)
                else:
                    tl.atomic_add(dq_ptrs + start_m * stride_dqm, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


# L (the batch's row count) changes every batch: no recompiles for it.
@triton.jit(do_not_specialize=["L"])
def _hstu_bwd_kv_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    DQ_DESC,
    DK,
    DV,
    seq_offsets,
    num_targets,
    stride_qm,
    stride_qh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_dom,
    stride_doh,
    stride_dqm,
    stride_dqh,
    stride_dkm,
    stride_dkh,
    stride_dvm,
    stride_dvh,
    alpha,
    inv_scale,
    L,
    H,
    contextual_seq_len,
    max_attn_len,
    ATOMIC_DQ: tl.constexpr,
    TMA_DQ: tl.constexpr,
    COMPUTE_DK: tl.constexpr,
    COMPUTE_DV: tl.constexpr,
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
    h, seq_start, n, m_id, start_n, lo, full_start, hi = key_block_setup(
        seq_offsets,
        num_targets,
        L,
        H,
        contextual_seq_len,
        max_attn_len,
        BLOCK_M,
        BLOCK_N,
        HAS_CONTEXT,
        HAS_TARGETS,
        HAS_WINDOW,
        L2_GROUP,
    )
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, D_QK)
    offs_dv = tl.arange(0, D_V)
    col_ok = offs_n < n
    k = tl.load(
        K + seq_start * stride_km + h * stride_kh + offs_n[:, None] * stride_km + offs_dqk[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V + seq_start * stride_vm + h * stride_vh + offs_n[:, None] * stride_vm + offs_dv[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    q_ptrs = Q + seq_start * stride_qm + h * stride_qh + offs_m[:, None] * stride_qm + offs_dqk[None, :]
    do_ptrs = DO + seq_start * stride_dom + h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :]
    dq_ptrs = DQ + seq_start * stride_dqm + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_dqk[None, :]
    dk = tl.zeros((BLOCK_N, D_QK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D_V), dtype=tl.float32)
    dq_scale = alpha * inv_scale
    dq_row0 = seq_start.to(tl.int32)
    dq_col = h * D_QK
    # Query blocks that need the mask (diagonal, targets, window edges), then the ones that do not.
    dk, dv = _bwd_kv_blocks(
        dk, dv, lo, full_start, k, v, q_ptrs, do_ptrs, dq_ptrs, DQ_DESC, dq_row0, dq_col, offs_m, offs_n, n, alpha,
        dq_scale, contextual_seq_len, max_attn_len, m_id, stride_qm, stride_dom, stride_dqm, BLOCK_M, True,
        ATOMIC_DQ, TMA_DQ, COMPUTE_DK, COMPUTE_DV, HAS_CONTEXT, HAS_TARGETS, HAS_WINDOW, PRECISION,
    )  # fmt: skip
    dk, dv = _bwd_kv_blocks(
        dk, dv, full_start, hi, k, v, q_ptrs, do_ptrs, dq_ptrs, DQ_DESC, dq_row0, dq_col, offs_m, offs_n, n, alpha,
        dq_scale, contextual_seq_len, max_attn_len, m_id, stride_qm, stride_dom, stride_dqm, BLOCK_M, False,
        ATOMIC_DQ, TMA_DQ, COMPUTE_DK, COMPUTE_DV, HAS_CONTEXT, HAS_TARGETS, HAS_WINDOW, PRECISION,
    )  # fmt: skip
    if COMPUTE_DK:
        tl.store(
            DK + seq_start * stride_dkm + h * stride_dkh + offs_n[:, None] * stride_dkm + offs_dqk[None, :],
            (dk * dq_scale).to(DK.dtype.element_ty),
            mask=col_ok[:, None],
        )
    if COMPUTE_DV:
        tl.store(
            DV + seq_start * stride_dvm + h * stride_dvh + offs_n[:, None] * stride_dvm + offs_dv[None, :],
            (dv * inv_scale).to(DV.dtype.element_ty),
            mask=col_ok[:, None],
        )


@triton.jit
def _bwd_q_tile(
    dq,
    q,
    do,
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
        k = tl.load(k_ptrs + start_n * stride_kn, mask=(cols < n)[:, None], other=0.0)
        vt = tl.load(v_ptrs + start_n * stride_vn, mask=(cols < n)[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn)
        vt = tl.load(v_ptrs + start_n * stride_vn)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * alpha
    sig = tl.sigmoid(s)
    dsilu = sig * (1.0 + s * (1.0 - sig))
    if MASKED:
        valid = valid_mask(
            offs_m, cols, n, contextual_seq_len, max_attn_len, m_id, HAS_CONTEXT, HAS_TARGETS, HAS_WINDOW
        )
        dsilu = tl.where(valid, dsilu, 0.0)
    dp = tl.dot(do, vt, input_precision=PRECISION)
    ds = (dp * dsilu).to(k.dtype)
    dq = tl.dot(ds, k, dq, input_precision=PRECISION)
    return dq


# num_m_blocks follows max_seq_len and L the batch's row count: no recompiles for them.
@triton.jit(do_not_specialize=["num_m_blocks", "L"])
def _hstu_bwd_q_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    seq_offsets,
    num_targets,
    stride_qm,
    stride_qh,
    stride_km,
    stride_kh,
    stride_vm,
    stride_vh,
    stride_dom,
    stride_doh,
    stride_dqm,
    stride_dqh,
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
    q = tl.load(
        Q + seq_start * stride_qm + h * stride_qh + offs_m[:, None] * stride_qm + offs_dqk[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + seq_start * stride_dom + h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    k_ptrs = K + seq_start * stride_km + h * stride_kh + offs_n[:, None] * stride_km + offs_dqk[None, :]
    # V read transposed: (D_V, BLOCK_N) tiles.
    v_ptrs = V + seq_start * stride_vm + h * stride_vh + offs_n[None, :] * stride_vm + offs_dv[:, None]
    dq = tl.zeros((BLOCK_M, D_QK), dtype=tl.float32)
    for start_n in range(lo, full_end, BLOCK_N):
        dq = _bwd_q_tile(
            dq,
            q,
            do,
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
        dq = _bwd_q_tile(
            dq,
            q,
            do,
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
    dq = dq * (alpha * inv_scale)
    tl.store(
        DQ + seq_start * stride_dqm + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_dqk[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )


def check_grad_outs(out: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> None:
    """``out=(dq, dk, dv)``: three buffers of q's, k's and v's shapes on their device, apart from the inputs and
    from each other, else a ``ValueError`` naming the buffer (the kernels store through their strides unchecked)."""
    if not isinstance(out, tuple | list) or len(out) != 3:
        raise ValueError(f"out must be a tuple (dq, dk, dv) of three tensors, got {type(out).__name__}")
    names = ("out[0] (dq)", "out[1] (dk)", "out[2] (dv)")
    for name, t, like in zip(names, out, (q, k, v), strict=True):
        check_out(name, t, tuple(like.shape), q.device)
    outputs_apart({"q": q, "k": k, "v": v, "do": do}, dict(zip(names, out, strict=True)))


def hstu_attention_bwd(
    do: torch.Tensor,
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
    config: HSTUBwdConfig,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward template; returns (dq, dk, dv) in the inputs' dtype. dQ sums in fp32.

    ``out=(dq, dk, dv)`` lets callers (the tuner's poisoned-buffer check) pass the output buffers. Shapes, dtypes,
    devices, scalars, ``do`` and ``out`` are checked here (``check_launch``); the offsets' contents are not.
    """
    check_launch(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len,
                 scaling_seqlen)  # fmt: skip
    config_of(config, HSTUBwdConfig)
    validate_hstu_grad(do, q, v)
    if out is not None:
        check_grad_outs(out, q, k, v, do)
    return hstu_attention_bwd_validated(
        do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
        config, out,
    )  # fmt: skip


def hstu_attention_bwd_validated(
    do: torch.Tensor,
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
    config: HSTUBwdConfig,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hstu_attention_bwd`` without its checks: the runtime launcher (the spec's), for callers that validated
    the inputs, ``do`` and the config (``autotune.runtime.ops``, ``op.hstu_attention``; the autograd backward gets
    ``do`` of the output's shape, dtype and device from the engine) and own ``out`` (the fused layer's d(uvqk)
    views). About 2 us a launch less; direct callers take the checked entry."""
    if interpreter_bf16(q):
        args = (seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen)
        res = hstu_attention_bwd_validated(do.float(), q.float(), k.float(), v.float(), *args, config)
        if out is None:
            return tuple(r.to(t.dtype) for r, t in zip(res, (q, k, v), strict=True))
        return tuple(o.copy_(r) for o, r in zip(out, res, strict=True))
    L, H, dqk = q.shape
    # Window and context capped as every call path caps them: the kernels add them to position ids in int32.
    contextual_seq_len, max_attn_len = launch_mask_lengths(int(contextual_seq_len), int(max_attn_len), L)
    # A max_seq_len past the rows sized the grid for blocks that cannot exist (past CUDA's 65535: a launch error).
    max_seq_len, scaling_seqlen = launch_lengths(int(max_seq_len), scaling_seqlen, L)
    dv_dim = v.shape[2]
    do = do.contiguous() if do.stride(-1) != 1 else do
    batch = seq_offsets.numel() - 1
    dq_out, dk, dv = out if out is not None else (None, torch.empty_like(k), torch.empty_like(v))
    atomic = config.dq_mode in ("atomic", "tma")
    if L == 0 or batch == 0 or max_seq_len == 0:
        return (torch.zeros_like(q) if dq_out is None else dq_out.zero_()), dk.zero_(), dv.zero_()
    dq_acc = (
        torch.zeros((L, H, dqk), dtype=torch.float32, device=q.device)
        if atomic
        else (torch.empty_like(q) if dq_out is None else dq_out)
    )
    scale = score_scale(max_seq_len, scaling_seqlen)
    common = dict(
        HAS_CONTEXT=contextual_seq_len > 0,
        HAS_TARGETS=num_targets is not None,
        HAS_WINDOW=max_attn_len > 0,
        D_QK=dqk,
        D_V=dv_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        L2_GROUP=config.l2_group,
    )
    nt = num_targets if num_targets is not None else seq_offsets
    dq_desc = None
    if config.dq_mode == "tma":
        cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
        if cap is None or cap[0] < 9:
            where = f"{q.device}" + (f" (sm{cap[0]}{cap[1]})" if cap else "")
            raise ValueError(f"config.dq_mode='tma' needs an sm90+ GPU (TMA reduce-add); q is on {where}")
        # (L, H * Dqk) view: one box is BLOCK_M rows of one head; TMA clips rows past L.
        flat = dq_acc.view(L, H * dqk)
        dq_desc = TensorDescriptor(
            flat, shape=list(flat.shape), strides=list(flat.stride()), block_shape=[config.block_m, dqk]
        )
    grid = (batch * H, triton.cdiv(max_seq_len, config.block_n))
    # dkv_split: a dV pass, then a dK pass (which also makes any in-kernel dQ), one accumulator each.
    passes = ((False, True), (True, False)) if config.dkv_split else ((True, True),)
    # Shared launch arguments: (row, head) strides of q, k, v, do, dQ, then the scalars.
    strides = row_head_strides(q, k, v, do, dq_acc)
    scalars = (float(alpha), 1.0 / float(scale), L, H, int(contextual_seq_len), int(max_attn_len))
    for compute_dk, compute_dv in passes:
        _hstu_bwd_kv_kernel[grid](
            *(q, k, v, do, dq_acc, dq_desc, dk, dv, seq_offsets, nt),
            *strides,
            *row_head_strides(dk, dv),
            *scalars,
            ATOMIC_DQ=atomic and compute_dk,
            TMA_DQ=config.dq_mode == "tma" and compute_dk,
            COMPUTE_DK=compute_dk,
            COMPUTE_DV=compute_dv,
            **common,
        )
    if atomic:
        return (dq_acc.to(q.dtype) if dq_out is None else dq_out.copy_(dq_acc)), dk, dv
    num_m_blocks = triton.cdiv(max_seq_len, config.dq_rows)
    common.update(BLOCK_M=config.dq_rows, BLOCK_N=config.dq_cols)
    _hstu_bwd_q_kernel[(batch * H, num_m_blocks)](
        *(q, k, v, do, dq_acc, seq_offsets, nt), *strides, *scalars, num_m_blocks, **common
    )
    return dq_acc, dk, dv
