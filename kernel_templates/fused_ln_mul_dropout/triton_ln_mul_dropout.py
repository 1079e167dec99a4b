"""Triton kernels: ``out = dropout(LN(x) * u)`` forward and backward.

The dropout mask is never stored: both kernels draw it from the seed (``_keep_tile``: Philox, four
columns per call), so the backward regenerates exactly the forward's mask. The forward keeps only the per-row
mean and 1/std (8 bytes a row). The backward walks a contiguous range of rows per program and
accumulates dLN-weight / dLN-bias partials in registers (one row of partials per program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernel_templates.layer_norm.config import block_d

from .config import LnMulDropoutBwdConfig, LnMulDropoutFwdConfig, default_bwd_config, default_fwd_config


@triton.jit
def _keep_tile(seed, rows, D, p, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Kept elements of a (BLOCK_R rows) x (BLOCK_D columns from 0) tile. One Philox call draws four
    neighbouring columns (``randint4x``), a quarter of ``tl.rand``'s work per element: the draw, not
    memory, bounded these kernels. Element (r, c) takes word c % 4 of counter r * ceil(D / 4) + c // 4."""
    quads = tl.arange(0, BLOCK_D // 4)
    counter = rows[:, None].to(tl.int64) * ((D + 3) // 4) + quads[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counter)
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_R, BLOCK_D))
    return tl.uint_to_uniform_float(words) > p


