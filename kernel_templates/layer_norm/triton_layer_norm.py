"""Triton LayerNorm forward and backward of the HSTU layer's input (x -> LN(x) before the uvqk GEMM).

The forward reads the residual stream in its own dtype (fp32 or bf16), keeps the per-row mean and
1/std in fp32 and writes the normalised rows in the GEMM's dtype, so no cast kernel runs between
them. The backward adds the residual's gradient (``residual_grad``, the gradient that reaches x
around the layer) into dx in the same pass, and sums dweight/dbias per program in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import LayerNormBwdConfig, LayerNormFwdConfig, block_d


# L changes with every jagged batch: not specialised, so one compile serves all batches.
@triton.jit(do_not_specialize=["L"])
def _ln_fwd_kernel(
    X, W, B, Y, Mean, Rstd, L, D, stride_x, stride_y, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < L
    col_ok = cols < D
    m2 = row_ok[:, None] & col_ok[None, :]
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(m2, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=m2)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit(do_not_specialize=["L", "rows_per_prog"])
def _ln_bwd_kernel(
    DY, X, W, Mean, Rstd, RG, DX, DW_part, DB_part, RGS_part, L, D, rows_per_prog,
    stride_dy, stride_x, stride_rg, stride_dx,
    HAS_RG: tl.constexpr, RG_SUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    rgs = tl.zeros((BLOCK_D,), dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, L)
    for start in range(row_start, row_end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        m2 = row_ok[:, None] & col_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(m2, (x - mean[:, None]) * rstd[:, None], 0.0)
        dxhat = dy * w[None, :]
        c1 = tl.sum(dxhat * xhat, axis=1) / D
        c2 = tl.sum(dxhat, axis=1) / D
        dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_RG:
            rg = tl.load(RG + r64 * stride_rg + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            dx += rg
            if RG_SUM:
                rgs += tl.sum(rg, axis=0)
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=m2)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW_part + pid * D + cols, dw, mask=col_ok)
    tl.store(DB_part + pid * D + cols, db, mask=col_ok)
    if RG_SUM:
        tl.store(RGS_part + pid * D + cols, rgs, mask=col_ok)


def check_residual_grad_sum(residual_grad_sum: object, residual_grad: torch.Tensor | None) -> None:
    """``residual_grad_sum`` is a bool, and True only with a ``residual_grad`` to sum."""
    if not isinstance(residual_grad_sum, bool):
        raise ValueError(f"residual_grad_sum must be a bool, got {residual_grad_sum!r}")
    if residual_grad_sum and residual_grad is None:
        raise ValueError("residual_grad_sum=True needs residual_grad (the gradient whose column sum it returns)")


def _check_2d(name: str, t: torch.Tensor, rows: int, d: int) -> None:
    if t.dim() != 2 or t.shape != (rows, d):
        raise ValueError(f"{name} must have shape ({rows}, {d}), got {tuple(t.shape)}")
    if d > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous columns (stride(1) == 1), got strides {t.stride()}")


def _check_params(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, D), got shape {tuple(x.shape)}")
    L, D = x.shape
    _check_2d("x", x, L, D)
    if weight.shape != (D,) or bias.shape != (D,):
        raise ValueError(f"weight and bias must have shape ({D},), got {tuple(weight.shape)}, {tuple(bias.shape)}")
    return L, D


def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    config: LayerNormFwdConfig,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y = LN(x) in ``out_dtype`` (default x's), statistics fp32 of shape (rows,)."""
    L, D = _check_params(x, weight, bias)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    y = torch.empty((L, D), dtype=out_dtype or x.dtype, device=x.device) if out is None else out
    _check_2d("out", y, L, D)
    mean = torch.empty((L,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((L,), dtype=torch.float32, device=x.device)
    if L == 0:
        return y, mean, rstd
    r = config.block_rows
    _ln_fwd_kernel[(triton.cdiv(L, r),)](
        x, weight, bias, y, mean, rstd, L, D, x.stride(0), y.stride(0), float(eps),
        BLOCK_R=r, BLOCK_D=block_d(D), num_warps=config.num_warps,
    )  # fmt: skip
    return y, mean, rstd


def _programs(L: int, config: LayerNormBwdConfig, device: torch.device) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(triton.cdiv(L, config.block_rows), config.programs_per_sm * sms))


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    config: LayerNormBwdConfig,
    residual_grad: torch.Tensor | None = None,
    residual_grad_sum: bool = False,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """(dx, dweight, dbias); dx in x's dtype with ``residual_grad`` (x's shape) added when given.
    ``residual_grad_sum``: a 4th result, residual_grad's fp32 column sum, from the rows the kernel reads anyway
    (the fused layer's output-projection bias gradient, which would otherwise re-read the whole gradient)."""
    L, D = _check_params(x, weight, bias)
    _check_2d("dy", dy, L, D)
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.shape != (L,) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 of shape ({L},), got {t.dtype} {tuple(t.shape)}")
    if residual_grad is not None:
        _check_2d("residual_grad", residual_grad, L, D)
    check_residual_grad_sum(residual_grad_sum, residual_grad)
    dx, dw, db = out if out is not None else (torch.empty((L, D), dtype=x.dtype, device=x.device), None, None)
    _check_2d("out[0] (dx)", dx, L, D)
    if L == 0:
        dw_t, db_t = torch.zeros_like(weight), torch.zeros_like(bias)
        rgs_t = torch.zeros(D, dtype=torch.float32, device=x.device)
    else:
        progs = _programs(L, config, x.device)
        rows_per_prog = triton.cdiv(triton.cdiv(L, progs), config.block_rows) * config.block_rows
        progs = triton.cdiv(L, rows_per_prog)
        dw_part = torch.empty((progs, D), dtype=torch.float32, device=x.device)
        db_part = torch.empty((progs, D), dtype=torch.float32, device=x.device)
        rgs_part = torch.empty((progs, D), dtype=torch.float32, device=x.device) if residual_grad_sum else db_part
        rg = residual_grad if residual_grad is not None else dy
        _ln_bwd_kernel[(progs,)](
            dy, x, weight, mean, rstd, rg, dx, dw_part, db_part, rgs_part, L, D, rows_per_prog,
            dy.stride(0), x.stride(0), rg.stride(0), dx.stride(0),
            HAS_RG=residual_grad is not None, RG_SUM=residual_grad_sum, BLOCK_R=config.block_rows, BLOCK_D=block_d(D),
            num_warps=config.num_warps,
        )  # fmt: skip
        dw_t, db_t = dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(bias.dtype)
        rgs_t = rgs_part.sum(0) if residual_grad_sum else None
    more = (rgs_t,) if residual_grad_sum else ()
    if dw is not None:
        dw.copy_(dw_t)
        db.copy_(db_t)
        return dx, dw, db, *more
    return dx, dw_t, db_t, *more
