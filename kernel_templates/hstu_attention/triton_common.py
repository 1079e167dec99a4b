"""Triton helpers shared by the HSTU forward and backward templates: mask ids and loop bounds.

The mask is HSTU.md's: ids collapse the c context tokens to 0 and all targets to one id m; a pair
(i, j) is valid when i == j or id_i > id_j, within the window when there is one, or when row i is a
context row and key j is not a target. Bounds are conservative (a block may hold masked pairs);
"full" ranges are exact (every pair valid), which is what lets the hot loop skip the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreter_bf16(q: torch.Tensor) -> bool:
    """Whether a launch would run bf16 through the Triton interpreter (CPU tensors), whose bf16 ``tl.dot`` is
    wrong (errors of 1e8 on unit inputs): the launchers then compute in fp32 and round the results to bf16."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu"


def row_head_strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    """(row stride, head stride) of each (L, H, D) tensor, flattened: the kernels' stride arguments."""
    return tuple(s for t in tensors for s in (t.stride(0), t.stride(1)))


@triton.jit
def seq_info(seq_offsets, num_targets, b, L, contextual_seq_len, HAS_TARGETS: tl.constexpr):
    """(start offset as int64, length n, first target position, target id m) of sequence b.

    What is read from the offsets and targets is clamped (start to [0, L], end to [start, L], targets
    to [0, n]) so that no input moves a tile outside the L rows: bad offsets give wrong rows (which the
    input check reports), never an out-of-bounds access. Valid inputs are unchanged by the clamps.
    """
    seq_start = tl.load(seq_offsets + b).to(tl.int64)
    seq_end = tl.load(seq_offsets + b + 1).to(tl.int64)
    seq_start = tl.minimum(tl.maximum(seq_start, 0), L)
    seq_end = tl.minimum(tl.maximum(seq_end, seq_start), L)
    n = (seq_end - seq_start).to(tl.int32)
    if HAS_TARGETS:
        t = tl.load(num_targets + b).to(tl.int64)
        t = tl.minimum(tl.maximum(t, 0), n).to(tl.int32)
    else:
        t = 0
    hist_end = n - t
    m_id = n - contextual_seq_len + 1 - t
    return seq_start, n, hist_end, m_id


