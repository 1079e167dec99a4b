"""Forward launcher and autograd entry of the CuTe DSL HSTU attention (Hopper sm90).

Kernels are compiled once per (config, dtype, head dims, mask flags) from fake tensors with dynamic
L, H and B, so compiling never touches a GPU (CUTE_DSL_ARCH=sm_90a on CPU-only machines). When the
``tvm_ffi`` package is present the kernel is compiled with TVM FFI and called with torch tensors
directly (low launch overhead, stream taken from torch's current stream). The compile cache and the
DLPack fallback are shared with the other CuTe launchers (``kernel_templates.cute_runtime``); the
autograd entry pairs this forward with the CuTe backward of ``bwd_op.py``.
"""

from __future__ import annotations

import math
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
from kernel_templates.tensor_memo import capturing

from .bwd_config import HSTUCuteBwdConfig, check_bwd_config, default_cute_bwd_config
from .bwd_op import hstu_attention_cute_bwd
from .config import HSTUCuteFwdConfig, check_fwd_config
from .launch import LaunchCache, call_signature, jagged_args, tma_rows_ok
from .launch import sm_count as device_sm_count
from .tile_table import split_extra_rows, tiles_arg, tiles_fake


@dataclass(frozen=True)
class FwdKey:
    """Everything a compiled forward specialises on."""

    config: HSTUCuteFwdConfig
    dtype: str
    dqk: int
    dv: int
    has_context: bool
    has_targets: bool
    has_window: bool


_CACHE: KernelCache[FwdKey] = KernelCache()
_LAUNCH = LaunchCache()


def compile_fwd(key: FwdKey, keep_ptx: bool = False) -> CompiledKernel[FwdKey]:
    """Compile (or fetch from the cache) the forward kernel for ``key``; rejects bad configs first."""
    check_fwd_config(key.config, key.dqk, key.dv)
    if key.dtype not in TORCH_DTYPE_NAMES.values():
        raise ValueError(f"CuTe HSTU forward supports bfloat16 and float16, got {key.dtype}")
    return _CACHE.get(key, lambda tvm: _compile_args(key, tvm), keep_ptx)


def _compile_args(key: FwdKey, tvm_ffi: bool) -> tuple:
    """Arguments of ``cute.compile``: fake tensors with dynamic L, H, B and row strides."""
    import cutlass

    from .hstu_fwd_sm90 import HSTUFwdSm90

    f = jagged_fakes(key.dtype)
    kernel = HSTUFwdSm90(key.config, f.dtype, key.dqk, key.dv, key.has_context, key.has_targets, key.has_window)
    q, k, v, out = f.jagged(key.dqk), f.jagged(key.dqk), f.jagged(key.dv), f.jagged(key.dv)
    ws, sem = tiles_fake(cutlass.Float32), tiles_fake()  # the split's fp32 partials and int32 counters
    return (kernel, q, k, v, out, f.offsets, f.targets, tiles_fake(), ws, sem, *hstu_scalar_fakes(tvm_ffi))


# (device, stream) -> int32 counters of the split forward, zero between launches: launches on one stream
# run in order and each leaves its counters zero again (the last part of a cut tile resets its pair), so
# one array per stream serves every launch on it; two streams never share one.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_PLACEHOLDERS: dict[int, torch.Tensor] = {}


