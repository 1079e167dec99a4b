"""Compile cache, launcher and autograd entry of the CuTe DSL HSTU attention (Hopper sm90).

Kernels are compiled once per (config, dtype, head dims, mask flags) from fake tensors with dynamic
L, H and B, so compiling never touches a GPU (CUTE_DSL_ARCH=sm_90a on CPU-only machines). When the
``tvm_ffi`` package is present the kernel is compiled with TVM FFI and called with torch tensors
directly (low launch overhead, stream taken from torch's current stream).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .config import HSTUCuteFwdConfig, check_fwd_config

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _has_tvm_ffi() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


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


@dataclass
class CompiledFwd:
    key: FwdKey
    fn: Any
    tvm_ffi: bool
    ptx: str | None


_CACHE: dict[FwdKey, CompiledFwd] = {}
_LOCK = threading.Lock()


def _cutlass_dtype(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def compile_fwd(key: FwdKey, keep_ptx: bool = False) -> CompiledFwd:
    """Compile (or fetch from the cache) the forward kernel for ``key``; rejects bad configs first."""
    check_fwd_config(key.config, key.dqk, key.dv)
    if key.dtype not in _DTYPES.values():
        raise ValueError(f"CuTe HSTU forward supports bfloat16 and float16, got {key.dtype}")
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and (hit.ptx is not None or not keep_ptx):
            return hit
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .hstu_fwd_sm90 import HSTUFwdSm90

    dt = _cutlass_dtype(key.dtype)
    rows, heads, batch1, batch = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def qkv(d: int):
        # Each tensor has its own row stride: q/k/v may be column slices of the wider uvqk projection.
        row_stride = cute.sym_int(64, divisibility=8)
        return make_fake_tensor(dt, (rows, heads, d), stride=(row_stride, d, 1), assumed_align=16)

    offsets = make_fake_tensor(cutlass.Int32, (batch1,), stride=(1,), assumed_align=4)
    targets = make_fake_tensor(cutlass.Int32, (batch,), stride=(1,), assumed_align=4)
    kernel = HSTUFwdSm90(key.config, dt, key.dqk, key.dv, key.has_context, key.has_targets, key.has_window)
    tvm = _has_tvm_ffi()
    args = (
        kernel,
        qkv(key.dqk),
        qkv(key.dqk),
        qkv(key.dv),
        qkv(key.dv),
        offsets,
        targets,
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Int32(1),
        make_fake_stream(use_tvm_ffi_env_stream=tvm),
    )
    flags = ["--enable-tvm-ffi"] if tvm else []
    if keep_ptx:
        dump = os.environ.get("CUTE_DSL_DUMP_DIR")
        if dump:
            os.makedirs(dump, exist_ok=True)
        flags.append("--keep-ptx")
    fn = cute.compile(*args, options=" ".join(flags)) if flags else cute.compile(*args)
    ptx = fn.__ptx__ if keep_ptx else None
    compiled = CompiledFwd(key, fn, tvm, ptx)
    with _LOCK:
        _CACHE[key] = compiled
    return compiled


def fwd_key(
    q: torch.Tensor,
    v: torch.Tensor,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    config: HSTUCuteFwdConfig,
) -> FwdKey:
    if q.dtype not in _DTYPES:
        raise ValueError(f"CuTe HSTU forward supports bfloat16 and float16, got {q.dtype}")
    return FwdKey(
        config=config,
        dtype=_DTYPES[q.dtype],
        dqk=int(q.shape[2]),
        dv=int(v.shape[2]),
        has_context=contextual_seq_len > 0,
        has_targets=num_targets is not None,
        has_window=max_attn_len > 0,
    )


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

    ``sm_count`` is accepted for interface parity with persistent schedulers; this kernel launches one
    CTA per tile and does not need it. Rows of ``out`` outside every sequence are left untouched.
    """
    del sm_count
    key = fwd_key(q, v, num_targets, contextual_seq_len, max_attn_len, config)
    L, H, _ = q.shape
    if out is None:
        out = torch.empty((L, H, key.dv), dtype=q.dtype, device=q.device)
    batch = seq_offsets.numel() - 1
    if L == 0 or batch == 0 or max_seq_len == 0:
        return out.zero_()
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) % 8 or t.data_ptr() % 16:
            raise ValueError(f"{name} must be (L, H, D) with contiguous heads and 16-byte aligned rows for TMA")
    compiled = compile_fwd(key)
    offsets = seq_offsets if seq_offsets.dtype == torch.int32 else seq_offsets.to(torch.int32)
    targets = offsets if num_targets is None else num_targets.to(torch.int32)
    scale = scaling_seqlen if scaling_seqlen is not None else max_seq_len
    num_m_blocks = math.ceil(max_seq_len / config.block_m)
    scalars = (float(alpha), 1.0 / float(scale), int(contextual_seq_len), int(max_attn_len), num_m_blocks)
    if compiled.tvm_ffi:
        compiled.fn(q, k, v, out, offsets, targets, *scalars)
    else:
        _launch_dlpack(compiled, q, k, v, out, offsets, targets, scalars)
    return out


