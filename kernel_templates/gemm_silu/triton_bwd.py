"""Backward of the uvqk projection y = silu(x W^T + b): a Triton SiLU' pass and two cuBLAS GEMMs.

The pass reads dy (the gradient of y, e.g. the layer's d(uvqk) buffer) and the pre-activation,
writes d_pre = dy * silu'(pre) in the GEMM dtype and per-program fp32 dbias partial sums; then
dx = d_pre W and dW = d_pre^T x run on cuBLAS. The pre-activation is recomputed with one addmm
unless the caller kept it (``pre``). dy may come in column pieces of any floating dtype (one pass launch
each): the fused layer hands the attention backward's fp32 dQ accumulator over as it is, so dQ is never
rounded and written in bf16 only to be read back here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bwd_config import GemmSiluBwdConfig, default_bwd_config
from .torch_impl import recompute_pre


@triton.jit(do_not_specialize=["M", "rows_per_prog"])
def _silu_bwd_kernel(
    DY, PRE, DPRE, DB_part, M, N, rows_per_prog, stride_dy, stride_pre, stride_dpre, stride_db,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # dbias partials stay per (row, column) of the tile and are summed over rows once, after the loop:
    # a sum over rows in every step crosses warps (shared memory and a barrier per step) whenever the
    # tile's rows are spread over warps, which held the pass at ~75% of its memory bandwidth.
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_start = pid_m * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        m2 = (rows < row_end)[:, None] & col_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        g = tl.load(DY + r64 * stride_dy + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        p = tl.load(PRE + r64 * stride_pre + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        s = tl.sigmoid(p)
        d = g * s * (1.0 + p * (1.0 - s))
        d_lo = d.to(DPRE.dtype.element_ty)
        tl.store(DPRE + r64 * stride_dpre + cols[None, :], d_lo, mask=m2)
        db += tl.where(m2, d_lo.to(tl.float32), 0.0)
    tl.store(DB_part + pid_m * stride_db + cols, tl.sum(db, axis=0), mask=col_ok)


def dy_pieces(dy: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """dy as a tuple of column pieces (one tensor is one piece)."""
    return (dy,) if isinstance(dy, torch.Tensor) else tuple(dy)


def _validate(dy, x, weight, bias, pre) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must be (N, {k}) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    pieces = dy_pieces(dy)
    if not pieces or not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in pieces):
        raise ValueError(f"dy must be a 2-D tensor or a tuple of 2-D column pieces, got {type(dy).__name__}")
    widths = [p.shape[1] for p in pieces]
    for i, p in enumerate(pieces):
        name = "dy" if isinstance(dy, torch.Tensor) else f"dy[{i}]"
        if p.shape[0] != m or (p.shape[1] > 1 and p.stride(1) != 1) or not p.is_floating_point():
            raise ValueError(
                f"{name} must be a floating ({m}, ...) tensor with contiguous columns, got {p.dtype} "
                f"{tuple(p.shape)} {p.stride()}"
            )
        if p.device != x.device:
            raise ValueError(f"{name} is on {p.device}, x on {x.device}")
    if sum(widths) != n:
        raise ValueError(f"dy must be ({m}, {n}): its column pieces have widths {widths}, summing to {sum(widths)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if pre is not None and (pre.shape != (m, n) or (n > 1 and pre.stride(1) != 1)):
        raise ValueError(f"pre must be ({m}, {n}) with contiguous columns, got {tuple(pre.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    return m, n, k


def gemm_silu_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    config: GemmSiluBwdConfig | None = None,
    pre: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dweight, dbias) of y = silu(x W^T + b); dbias is None without a bias. ``dy``: one (M, N) tensor
    or a tuple of column pieces (M, N_i), any floating dtype each, that side by side make it."""
    m, n, k = _validate(dy, x, weight, bias, pre)
    config = config or default_bwd_config(n)
    dx_out, dw_out, db_out = out if out is not None else (None, None, None)
    if m == 0:
        dx = torch.zeros((0, k), dtype=x.dtype, device=x.device) if dx_out is None else dx_out
        dw = torch.zeros_like(weight) if dw_out is None else dw_out.zero_()
        db = None if bias is None else (torch.zeros_like(bias) if db_out is None else db_out.zero_())
        return dx, dw, db
    pre = recompute_pre(x, weight, bias) if pre is None else pre
    d_pre = torch.empty((m, n), dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    progs_m = max(1, min(triton.cdiv(m, config.block_m), config.row_programs_per_sm * sms))
    rows_per_prog = triton.cdiv(triton.cdiv(m, progs_m), config.block_m) * config.block_m
    progs_m = triton.cdiv(m, rows_per_prog)
    db_part = torch.empty((progs_m, n), dtype=torch.float32, device=x.device)
    c0 = 0
    for piece in dy_pieces(dy):
        c1 = c0 + piece.shape[1]
        if c1 > c0:
            _silu_bwd_kernel[(progs_m, triton.cdiv(c1 - c0, config.block_n))](
                piece, pre[:, c0:c1], d_pre[:, c0:c1], db_part[:, c0:c1], m, c1 - c0, rows_per_prog,
                piece.stride(0), pre.stride(0), d_pre.stride(0), db_part.stride(0),
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
            )  # fmt: skip
        c0 = c1
    dx = torch.mm(d_pre, weight, out=dx_out) if dx_out is not None else torch.mm(d_pre, weight)
    dw = torch.mm(d_pre.t(), x, out=dw_out) if dw_out is not None else torch.mm(d_pre.t(), x)
    db = None
    if bias is not None:
        db = db_part.sum(0).to(bias.dtype)
        if db_out is not None:
            db = db_out.copy_(db)
    return dx, dw, db