# The row count changes with every jagged batch: specialising on it (L % 16 == 0, L == 1) would compile
# new variants mid-training, so it stays a plain runtime int (the seed is read from a device tensor).
@triton.jit(do_not_specialize=["L"])
def _ln_mul_dropout_fwd_kernel(
    X,
    U,
    W,
    B,
    O,
    Mean,
    Rstd,
    L,
    D,
    stride_x,
    stride_u,
    stride_o,
    eps,
    p,
    Seed,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < L
    col_ok = cols < D
    m2 = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None].to(tl.int64) * stride_u + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(m2, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    out = y * u
    if HAS_DROPOUT:
        keep = _keep_tile(tl.load(Seed), rows, D, p, BLOCK_R, BLOCK_D)
        out = tl.where(keep, out / (1.0 - p), 0.0)
    tl.store(O + rows[:, None].to(tl.int64) * stride_o + cols[None, :], out.to(O.dtype.element_ty), mask=m2)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit(do_not_specialize=["L", "rows_per_prog"])
def _ln_mul_dropout_bwd_kernel(
    DO,
    X,
    U,
    W,
    B,
    Mean,
    Rstd,
    DX,
    DU,
    DW_part,
    DB_part,
    PRE,
    DBU_part,
    L,
    D,
    rows_per_prog,
    stride_do,
    stride_x,
    stride_u,
    stride_dx,
    stride_du,
    stride_pre,
    p,
    Seed,
    HAS_DROPOUT: tl.constexpr,
    HAS_PRE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbu = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, L)
    for start in range(row_start, row_end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        m2 = row_ok[:, None] & col_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        u = tl.load(U + r64 * stride_u + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(DO + r64 * stride_do + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        if HAS_DROPOUT:
            keep = _keep_tile(seed, rows, D, p, BLOCK_R, BLOCK_D)
            g = tl.where(keep, g / (1.0 - p), 0.0)
        xhat = tl.where(m2, (x - mean[:, None]) * rstd[:, None], 0.0)
        y = xhat * w[None, :] + b[None, :]
        du = g * y
        dy = g * u
        dxhat = dy * w[None, :]
        c1 = tl.sum(dxhat * xhat, axis=1) / D
        c2 = tl.sum(dxhat, axis=1) / D
        dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=m2)
        if HAS_PRE:  # u = silu(pre): du goes on through SiLU' (d pre = du s (1 + pre (1 - s)), s = sigmoid(pre))
            pre = tl.load(PRE + r64 * stride_pre + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            s = tl.sigmoid(pre)
            du_lo = (du * s * (1.0 + pre * (1.0 - s))).to(DU.dtype.element_ty)
            dbu += tl.sum(tl.where(m2, du_lo.to(tl.float32), 0.0), axis=0)
        else:
            du_lo = du.to(DU.dtype.element_ty)
        tl.store(DU + r64 * stride_du + cols[None, :], du_lo, mask=m2)
    tl.store(DW_part + pid * D + cols, dw, mask=col_ok)
    tl.store(DB_part + pid * D + cols, db, mask=col_ok)
    if HAS_PRE:
        tl.store(DBU_part + pid * D + cols, dbu, mask=col_ok)


def _check(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, p: float) -> tuple[int, int]:
    if x.dim() != 2 or u.shape != x.shape:
        raise ValueError(f"x and u must be 2-D of one shape, got {tuple(x.shape)} and {tuple(u.shape)}")
    L, D = x.shape
    if D > 1 and (x.stride(1) != 1 or u.stride(1) != 1):
        raise ValueError("x and u must have contiguous columns (rows may be strided)")
    if weight.shape != (D,) or bias.shape != (D,):
        raise ValueError(f"weight and bias must have shape ({D},)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p must be in [0, 1), got {p}")
    return L, D


def ln_mul_dropout_fwd(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    p: float,
    seed: torch.Tensor,
    *,
    config: LnMulDropoutFwdConfig | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, mean, rstd) for 2-D x, u of shape (L, D) (rows may be strided, columns contiguous).

    ``seed`` is a one-element integer tensor on x's device, read by the kernel: no host sync, and
    torch.compile sees no Python int that changes every step. ``config`` None: the heuristic default.
    """
    L, D = _check(x, u, weight, bias, p)
    config = config or default_fwd_config(D)
    if out is None:
        out = torch.empty((L, D), dtype=x.dtype, device=x.device)
    mean = torch.empty((L,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((L,), dtype=torch.float32, device=x.device)
    if L == 0:
        return out, mean, rstd
    r = config.block_rows
    _ln_mul_dropout_fwd_kernel[(triton.cdiv(L, r),)](
        x, u, weight, bias, out, mean, rstd, L, D, x.stride(0), u.stride(0), out.stride(0),
        float(eps), float(p), seed,
        HAS_DROPOUT=p > 0, BLOCK_R=r, BLOCK_D=block_d(D), num_warps=config.num_warps,
    )  # fmt: skip
    return out, mean, rstd


def _num_programs(L: int, config: LnMulDropoutBwdConfig, device: torch.device) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(L, config.block_rows), config.programs_per_sm * sms))


def ln_mul_dropout_bwd(
    do: torch.Tensor,
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    p: float,
    seed: torch.Tensor,
    *,
    config: LnMulDropoutBwdConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    silu_pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(dx, du, dweight, dbias); the dropout mask is redrawn from ``seed``. ``out`` may hold a
    strided ``du`` (a column slice of the layer's d(uvqk) buffer): only its columns are written.

    ``silu_pre``: u is silu(silu_pre) (the layer's projection), and du is carried on through SiLU' here
    (the gradient of silu_pre, rounded once), while the rows are in registers; a fifth output is then
    its column sums in fp32 (the projection bias's gradient over these columns)."""
    L, D = _check(x, u, weight, bias, p)
    if silu_pre is not None and (silu_pre.shape != (L, D) or (D > 1 and silu_pre.stride(1) != 1)):
        raise ValueError(
            f"silu_pre must be ({L}, {D}) with contiguous columns, got {tuple(silu_pre.shape)} {silu_pre.stride()}"
        )
    config = config or default_bwd_config(D)
    do = do if do.stride(-1) == 1 else do.contiguous()
    if out is None:
        dx = torch.empty((L, D), dtype=x.dtype, device=x.device)
        du = torch.empty((L, D), dtype=u.dtype, device=u.device)
        dw_out = db_out = None
    else:
        dx, du, dw_out, db_out = out
        if dx.shape != (L, D) or du.shape != (L, D) or (D > 1 and (dx.stride(1) != 1 or du.stride(1) != 1)):
            raise ValueError("out: dx and du must be (L, D) with contiguous columns")
    dbu = None if silu_pre is None else torch.zeros(D, dtype=torch.float32, device=x.device)
    if L == 0:
        dw, db = torch.zeros_like(weight), torch.zeros_like(bias)
    else:
        r = config.block_rows
        progs = _num_programs(L, config, x.device)
        rows_per_prog = triton.cdiv(triton.cdiv(L, progs), r) * r
        progs = triton.cdiv(L, rows_per_prog)
        dw_part = torch.empty((progs, D), dtype=torch.float32, device=x.device)
        db_part = torch.empty((progs, D), dtype=torch.float32, device=x.device)
        dbu_part = db_part if silu_pre is None else torch.empty((progs, D), dtype=torch.float32, device=x.device)
        pre = do if silu_pre is None else silu_pre  # read only with HAS_PRE
        _ln_mul_dropout_bwd_kernel[(progs,)](
            do, x, u, weight, bias, mean, rstd, dx, du, dw_part, db_part, pre, dbu_part, L, D, rows_per_prog,
            do.stride(0), x.stride(0), u.stride(0), dx.stride(0), du.stride(0), pre.stride(0), float(p), seed,
            HAS_DROPOUT=p > 0, HAS_PRE=silu_pre is not None, BLOCK_R=r, BLOCK_D=block_d(D),
            num_warps=config.num_warps,
        )  # fmt: skip
        dw, db = dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(bias.dtype)
        if silu_pre is not None:
            dbu = dbu_part.sum(0)
    if dw_out is not None:
        dw_out.copy_(dw)
        db_out.copy_(db)
        dw, db = dw_out, db_out
    return (dx, du, dw, db) if silu_pre is None else (dx, du, dw, db, dbu)


@triton.jit(do_not_specialize=["L"])
def _keep_mask_kernel(Keep, L, D, p, Seed, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    m2 = (rows < L)[:, None] & (cols < D)[None, :]
    keep = _keep_tile(tl.load(Seed), rows, D, p, BLOCK_R, BLOCK_D)
    tl.store(Keep + rows[:, None].to(tl.int64) * D + cols[None, :], keep.to(tl.int8), mask=m2)


def dropout_keep_mask(rows: int, d: int, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The kept-element mask the kernels draw for (rows, d), ``p`` and ``seed`` (bool): what the
    reference and the torch backend apply, so every backend drops the same elements."""
    keep = torch.ones((rows, d), dtype=torch.int8, device=seed.device)
    if rows and p > 0:
        bd = block_d(d)
        br = max(1, min(16, 4096 // bd))
        _keep_mask_kernel[(triton.cdiv(rows, br),)](keep, rows, d, float(p), seed, BLOCK_R=br, BLOCK_D=bd)
    return keep.bool()