def split_buffers(q: torch.Tensor, heads: int, block_m: int, dv: int, sm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partial outputs, zeroed counters) of a split launch: one block_m x dv partial and two counters
    per (slot, head), ``split_extra_rows`` slots (the most partials a split table can name). The partials
    come from the caching allocator per launch (every one read is written first in the same launch)."""
    cells = split_extra_rows(sm, heads) * heads
    ws = torch.empty(cells * block_m * dv, dtype=torch.float32, device=q.device)
    if capturing():  # a graph owns its counters; a captured memset zeroes them
        return ws, torch.zeros(2 * cells, dtype=torch.int32, device=q.device)
    key = (q.device.index or 0, torch.cuda.current_stream(q.device).cuda_stream)
    sem = _COUNTERS.get(key)
    if sem is None or sem.numel() < 2 * cells:
        sem = _COUNTERS[key] = torch.zeros(2 * cells, dtype=torch.int32, device=q.device)
    return ws, sem


def _placeholder(q: torch.Tensor) -> torch.Tensor:
    """A one-element fp32 tensor standing in for the partials of a launch that never reads them."""
    idx = q.device.index or 0
    t = _PLACEHOLDERS.get(idx)
    if t is None:
        t = _PLACEHOLDERS[idx] = torch.zeros(1, dtype=torch.float32, device=q.device)
    return t


def fwd_key(
    q: torch.Tensor,
    v: torch.Tensor,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    config: HSTUCuteFwdConfig,
) -> FwdKey:
    dtype, *rest = call_signature(q, v, num_targets, contextual_seq_len, max_attn_len)
    if dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"CuTe HSTU forward supports bfloat16 and float16, got {dtype}")
    return FwdKey(config, TORCH_DTYPE_NAMES[dtype], *rest)


def hstu_attention_cute_fwd(
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
    config: HSTUCuteFwdConfig,
    out: torch.Tensor | None = None,
    sm_count: int | None = None,
) -> torch.Tensor:
    """Launch the CuTe forward (same argument order as the Triton launcher). Inputs are assumed validated.

    ``sm_count`` (default: the device's) sizes the split of heavy tiles (``split_heavy``); other configs
    do not read it. Rows of ``out`` outside every sequence are left untouched.
    """
    L, H, dqk = q.shape
    dv = v.shape[2]
    if out is None:
        out = torch.empty((L, H, dv), dtype=q.dtype, device=q.device)
    batch = seq_offsets.shape[0] - 1
    if L == 0 or batch == 0 or max_seq_len == 0:
        return out.zero_()
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if not tma_rows_ok(t):
            raise ValueError(f"{name} must be (L, H, D) with contiguous heads and 16-byte aligned rows for TMA")
    signature = call_signature(q, v, num_targets, contextual_seq_len, max_attn_len)
    compiled = _LAUNCH.get(
        config, signature, lambda: compile_fwd(fwd_key(q, v, num_targets, contextual_seq_len, max_attn_len, config))
    )
    offsets, targets, inv_scale, num_m_blocks = jagged_args(
        seq_offsets, num_targets, max_seq_len, scaling_seqlen, config.block_m
    )
    split = None
    ws, sem = _placeholder(q), offsets
    if config.split_heavy > 1:
        sm = sm_count or device_sm_count(q.device)
        split = (config.block_n, sm, config.split_heavy)
        ws, sem = split_buffers(q, H, config.block_m, dv, sm)
    tiles = tiles_arg(
        seq_offsets, offsets, L, H, config.block_m, num_m_blocks, "fwd", config.compact, config.l2_group, split
    )
    scalars = (float(alpha), inv_scale, int(contextual_seq_len), int(max_attn_len), num_m_blocks)
    if compiled.tvm_ffi:
        compiled.fn(q, k, v, out, offsets, targets, tiles, ws, sem, *scalars)
    else:
        _launch_dlpack(compiled, q, k, v, out, offsets, targets, (tiles, ws, sem), scalars)
    return out


def _launch_dlpack(compiled: CompiledKernel[FwdKey], q, k, v, out, offsets, targets, tables, scalars) -> None:
    """Fallback without TVM FFI: DLPack views with dynamic rows and heads, torch's current stream."""
    import cutlass

    alpha, inv_scale, ctx, w, nmb = scalars
    tiles, ws, sem = tables
    tensors = dlpack_args(
        [(q, 16), (k, 16), (v, 16), (out, 16), (offsets, 4), (targets, 4), (tiles, 4), (ws, 4), (sem, 4)]
    )
    compiled.fn(
        *tensors,
        cutlass.Float32(alpha),
        cutlass.Float32(inv_scale),
        cutlass.Int32(ctx),
        cutlass.Int32(w),
        cutlass.Int32(nmb),
        current_stream(),
    )


class HSTUAttentionCuteFunction(torch.autograd.Function):
    """CuTe DSL forward and backward; inputs and both configs are checked by ``hstu_attention_cute``."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        seq_offsets,
        max_seq_len,
        alpha,
        num_targets,
        contextual_seq_len,
        max_attn_len,
        scaling_seqlen,
        fwd_config,
        bwd_config,
    ):
        out = hstu_attention_cute_fwd(
            q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len,
            scaling_seqlen, fwd_config,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
        ctx.args = (max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen, bwd_config)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, seq_offsets, num_targets = ctx.saved_tensors
        max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen, bwd_config = ctx.args
        # The launcher copies do only if its layout is not TMA-ready; inputs were validated in forward.
        dq, dk, dv = hstu_attention_cute_bwd(
            do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len,
            scaling_seqlen, config=bwd_config, validate=False,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def hstu_attention_cute(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    alpha: float | None = None,
    num_targets: torch.Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    scaling_seqlen: int | None = None,
    fwd_config: HSTUCuteFwdConfig | None = None,
    bwd_config: HSTUCuteBwdConfig | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Jagged HSTU attention with the CuTe DSL (TMA + wgmma) kernels in both directions.

    Forward: ``hstu_attention_cute_fwd`` with ``fwd_config`` (default ``default_cute_fwd_config``).
    Backward: ``hstu_attention_cute_bwd`` (``bwd_op.py``) with ``bwd_config`` (default
    ``default_cute_bwd_config``). Both configs are checked for these head dims and this dtype before
    anything runs, so an infeasible backward config fails here rather than after the forward.
    """
    from kernel_templates.hstu_attention.op import validate_hstu_inputs

    if validate:
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen
        )
    if alpha is None:
        alpha = 1.0 / math.sqrt(q.shape[2])
    fwd_config = fwd_config or default_cute_fwd_config(q.shape[2], v.shape[2])
    check_fwd_config(fwd_config, q.shape[2], v.shape[2])
    if bwd_config is None:
        bwd_config = default_cute_bwd_config(q.shape[2], v.shape[2])
    _check_bwd_config_arg(bwd_config, q.dtype, q.shape[2], v.shape[2])
    return HSTUAttentionCuteFunction.apply(
        q, k, v, seq_offsets, max_seq_len, float(alpha), num_targets, contextual_seq_len, max_attn_len,
        scaling_seqlen, fwd_config, bwd_config,
    )  # fmt: skip


