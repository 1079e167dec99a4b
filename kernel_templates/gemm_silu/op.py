"""Compile cache, launcher and autograd entry of the CuTe DSL GEMM + bias + SiLU (Hopper sm90).

Kernels are compiled once per (config, dtype, N, K, bias or not) from fake tensors with a dynamic
M (the jagged token count changes every batch; N and K are the layer's fixed widths), so compiling
never touches a GPU (CUTE_DSL_ARCH=sm_90a on CPU-only machines). With ``tvm_ffi`` present the kernel
takes torch tensors directly (low launch overhead, stream from torch's current stream).

``pre_out`` makes the kernel also store the pre-activation (a second epilogue output): the HSTU layer
keeps it for SiLU's backward, where a cuBLAS GEMM would need a separate SiLU pass over it.

Backward of the autograd function: the pre-activation is *recomputed* with one torch addmm instead of
being stored by the forward. x and W are saved anyway (dW and dx need them), so recomputing costs one GEMM in backward
and no memory, while storing pre would add an M x N write to every forward (~1 GB at M=128K, N=4K in
bf16, ~20 % of the fused kernel's time) and keep that tensor alive until backward, for inference too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernel_templates.cute_runtime import (
    TORCH_DTYPE_NAMES,
    CompiledKernel,
    KernelCache,
    current_stream,
    cutlass_dtype,
    dlpack_args,
)
from kernel_templates.launch_checks import outputs_apart

from .config import GemmSiluConfig, check_gemm_silu_config, default_gemm_silu_config
from .reference import silu_grad


@dataclass(frozen=True)
class GemmSiluKey:
    """Everything a compiled kernel specialises on (M stays dynamic)."""

    config: GemmSiluConfig
    dtype: str
    n: int
    k: int
    has_bias: bool
    has_pre: bool = False


_CACHE: KernelCache[GemmSiluKey] = KernelCache()


def compile_gemm_silu(key: GemmSiluKey, keep_ptx: bool = False) -> CompiledKernel[GemmSiluKey]:
    """Compile (or fetch from the cache) the kernel for ``key``; rejects bad configs before compiling."""
    check_gemm_silu_config(key.config, key.n, key.k)
    if key.dtype not in TORCH_DTYPE_NAMES.values():
        raise ValueError(f"CuTe GEMM+SiLU supports bfloat16 and float16, got {key.dtype}")
    return _CACHE.get(key, lambda tvm: _compile_args(key, tvm), keep_ptx)


def _compile_args(key: GemmSiluKey, tvm_ffi: bool) -> tuple:
    """Arguments of ``cute.compile``: fake tensors with a dynamic M (and bias length), the grid bound."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .gemm_silu_sm90 import GemmSiluSm90

    dt = cutlass_dtype(key.dtype)
    rows, bias_len = cute.sym_int(), cute.sym_int()
    x = make_fake_tensor(dt, (rows, key.k), stride=(key.k, 1), assumed_align=16)
    w = make_fake_tensor(dt, (key.n, key.k), stride=(key.k, 1), assumed_align=16)
    b = make_fake_tensor(dt, (bias_len,), stride=(1,), assumed_align=2)
    out = make_fake_tensor(dt, (rows, key.n), stride=(key.n, 1), assumed_align=16)
    pre = make_fake_tensor(dt, (rows, key.n), stride=(key.n, 1), assumed_align=16)
    kernel = GemmSiluSm90(key.config, dt, key.has_bias, key.has_pre)
    return (kernel, x, w, b, out, pre, cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi))