@triton.jit
def position_ids(offs, contextual_seq_len, m_id, HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """HSTU position ids of positions ``offs`` (context -> 0, targets -> m)."""
    if HAS_CONTEXT:
        ids = tl.maximum(offs - contextual_seq_len + 1, 0)
    else:
        ids = offs + 1
    if HAS_TARGETS:
        ids = tl.minimum(ids, m_id)
    return ids


@triton.jit
def scalar_id(p, contextual_seq_len, m_id, HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr):
    """The id of one position (a scalar twin of ``position_ids``)."""
    if HAS_CONTEXT:
        i = tl.maximum(p - contextual_seq_len + 1, 0)
    else:
        i = p + 1
    if HAS_TARGETS:
        i = tl.minimum(i, m_id)
    return i


@triton.jit
def valid_mask(
    offs_m,
    offs_n,
    n,
    contextual_seq_len,
    max_attn_len,
    m_id,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Boolean (BLOCK_M, BLOCK_N) tile of the mask for rows offs_m and keys offs_n (keys < n)."""
    id_i = position_ids(offs_m, contextual_seq_len, m_id, HAS_CONTEXT, HAS_TARGETS)[:, None]
    id_j = position_ids(offs_n, contextual_seq_len, m_id, HAS_CONTEXT, HAS_TARGETS)[None, :]
    valid = (offs_m[:, None] == offs_n[None, :]) | (id_i > id_j)
    if HAS_WINDOW:
        valid = valid & ((id_i - id_j) <= max_attn_len)
    if HAS_CONTEXT:
        valid = valid | ((id_i == 0) & (id_j < m_id))
    valid = valid & (offs_n[None, :] < n)
    return valid


@triton.jit
def key_range_for_rows(
    start_m,
    n,
    hist_end,
    m_id,
    contextual_seq_len,
    max_attn_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Keys that rows [start_m, start_m + BLOCK_M) may see: (lo, full_end, hi).

    [lo, full_end) is fully valid for every row (no mask needed), [full_end, hi) needs the mask.
    lo and full_end are multiples of BLOCK_N. Empty when the block starts past the sequence.
    """
    end_m = tl.minimum(start_m + BLOCK_M, n)
    hi = end_m
    if HAS_CONTEXT:
        # Context rows see every non-target key.
        hi = tl.where(start_m < contextual_seq_len, tl.maximum(hi, hist_end), hi)
    hi = tl.where(start_m < n, hi, 0)
    lo = 0
    if HAS_WINDOW:
        id_min = scalar_id(start_m, contextual_seq_len, m_id, HAS_CONTEXT, HAS_TARGETS)
        lo = tl.where(id_min - max_attn_len <= 0, 0, id_min - max_attn_len + contextual_seq_len - 1)
        lo = (lo // BLOCK_N) * BLOCK_N
        lo = tl.minimum(lo, (hi // BLOCK_N) * BLOCK_N)
        full_end = lo
    else:
        full_end = (tl.minimum(start_m, hist_end) // BLOCK_N) * BLOCK_N
        if HAS_TARGETS or HAS_CONTEXT:  # m_id < 1 (a context longer than the history): no full tile
            full_end = tl.where(m_id >= 1, full_end, 0)
        full_end = tl.where(start_m < n, full_end, 0)
    return lo, full_end, hi


@triton.jit
def grouped_block_order(L2_GROUP: tl.constexpr):
    """Map the (sequence*head, block) grid to (bh, i): i = 0 is launched first within its bh.

    ``L2_GROUP == 0`` walks all sequence-heads at one block index before the next index (heaviest
    level first everywhere, but the concurrent CTAs share no K/V). ``L2_GROUP == g`` launches every
    block of g sequence-heads before the next g, so the CTAs in flight re-read the same K/V (or Q/dO)
    from L2 instead of HBM.
    """
    num_bh = tl.num_programs(0)
    num_blocks = tl.num_programs(1)
    if L2_GROUP == 0:
        bh = tl.program_id(0)
        i = tl.program_id(1)
    else:
        lin = tl.program_id(1) * num_bh + tl.program_id(0)
        per_group = L2_GROUP * num_blocks
        g = lin // per_group
        r = lin % per_group
        g_size = tl.minimum(num_bh - g * L2_GROUP, L2_GROUP)
        i = r // g_size
        bh = g * L2_GROUP + r % g_size
    return bh, i


@triton.jit
def query_block_setup(
    seq_offsets,
    num_targets,
    L,
    H,
    num_m_blocks,
    contextual_seq_len,
    max_attn_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    L2_GROUP: tl.constexpr,
):
    """The shared prologue of the per-query-block kernels (forward, dQ): which head, sequence, rows, keys.

    Grid (sequence * head, query block); query blocks run last-first so the heaviest causal tiles start
    early, grouped by ``grouped_block_order``. Returns (h, seq_start, n, m_id, start_m, lo, full_end, hi).
    """
    pid_bh, i = grouped_block_order(L2_GROUP)
    pid_m = num_m_blocks - 1 - i
    b = pid_bh // H
    h = pid_bh % H
    seq_start, n, hist_end, m_id = seq_info(seq_offsets, num_targets, b, L, contextual_seq_len, HAS_TARGETS)
    start_m = pid_m * BLOCK_M
    lo, full_end, hi = key_range_for_rows(
        start_m,
        n,
        hist_end,
        m_id,
        contextual_seq_len,
        max_attn_len,
        BLOCK_M,
        BLOCK_N,
        HAS_CONTEXT,
        HAS_TARGETS,
        HAS_WINDOW,
    )
    return h, seq_start, n, m_id, start_m, lo, full_end, hi


@triton.jit
def row_range_for_keys(
    start_n,
    n,
    hist_end,
    m_id,
    contextual_seq_len,
    max_attn_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Rows that may see keys [start_n, start_n + BLOCK_N): (lo, full_start, hi).

    [lo, full_start) needs the mask, [full_start, hi) is valid for every key of the block except for
    rows past n (their loads are zero-filled, so they add nothing). lo and full_start are multiples of
    BLOCK_M.
    """
    end_n = tl.minimum(start_n + BLOCK_N, n)
    lo = (start_n // BLOCK_M) * BLOCK_M
    if HAS_CONTEXT:
        lo = tl.where((start_n < hist_end) & (contextual_seq_len > 0), 0, lo)
    hi = n
    if HAS_WINDOW:
        limit_id = scalar_id(end_n - 1, contextual_seq_len, m_id, HAS_CONTEXT, HAS_TARGETS) + max_attn_len
        hi_w = tl.minimum(n, limit_id + contextual_seq_len)
        if HAS_TARGETS:
            hi_w = tl.where(m_id <= limit_id, n, hi_w)
        hi = hi_w
        full_start = tl.cdiv(hi, BLOCK_M) * BLOCK_M
    else:
        full_start = tl.cdiv(end_n, BLOCK_M) * BLOCK_M
        full_start = tl.where(end_n <= hist_end, full_start, tl.cdiv(hi, BLOCK_M) * BLOCK_M)
        if HAS_TARGETS or HAS_CONTEXT:
            full_start = tl.where(m_id >= 1, full_start, tl.cdiv(hi, BLOCK_M) * BLOCK_M)
    hi = tl.where(start_n < n, hi, 0)
    full_start = tl.where(start_n < n, tl.maximum(full_start, lo), 0)
    lo = tl.where(start_n < n, lo, 0)
    return lo, full_start, hi


@triton.jit
def key_block_setup(
    seq_offsets,
    num_targets,
    L,
    H,
    contextual_seq_len,
    max_attn_len,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    L2_GROUP: tl.constexpr,
):
    """The prologue of the per-key-block backward kernel, the twin of ``query_block_setup``.

    Grid (sequence * head, key block); key blocks run first-first, since under causal masks the first
    ones see the most query rows. Returns (h, seq_start, n, m_id, start_n, lo, full_start, hi).
    """
    pid_bh, pid_n = grouped_block_order(L2_GROUP)
    b = pid_bh // H
    h = pid_bh % H
    seq_start, n, hist_end, m_id = seq_info(seq_offsets, num_targets, b, L, contextual_seq_len, HAS_TARGETS)
    start_n = pid_n * BLOCK_N
    lo, full_start, hi = row_range_for_keys(
        start_n,
        n,
        hist_end,
        m_id,
        contextual_seq_len,
        max_attn_len,
        BLOCK_M,
        BLOCK_N,
        HAS_CONTEXT,
        HAS_TARGETS,
        HAS_WINDOW,
    )
    return h, seq_start, n, m_id, start_n, lo, full_start, hi