def _check_bwd_config_arg(bwd_config: object, dtype: torch.dtype, dqk: int, dv: int) -> None:
    """``check_bwd_config`` with errors that name the ``bwd_config`` argument of ``hstu_attention_cute``."""
    if not isinstance(bwd_config, HSTUCuteBwdConfig):
        raise ValueError(f"bwd_config must be an HSTUCuteBwdConfig, got {type(bwd_config).__name__}")
    if dtype not in TORCH_DTYPE_NAMES:
        raise ValueError(f"CuTe HSTU forward supports bfloat16 and float16, got {dtype}")
    try:
        check_bwd_config(bwd_config, TORCH_DTYPE_NAMES[dtype], dqk, dv)
    except ValueError as e:
        raise ValueError(f"bwd_config: {e}") from e


def default_cute_fwd_config(dqk: int, dv: int) -> HSTUCuteFwdConfig:
    """Heuristic default before tuning: 128 x 64 tiles on two MMA warpgroups; below D=256 128 x 128 with the
    one-MUFU SiLU, which the SiLU throughput bounds there (H100 d128: 1.2-1.4x the ex2 + rcp form)."""
    d = max(dqk, dv)
    if d >= 256:
        return HSTUCuteFwdConfig(block_m=128, block_n=64, num_stages=2, intra_wg_overlap=True)
    return HSTUCuteFwdConfig(block_m=128, block_n=128, num_stages=2, intra_wg_overlap=True, tanh_silu=True)
