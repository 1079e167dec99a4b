"""Compile cache and launcher of the CuTe DSL HSTU attention backward (Hopper sm90).

Kernels are compiled once per (config, dtype, head dims, mask flags) from fake tensors with dynamic
L, H, B and row strides, so compiling never touches a GPU (CUTE_DSL_ARCH=sm_90a on CPU-only
machines). With ``tvm_ffi`` installed the kernel takes torch tensors directly; otherwise DLPack.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernel_templates.cute_runtime import (
    TORCH_DTYPE_NAMES,
    CompiledKernel,
    KernelCache,
    current_stream,
    dlpack_args,
    hstu_scalar_fakes,
    jagged_fakes,
)

from .bwd_config import HSTUCuteBwdConfig, check_bwd_config, default_cute_bwd_config
from .launch import LaunchCache, call_signature, jagged_args, sm_count, tma_rows_ok
from .tile_table import tiles_arg, tiles_fake


@dataclass(frozen=True)
class BwdKey:
    """Everything a compiled backward specialises on."""

    config: HSTUCuteBwdConfig
    dtype: str
    dqk: int
    dv: int
    has_context: bool
    has_targets: bool
    has_window: bool


_CACHE: KernelCache[BwdKey] = KernelCache()
_LAUNCH = LaunchCache()


def compile_bwd(key: BwdKey, keep_ptx: bool = False) -> CompiledKernel[BwdKey]:
    """Compile (or fetch from the cache) the backward kernel for ``key``; rejects bad configs first."""
    check_bwd_config(key.config, key.dtype, key.dqk, key.dv)
    return _CACHE.get(key, lambda tvm: _compile_args(key, tvm), keep_ptx)


def _compile_args(key: BwdKey, tvm_ffi: bool) -> tuple:
    """Arguments of ``cute.compile``: fake tensors with dynamic L, H, B and row strides."""
    import cutlass

    from .hstu_bwd_sm90 import HSTUBwdSm90

    f = jagged_fakes(key.dtype)
    kernel = HSTUBwdSm90(key.config, f.dtype, key.dqk, key.dv, key.has_context, key.has_targets, key.has_window)
    q, k, v, do = f.jagged(key.dqk), f.jagged(key.dqk), f.jagged(key.dv), f.jagged(key.dv)
    dq_acc = f.jagged(key.dqk, cutlass.Float32, 4)  # the fp32 dQ accumulator of the TMA reduce-add
    dk, dv = f.jagged(key.dqk), f.jagged(key.dv)
    *scalars, stream = hstu_scalar_fakes(tvm_ffi)
    num_ctas = cutlass.Int32(1)  # the persistent grid's CTA count (one per SM)
    counter = tiles_fake()  # int32 (its own dynamic length): the persistent kernel's tile counter
    return (
        kernel,
        q,
        k,
        v,
        do,
        dq_acc,
        dk,
        dv,
        f.offsets,
        f.targets,
        tiles_fake(),
        counter,
        *scalars,
        num_ctas,
        stream,
    )


def bwd_key(
    q: torch.Tensor,
    v: torch.Tensor,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    config: HSTUCuteBwdConfig,
) -> BwdKey:
    dtype, *rest = call_signature(q, v, num_targets, contextual_seq_len, max_attn_len)
    if dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"q: CuTe HSTU backward supports bfloat16 and float16, got {dtype}")
    return BwdKey(config, TORCH_DTYPE_NAMES[dtype], *rest)


def _validate(do, q, k, v, seq_offsets, max_seq_len, num_targets, ctx, max_attn_len, scaling_seqlen, check_offsets):
    """ValueErrors naming the argument: shapes, dtypes, devices (and the offsets when ``check_offsets``)."""
    from kernel_templates.hstu_attention.op import validate_hstu_grad, validate_hstu_inputs

    validate_hstu_inputs(
        q, k, v, seq_offsets, max_seq_len, num_targets, ctx, max_attn_len, scaling_seqlen, check_offsets=check_offsets
    )
    validate_hstu_grad(do, q, v)
    if q.dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"q: CuTe HSTU backward supports bfloat16 and float16, got {q.dtype}")


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the TMA loads need it (``tma_rows_ok``), copied only when it is not."""
    return t if tma_rows_ok(t) else t.contiguous()


