"""Backward of the uvqk projection y = silu(x W^T + b): a Triton SiLU' pass and two cuBLAS GEMMs.

The pass reads dy (the gradient of y, e.g. the layer's d(uvqk) buffer) and the pre-activation,
writes d_pre = dy * silu'(pre) in the GEMM dtype and per-program fp32 dbias partial sums; then
dx = d_pre W and dW = d_pre^T x run on cuBLAS. The pre-activation is recomputed with one addmm
unless the caller kept it (``pre``). A caller that applied SiLU' to dy's first columns itself (the fused
layer does it for u's columns inside the LN * u + dropout backward) passes ``done_cols`` and their bias
gradient: the pass then runs over the other columns only, writing d_pre over dy in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bwd_config import GemmSiluBwdConfig, default_bwd_config
from .torch_impl import recompute_pre


@triton.jit(do_not_specialize=["M", "rows_per_prog"])
def _silu_bwd_kernel(
    DY, PRE, DPRE, DB_part, M, N, rows_per_prog, stride_dy, stride_pre, stride_dpre,
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
    tl.store(DB_part + pid_m * N + cols, tl.sum(db, axis=0), mask=col_ok)


def _validate(dy, x, weight, bias, pre) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must be (N, {k}) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    if dy.shape != (m, n) or (n > 1 and dy.stride(1) != 1):
        raise ValueError(f"dy must be ({m}, {n}) with contiguous columns, got {tuple(dy.shape)} {dy.stride()}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if pre is not None and (pre.shape != (m, n) or (n > 1 and pre.stride(1) != 1)):
        raise ValueError(f"pre must be ({m}, {n}) with contiguous columns, got {tuple(pre.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    return m, n, k


def check_done_cols(done_cols: int, done_db: torch.Tensor | None, n: int, bias: torch.Tensor | None,
                    device: torch.device, dy_dtype: torch.dtype, x_dtype: torch.dtype) -> int:  # fmt: skip
    """``done_cols`` as a column count (``ValueError`` naming the argument), with its fp32 bias gradient."""
    if not isinstance(done_cols, int) or isinstance(done_cols, bool) or not 0 <= done_cols <= n:
        raise ValueError(f"done_cols must be an int in [0, {n}], got {done_cols!r}")
    if done_cols and dy_dtype != x_dtype:
        raise ValueError(f"dy must be {x_dtype} like x with done_cols (d_pre is written over it), got {dy_dtype}")
    if done_cols and bias is not None:
        if not isinstance(done_db, torch.Tensor) or tuple(done_db.shape) != (done_cols,):
            got = tuple(done_db.shape) if isinstance(done_db, torch.Tensor) else done_db
            raise ValueError(f"done_db must be the ({done_cols},) bias gradient of the done columns, got {got!r}")
        if done_db.dtype != torch.float32 or done_db.device != device:
            raise ValueError(f"done_db must be float32 on {device}, got {done_db.dtype} on {done_db.device}")
    return done_cols


def gemm_silu_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    config: GemmSiluBwdConfig | None = None,
    pre: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    done_cols: int = 0,
    done_db: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dweight, dbias) of y = silu(x W^T + b); dbias is None without a bias.

    ``done_cols``: dy's first columns already hold d_pre (``done_db``: their fp32 bias gradient, needed with a
    bias); d_pre is then written over the rest of dy, which the caller gives up."""
    m, n, k = _validate(dy, x, weight, bias, pre)
    c = check_done_cols(done_cols, done_db, n, bias, dy.device, dy.dtype, x.dtype)
    config = config or default_bwd_config(n)
    dx_out, dw_out, db_out = out if out is not None else (None, None, None)
    if m == 0:
        dx = torch.zeros((0, k), dtype=x.dtype, device=x.device) if dx_out is None else dx_out
        dw = torch.zeros_like(weight) if dw_out is None else dw_out.zero_()
        db = None if bias is None else (torch.zeros_like(bias) if db_out is None else db_out.zero_())
        return dx, dw, db
    pre = recompute_pre(x, weight, bias) if pre is None else pre
    d_pre = dy if c else torch.empty((m, n), dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    progs_m = max(1, min(triton.cdiv(m, config.block_m), config.row_programs_per_sm * sms))
    rows_per_prog = triton.cdiv(triton.cdiv(m, progs_m), config.block_m) * config.block_m
    progs_m = triton.cdiv(m, rows_per_prog)
    db_part = torch.empty((progs_m, n - c), dtype=torch.float32, device=x.device)
    if n > c:
        _silu_bwd_kernel[(progs_m, triton.cdiv(n - c, config.block_n))](
            dy[:, c:], pre[:, c:], d_pre[:, c:], db_part, m, n - c, rows_per_prog, dy.stride(0), pre.stride(0),
            d_pre.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
        )  # fmt: skip
    dx = torch.mm(d_pre, weight, out=dx_out) if dx_out is not None else torch.mm(d_pre, weight)
    dw = torch.mm(d_pre.t(), x, out=dw_out) if dw_out is not None else torch.mm(d_pre.t(), x)
    db = None
    if bias is not None:
        db = db_part.sum(0)
        db = (torch.cat([done_db, db]) if c else db).to(bias.dtype)
        if db_out is not None:
            db = db_out.copy_(db)
    return dx, dw, db