def _launch_dlpack(compiled: CompiledFwd, q, k, v, out, offsets, targets, scalars) -> None:
    """Fallback without TVM FFI: wrap the tensors through DLPack with dynamic rows and heads."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    def wrap(t: torch.Tensor, align: int):
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    alpha, inv_scale, ctx, w, nmb = scalars
    compiled.fn(
        wrap(q, 16),
        wrap(k, 16),
        wrap(v, 16),
        wrap(out, 16),
        wrap(offsets, 4),
        wrap(targets, 4),
        cutlass.Float32(alpha),
        cutlass.Float32(inv_scale),
        cutlass.Int32(ctx),
        cutlass.Int32(w),
        cutlass.Int32(nmb),
        stream,
    )


class HSTUAttentionCuteFunction(torch.autograd.Function):
    """CuTe forward, Triton backward (the CuTe backward is not written yet)."""

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
        from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd

        q, k, v, seq_offsets, num_targets = ctx.saved_tensors
        max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen, bwd_config = ctx.args
        dq, dk, dv = hstu_attention_bwd(
            do.contiguous(), q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len,
            max_attn_len, scaling_seqlen, bwd_config,
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
    bwd_config=None,
    validate: bool = True,
) -> torch.Tensor:
    """Jagged HSTU attention: CuTe DSL (TMA + wgmma) forward paired with the Triton backward.

    The backward is ``kernel_templates.hstu_attention.triton_bwd.hstu_attention_bwd`` with
    ``default_bwd_config`` unless ``bwd_config`` is given: no CuTe backward exists yet.
    """
    from kernel_templates.hstu_attention.config import default_bwd_config
    from kernel_templates.hstu_attention.op import validate_hstu_inputs

    if validate:
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen
        )
    if alpha is None:
        alpha = 1.0 / math.sqrt(q.shape[2])
    fwd_config = fwd_config or default_cute_fwd_config(q.shape[2], v.shape[2])
    check_fwd_config(fwd_config, q.shape[2], v.shape[2])
    bwd_config = bwd_config or default_bwd_config(q.shape[2], v.shape[2])
    return HSTUAttentionCuteFunction.apply(
        q, k, v, seq_offsets, max_seq_len, float(alpha), num_targets, contextual_seq_len, max_attn_len,
        scaling_seqlen, fwd_config, bwd_config,
    )  # fmt: skip


def default_cute_fwd_config(dqk: int, dv: int) -> HSTUCuteFwdConfig:
    """Heuristic default before tuning: 128 x 64 tiles on two MMA warpgroups."""
    d = max(dqk, dv)
    if d >= 256:
        return HSTUCuteFwdConfig(block_m=128, block_n=64, num_stages=2, intra_wg_overlap=True)
    return HSTUCuteFwdConfig(block_m=128, block_n=128, num_stages=2, intra_wg_overlap=True)