def validate_gemm_silu_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    pre_out: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument that the kernel cannot take."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in TORCH_DTYPE_NAMES:
            raise ValueError(f"{name} must be bfloat16 or float16, got {t.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    m, k = x.shape
    n, k_w = weight.shape
    if k_w != k:
        raise ValueError(f"weight must be (N, K) = (out_features, {k}), got {tuple(weight.shape)}")
    if k == 0 or k % 8:
        raise ValueError(f"x: K (in_features) must be a positive multiple of 8 for TMA, got {k}")
    if n == 0 or n % 8:
        raise ValueError(f"weight: N (out_features) must be a positive multiple of 8 for TMA, got {n}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != n:
            raise ValueError(f"bias must be a 1-D tensor of length N={n}, got {getattr(bias, 'shape', bias)}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias must be {x.dtype} on {x.device}, got {bias.dtype} on {bias.device}")
    for name, t in (("out", out), ("pre_out", pre_out)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.shape != (m, n) or t.dtype != x.dtype or t.device != x.device:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {x.dtype} ({m}, {n}) tensor on {x.device}, got {got}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (TMA store)")
    # The TMA stores would race the loads of an input they overlap, or each other.
    outputs_apart({"x": x, "weight": weight, "bias": bias}, {"out": out, "pre_out": pre_out})


@functools.cache
def _sm_count(device_index: int) -> int:
    """The persistent grid: one CTA per SM."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (copies only when the caller's tensor is not)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def gemm_silu_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmSiluConfig | None = None,
    out: torch.Tensor | None = None,
    pre_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch ``out = silu(x @ weight^T + bias)`` (no autograd), and ``pre_out = x @ weight^T + bias`` when
    given; inputs are validated here."""
    validate_gemm_silu_inputs(x, weight, bias, out, pre_out)
    m, k = x.shape
    n = weight.shape[0]
    if x.device.type != "cuda":
        raise ValueError(f"x must be on a CUDA device for the CuTe kernel, got {x.device}")
    config = config or default_gemm_silu_config(m, n, k)
    key = GemmSiluKey(config, TORCH_DTYPE_NAMES[x.dtype], n, k, bias is not None, pre_out is not None)
    check_gemm_silu_config(config, n, k)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x, weight = _tma_ready(x), _tma_ready(weight)
    b = bias.contiguous() if bias is not None else weight[0]
    pre = pre_out if pre_out is not None else out  # read by the kernel only with pre_out
    ctas = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
    compiled = compile_gemm_silu(key)
    if compiled.tvm_ffi:
        compiled.fn(x, weight, b, out, pre, ctas)
    else:
        _launch_dlpack(compiled, x, weight, b, out, pre, ctas)
    return out


def _launch_dlpack(compiled: CompiledKernel[GemmSiluKey], x, weight, b, out, pre, ctas: int) -> None:
    """Fallback without TVM FFI: DLPack views with a dynamic M (and bias length), torch's current stream."""
    import cutlass

    tensors = dlpack_args([(x, 16), (weight, 16), (b, 2), (out, 16), (pre, 16)])
    compiled.fn(*tensors, cutlass.Int32(ctas), current_stream())


class GemmSiluFunction(torch.autograd.Function):
    """CuTe forward; torch backward that recomputes the pre-activation (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, config):
        y = gemm_silu_fwd(x, weight, bias, config)
        ctx.save_for_backward(x, weight, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        pre = torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()
        dpre = (dy.float() * silu_grad(pre)).to(x.dtype)
        dx = dpre @ weight if ctx.needs_input_grad[0] else None
        dw = dpre.t() @ x if ctx.needs_input_grad[1] else None
        db = dpre.float().sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def gemm_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmSiluConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(x @ weight^T + bias)`` with the CuTe sm90 kernel; differentiable unless ``out`` is given.

    x: (M, K) activations, weight: (N, K) as in ``nn.Linear``, bias: (N,) or None; bf16 or fp16;
    K and N multiples of 8; any M (including 0 and 1). ``config`` defaults to
    ``default_gemm_silu_config(M, N, K)``.
    """
    validate_gemm_silu_inputs(x, weight, bias, out)
    if config is not None:
        check_gemm_silu_config(config, weight.shape[0], x.shape[1])
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if out is not None or not needs_grad:
        return gemm_silu_fwd(x, weight, bias, config, out)
    return GemmSiluFunction.apply(x, weight, bias, config)
