"""Backward of the uvqk projection y = silu(x W^T + b): a Triton SiLU' pass and two cuBLAS GEMMs.

The pass reads dy (the gradient of y, e.g. the layer's d(uvqk) buffer) and the pre-activation,
writes d_pre = dy * silu'(pre) in the GEMM dtype and per-program fp32 dbias partial sums; then
dx = d_pre W and dW = d_pre^T x run on cuBLAS. The pre-activation is recomputed with one addmm
unless the caller kept it (``pre``).

- dy may come in column pieces of any floating dtype (one pass launch each): the fused layer hands the
  attention backward's fp32 dQ accumulator over as it is, so dQ is never rounded and written in bf16
  only to be read back here.
- A caller that applied SiLU' to the first columns itself (the fused layer does it for u's columns inside
  the LN * u + dropout backward) passes ``done_cols`` and their bias gradient: the pass then runs over the
  other columns only, writing d_pre in place (over dy, or into the ``d_pre`` buffer the pieces live in).
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
    dy: torch.Tensor | tuple[torch.Tensor, ...],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    config: GemmSiluBwdConfig | None = None,
    pre: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    done_cols: int = 0,
    done_db: torch.Tensor | None = None,
    d_pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dweight, dbias) of y = silu(x W^T + b); dbias is None without a bias.

    ``dy``: one (M, N) tensor or a tuple of column pieces (M, N_i), any floating dtype each, that side by side
    make it. ``d_pre``: the (M, N) buffer in x's dtype that d_pre is written into (pieces of dy may be its own
    columns: each element is read before it is written); by default dy itself with ``done_cols`` (the caller
    gives it up), else a new one. ``done_cols``: d_pre's first columns already hold it (``done_db``: their fp32
    bias gradient, needed with a bias)."""
    m, n, k = _validate(dy, x, weight, bias, pre)
    if d_pre is None and done_cols and not isinstance(dy, torch.Tensor):
        raise ValueError("d_pre must be given with done_cols when dy comes in column pieces")
    buf = dy if d_pre is None and done_cols else d_pre
    c = check_done_cols(done_cols, done_db, n, bias, x.device, buf.dtype if buf is not None else x.dtype, x.dtype)
    if d_pre is not None and (
        not isinstance(d_pre, torch.Tensor) or tuple(d_pre.shape) != (m, n) or d_pre.dtype != x.dtype
        or d_pre.device != x.device or (n > 1 and d_pre.stride(1) != 1)
    ):  # fmt: skip
        got = f"{d_pre.dtype} {tuple(d_pre.shape)} on {d_pre.device}" if isinstance(d_pre, torch.Tensor) else d_pre
        raise ValueError(
            f"d_pre must be a ({m}, {n}) {x.dtype} tensor on {x.device} with contiguous columns, got {got}"
        )
    config = config or default_bwd_config(n)
    dx_out, dw_out, db_out = out if out is not None else (None, None, None)
    if m == 0:
        dx = torch.zeros((0, k), dtype=x.dtype, device=x.device) if dx_out is None else dx_out
        dw = torch.zeros_like(weight) if dw_out is None else dw_out.zero_()
        db = None if bias is None else (torch.zeros_like(bias) if db_out is None else db_out.zero_())
        return dx, dw, db
    pre = recompute_pre(x, weight, bias) if pre is None else pre
    d_pre = buf if buf is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    progs_m = max(1, min(triton.cdiv(m, config.block_m), config.row_programs_per_sm * sms))
    rows_per_prog = triton.cdiv(triton.cdiv(m, progs_m), config.block_m) * config.block_m
    progs_m = triton.cdiv(m, rows_per_prog)
    db_part = torch.empty((progs_m, n - c), dtype=torch.float32, device=x.device)
    c0 = 0
    for piece in dy_pieces(dy):
        c1 = c0 + piece.shape[1]
        s = max(c0, c)  # the piece's first column the pass still has to do
        if c1 > s:
            _silu_bwd_kernel[(progs_m, triton.cdiv(c1 - s, config.block_n))](
                piece[:, s - c0 :], pre[:, s:c1], d_pre[:, s:c1], db_part[:, s - c : c1 - c], m, c1 - s,
                rows_per_prog, piece.stride(0), pre.stride(0), d_pre.stride(0), db_part.stride(0),
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
            )  # fmt: skip
        c0 = c1
    dx = torch.mm(d_pre, weight, out=dx_out) if dx_out is not None else torch.mm(d_pre, weight)
    dw = torch.mm(d_pre.t(), x, out=dw_out) if dw_out is not None else torch.mm(d_pre.t(), x)
    db = None
    if bias is not None:
        db = db_part.sum(0)
        db = (torch.cat([done_db, db]) if c else db).to(bias.dtype)
        if db_out is not None:
            db = db_out.copy_(db)
    return dx, dw, db