def hstu_attention_cute_bwd(
    do: torch.Tensor,
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
    config: HSTUCuteBwdConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    validate: bool = True,
    check_offsets: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of jagged HSTU attention in the inputs' dtype (argument order of the Triton launcher).

    dQ accumulates in fp32 (the kernel scales each partial by alpha/S) and is converted once.
    ``out=(dq, dk, dv)`` receives the results; every row of every sequence is written (the offsets cover
    [0, L), as HSTU.md requires). ``validate`` checks shapes, dtypes and devices without a host sync;
    ``check_offsets`` also reads the offsets and targets on the host (one sync) to check them against L
    and ``max_seq_len``.
    """
    if validate:
        _validate(
            do, q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
            check_offsets,
        )  # fmt: skip
    L, H, dqk = q.shape
    dv_dim = v.shape[2]
    config = config or default_cute_bwd_config(dqk, dv_dim)
    signature = call_signature(q, v, num_targets, contextual_seq_len, max_attn_len)
    compiled = _LAUNCH.get(
        config, signature, lambda: compile_bwd(bwd_key(q, v, num_targets, contextual_seq_len, max_attn_len, config))
    )
    batch = seq_offsets.shape[0] - 1
    dq_out, dk, dv = out if out is not None else (None, torch.empty_like(k), torch.empty_like(v))
    if L == 0 or batch == 0 or max_seq_len == 0:
        return (torch.zeros_like(q) if dq_out is None else dq_out.zero_()), dk.zero_(), dv.zero_()
    q, k, v, do = (_tma_ready(t) for t in (q, k, v, do))
    dk_buf, dv_buf = _tma_ready(dk), _tma_ready(dv)
    offsets, targets, inv_scale, num_n_blocks = jagged_args(
        seq_offsets, num_targets, max_seq_len, scaling_seqlen, config.block_n
    )
    if config.persistent:  # one zero-fill for the fp32 dQ accumulator and, behind it, the tile counter
        flat = torch.zeros(L * H * dqk + 4, dtype=torch.float32, device=q.device)
        dq_acc = flat[: L * H * dqk].view(L, H, dqk)
        counter = flat[L * H * dqk :].view(torch.int32)[:1]
    else:  # the kernel never reads the counter: the offsets stand in for it
        dq_acc = torch.zeros((L, H, dqk), dtype=torch.float32, device=q.device)
        counter = offsets
    tiles = tiles_arg(seq_offsets, offsets, L, H, config.block_n, num_n_blocks, "bwd", config.compact, config.l2_group)
    num_ctas = sm_count(q.device) if config.persistent else 1
    scalars = (float(alpha), inv_scale, int(contextual_seq_len), int(max_attn_len), num_n_blocks, num_ctas)
    tensors = (q, k, v, do, dq_acc, dk_buf, dv_buf, offsets, targets, tiles, counter)
    if compiled.tvm_ffi:
        compiled.fn(*tensors, *scalars)
    else:
        _launch_dlpack(compiled, tensors, scalars)
    if dq_out is None:
        dq_out = dq_acc.to(q.dtype)
    else:
        dq_out.copy_(dq_acc)
    if dk_buf is not dk:
        dk.copy_(dk_buf)
    if dv_buf is not dv:
        dv.copy_(dv_buf)
    return dq_out, dk, dv


def _launch_dlpack(compiled: CompiledKernel[BwdKey], tensors: tuple, scalars: tuple) -> None:
    """Fallback without TVM FFI: DLPack views with dynamic rows and heads, torch's current stream."""
    import cutlass

    alpha, inv_scale, ctx, w, nnb, num_ctas = scalars
    # q, k, v, do, dq_acc, dk, dv are TMA operands (16-byte aligned); offsets and targets are int32.
    wrapped = dlpack_args([(t, 16) for t in tensors[:7]] + [(t, 4) for t in tensors[7:]])  # offsets .. counter
    compiled.fn(
        *wrapped,
        cutlass.Float32(alpha),
        cutlass.Float32(inv_scale),
        cutlass.Int32(ctx),
        cutlass.Int32(w),
        cutlass.Int32(nnb),
        cutlass.Int32(num_ctas),
        current_stream(),
    )
