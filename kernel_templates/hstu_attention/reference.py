"""PyTorch reference for jagged HSTU attention: the oracle every kernel is checked against.

Written for clarity, not speed: each sequence is handled on its own with an explicit mask, a block of
query rows at a time (``row_chunks``), so memory stays bounded for any length (one fp32 (H, n, n) score
tensor of a 32K sequence with 4 heads would take 16 GiB). The forward computes in fp32 (or in
``compute_dtype`` when asked, which the tolerance rule uses to measure "PyTorch's own error in the
kernel's dtype"); the backward is autograd through the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hstu_position_ids(
    n: int,
    contextual_seq_len: int = 0,
    num_targets: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, int]:
    """Position ids of one sequence and the target id ``m`` (docs/CONTRACTS.md).

    The c context tokens share id 0, history tokens count up from 1, and all T targets share id m.
    """
    p = torch.arange(n, device=device)
    ids = torch.clamp(p - contextual_seq_len + 1, min=0)
    t = 0 if num_targets is None else int(num_targets)
    m = n - contextual_seq_len + 1 - t
    if num_targets is not None:
        ids = torch.minimum(ids, torch.full_like(ids, m))
    return ids, m


def hstu_mask(
    n: int,
    contextual_seq_len: int = 0,
    num_targets: int | None = None,
    max_attn_len: int = 0,
    device: torch.device | str | None = None,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Boolean mask M[i, j]: may query i attend to key j; (n, n), or the query rows ``rows = (r0, r1)``
    only, (r1 - r0, n)."""
    ids, m = hstu_position_ids(n, contextual_seq_len, num_targets, device)
    r0, r1 = (0, n) if rows is None else rows
    id_i = ids[r0:r1].view(-1, 1)
    id_j = ids.view(1, n)
    eye = torch.arange(r0, r1, device=device).view(-1, 1) == torch.arange(n, device=device).view(1, n)
    valid = eye | (id_i > id_j)
    if max_attn_len > 0:
        valid = valid & (id_i - id_j <= max_attn_len)
    if contextual_seq_len > 0:
        valid = valid | ((id_i == 0) & (id_j < m))
    return valid


def score_scale(max_seq_len: int, scaling_seqlen: int | None) -> float:
    """S of the 1/S score scale (docs/CONTRACTS.md): ``scaling_seqlen`` when given, else ``max_seq_len``."""
    return float(scaling_seqlen if scaling_seqlen is not None else max_seq_len)


# Elements of one (H, rows, n) block of scores: 2^26 fp32 = 256 MiB, so the few such tensors the forward
# and its autograd keep stay within a few GiB whatever the sequence length.
ROW_BLOCK_ELEMENTS = 1 << 26


def row_chunks(n: int, heads: int, budget: int | None = None) -> list[tuple[int, int]]:
    """Query-row ranges [r0, r1) covering [0, n) whose (heads, rows, n) score block fits ``budget``
    elements (default ``ROW_BLOCK_ELEMENTS``; at least one row each); one range for short sequences."""
    budget = ROW_BLOCK_ELEMENTS if budget is None else budget
    step = max(1, budget // max(1, heads * n))
    return [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]


def sequence_rows(
    qb: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    rows: tuple[int, int],
    alpha: float,
    scale: float,
    num_targets: int | None,
    contextual_seq_len: int,
    max_attn_len: int,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """Output rows ``rows`` of one sequence, (r1 - r0, H, Dv): ``qb`` holds those query rows, ``kb`` and
    ``vb`` the whole sequence, all (rows, H, D). Differentiable through autograd."""
    n = kb.shape[0]
    q_, k_, v_ = (t.to(compute_dtype).transpose(0, 1) for t in (qb, kb, vb))  # (H, rows, D)
    mask = hstu_mask(n, contextual_seq_len, num_targets, max_attn_len, device=qb.device, rows=rows)
    s = alpha * torch.matmul(q_, k_.transpose(1, 2))
    p = F.silu(s) * mask.to(compute_dtype) / scale
    return torch.matmul(p.to(compute_dtype), v_).transpose(0, 1)


def hstu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    alpha: float,
    num_targets: torch.Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    scaling_seqlen: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Jagged HSTU attention, O_i = (1/S) sum_j M_ij silu(alpha <q_i, k_j>) v_j.

    Returns a tensor of q's dtype with shape (L, H, Dv). Differentiable through autograd.
    """
    scale = score_scale(max_seq_len, scaling_seqlen)
    offsets = seq_offsets.tolist()
    outs = []
    for b in range(len(offsets) - 1):
        start, end = int(offsets[b]), int(offsets[b + 1])
        t = None if num_targets is None else int(num_targets[b])
        kb, vb = k[start:end], v[start:end]
        for r0, r1 in row_chunks(end - start, q.shape[1]):
            outs.append(
                sequence_rows(
                    q[start + r0 : start + r1], kb, vb, (r0, r1), alpha, scale, t, contextual_seq_len,
                    max_attn_len, compute_dtype,
                )
            )  # fmt: skip
    if not outs:  # every sequence empty: zeros that still belong to q, k and v's autograd graph
        return (v * 0 + (q[..., :1] + k[..., :1]) * 0).to(q.dtype)
    return torch.cat(outs, dim=0).to(q.dtype)


def hstu_attention_flops(
    seq_offsets: torch.Tensor,
    num_heads: int,
    dqk: int,
    dv: int,
    contextual_seq_len: int = 0,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
) -> tuple[float, float]:
    """(forward, backward) FLOPs by the field's convention: 2*H*(Dqk+Dv)*P and 2*H*(3Dqk+2Dv)*P.

    P counts valid (i, j) pairs exactly from the mask for masked variants; for plain causal attention
    it is the convention's n^2/2 (docs/CONTRACTS.md; the mask itself holds n(n+1)/2), unrounded: n // 2 counted a
    length-1 sequence as no work and every odd length half a pair short.
    """
    lengths = (seq_offsets[1:] - seq_offsets[:-1]).tolist()
    plain = contextual_seq_len == 0 and num_targets is None and max_attn_len == 0
    pairs = 0
    for b, n in enumerate(lengths):
        n = int(n)
        if n == 0:
            continue
        if plain:
            pairs += n * n / 2
        else:
            t = None if num_targets is None else int(num_targets[b])
            for rows in row_chunks(n, 1):
                pairs += int(hstu_mask(n, contextual_seq_len, t, max_attn_len, rows=rows).sum())
    fwd = 2.0 * num_heads * (dqk + dv) * pairs
    bwd = 2.0 * num_heads * (3 * dqk + 2 * dv) * pairs
    return fwd, bwd
