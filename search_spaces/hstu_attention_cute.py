"""Search spaces of the CuTe DSL (sm90, TMA + wgmma) HSTU attention forward and backward.

Rules reject, before any compile: non-Hopper targets, head dims the template does not take, shared
memory over the GPU's per-block limit (Q tile + stages x (K + V) tiles), register budgets the
setmaxnreg split cannot give the MMA warpgroups, and wgmma shape violations (N multiple of 16 for
the P V k-steps, M of 64 per warpgroup). ``kernel_templates.cute.config.check_fwd_config`` is the
same check used by the launcher, so a config the space admits never fails there. The backward space
(``HSTU_BWD_CUTE``) mirrors ``kernel_templates.cute.bwd_config.check_bwd_config`` the same way.
"""

from __future__ import annotations

import dataclasses

from kernel_templates.cute.bwd_config import (
    BWD_MMA_REGS,
    BWD_REG_OVERHEAD,
    HSTUCuteBwdConfig,
    bwd_accumulator_regs,
    bwd_smem_bytes,
    default_cute_bwd_config,
    wgmma_shape_error,
)
from kernel_templates.cute.config import (
    CUTE_HEAD_DIMS,
    SMEM_RESERVED_BYTES,
    HSTUCuteFwdConfig,
    accumulator_regs,
)
from kernel_templates.cute.op import default_cute_fwd_config
from search_spaces.base import SearchSpace, SpaceContext

FWD_PARAMS: dict[str, tuple] = {
    "block_m": (64, 128, 192),
    "block_n": (64, 96, 128, 160, 192),
    "num_stages": (1, 2, 3, 4),
    "intra_wg_overlap": (False, True),
    "l2_group": (0, 2, 8, 16),  # sequence-heads launched together (L2 reuse); 0 = all
    "compact": (False, True),  # only the real tiles of a jagged batch, heaviest first (tile_table.py)
    "tanh_silu": (False, True),  # silu by tanh.approx: one MUFU op per score instead of two
    "split_heavy": (1, 2, 4),  # most parts a heavy query tile's key range is cut into (needs compact)
}
# setmaxnreg budget of each MMA thread, by number of MMA warpgroups (one producer warpgroup besides).
MMA_REGS = {1: 256, 2: 240, 3: 160}
REG_OVERHEAD = 24


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def hopper_only(c, ctx: SpaceContext) -> str | None:
    """wgmma and setmaxnreg exist on sm90 only."""
    if ctx.gpu.compute_capability[0] != 9:
        return f"sm90 kernel, target is sm{ctx.gpu.compute_capability[0]}{ctx.gpu.compute_capability[1]}"
    return None


def head_dims_supported(c, ctx: SpaceContext) -> str | None:
    if ctx.dqk not in CUTE_HEAD_DIMS or ctx.dv != ctx.dqk:
        return f"head dims ({ctx.dqk}, {ctx.dv}): the CuTe path takes Dqk == Dv in {CUTE_HEAD_DIMS}"
    if ctx.dtype not in ("bfloat16", "float16"):
        return f"dtype {ctx.dtype}: the CuTe path takes bfloat16 and float16"
    return None


def wgmma_shapes(c, ctx: SpaceContext) -> str | None:
    """M = 64 per MMA warpgroup; block_n is wgmma N of Q K^T and 16-step K of P V."""
    if c.block_m % 64 or c.block_n % 16 or c.block_n > 256:
        return f"tile {c.block_m}x{c.block_n} breaks wgmma shapes"
    return None


def tile_fits_length(c, ctx: SpaceContext) -> str | None:
    cap = max(64, _next_pow2(ctx.max_len))
    if c.block_m > cap or c.block_n > cap:
        return f"tile {c.block_m}x{c.block_n} exceeds the longest sequence ({ctx.max_len})"
    return None


def fwd_smem_bytes(c, ctx: SpaceContext) -> int:
    e = ctx.elem_bytes
    return e * (c.block_m * ctx.dqk + c.num_stages * c.block_n * (ctx.dqk + ctx.dv)) + SMEM_RESERVED_BYTES


def fits_smem(c, ctx: SpaceContext) -> str | None:
    need = fwd_smem_bytes(c, ctx)
    if need > ctx.gpu.smem_per_block:
        return f"shared memory {need // 1024} KB > {ctx.gpu.smem_per_block // 1024} KB"
    return None


def fits_registers(c, ctx: SpaceContext) -> str | None:
    """O accumulator (64 x Dv per warpgroup) + S (fp32) + P (16 bit) + addressing, per MMA thread."""
    regs = accumulator_regs(c, ctx.dv) + REG_OVERHEAD
    budget = MMA_REGS[c.block_m // 64]
    if regs > budget:
        return f"~{regs} registers per MMA thread > {budget}"
    return None


def pipelined(c, ctx: SpaceContext) -> str | None:
    """With one stage the producer cannot run ahead; keep it only where nothing else fits."""
    if c.num_stages == 1 and fits_smem(HSTUCuteFwdConfig(c.block_m, c.block_n, 2, c.intra_wg_overlap), ctx) is None:
        return "num_stages=1 while 2 stages fit"
    return None


def _default(ctx: SpaceContext) -> HSTUCuteFwdConfig:
    return default_cute_fwd_config(ctx.dqk, ctx.dv)


FWD_RULES = (
    hopper_only,
    head_dims_supported,
    wgmma_shapes,
    tile_fits_length,
    fits_smem,
    fits_registers,
    pipelined,
)
HSTU_FWD_CUTE = SearchSpace("hstu_attention_fwd/cute", HSTUCuteFwdConfig, FWD_PARAMS, FWD_RULES, _default)


# --------------------------------------------------------------------------------------------------
# Backward (one CTA per key block; dK/dV in registers, dQ by TMA reduce-add)
# --------------------------------------------------------------------------------------------------
BWD_PARAMS: dict[str, tuple] = {
    "block_m": (64, 128),
    "block_n": (64, 128),
    "num_stages": (1, 2, 3),  # Q buffers
    "do_stages": (1, 2, 3),  # dO buffers (at most num_stages)
    "dq_serial": (False, True),  # warpgroups pass dQ slices through one half-size buffer in turns
    "l2_group": (0, 2, 8, 16),  # sequence-heads launched together (L2 reuse); 0 = all
    "compact": (False, True),  # only the real key tiles of a jagged batch, heaviest first (tile_table.py)
    "swap_sdp": (False, True),  # S^T = K Q^T: P^T and dS^T stay in registers for dV and dK
    "tanh_silu": (False, True),  # sigmoid by tanh.approx: one MUFU op per score instead of two
    "persistent": (False, True),  # one CTA per SM walks the compact table (needs compact)
}


def bwd_wgmma_shapes(c, ctx: SpaceContext) -> str | None:
    """64-row wgmma slices split over the MMA warpgroups; N a multiple of 16 and at most 256."""
    return wgmma_shape_error(c, ctx.dqk)


def bwd_fits_smem(c, ctx: SpaceContext) -> str | None:
    """Q/dO stages + K/V + P/dS (16 bit) + the fp32 dQ partial tile."""
    need = bwd_smem_bytes(c, ctx.dqk, ctx.dv, ctx.elem_bytes)
    if need > ctx.gpu.smem_per_block:
        return f"shared memory {need // 1024} KB > {ctx.gpu.smem_per_block // 1024} KB"
    return None


def bwd_fits_registers(c, ctx: SpaceContext) -> str | None:
    """dK + dV (fp32, whole CTA) + max(S/dsilu + dP + P, dQ partial) + addressing, per MMA thread."""
    regs = bwd_accumulator_regs(c, ctx.dqk, ctx.dv) + BWD_REG_OVERHEAD
    budget = BWD_MMA_REGS[c.mma_warpgroups]
    if regs > budget:
        return f"~{regs} registers per MMA thread > {budget}"
    return None


def bwd_pipelined(c, ctx: SpaceContext) -> str | None:
    """One more Q or dO buffer, or a whole dQ tile instead of ``dq_serial``, where it still fits: the
    producer cannot run ahead with one buffer, and the serial dQ hand-off only pays for a buffer."""
    more_q = dataclasses.replace(c, num_stages=c.num_stages + 1) if c.num_stages < 3 else None
    more_do = dataclasses.replace(c, do_stages=c.do_stages + 1) if c.do_stages < c.num_stages else None
    for name, bigger in (("num_stages", more_q), ("do_stages", more_do)):
        if bigger is not None and getattr(c, name) == 1 and bwd_fits_smem(bigger, ctx) is None:
            return f"{name}=1 while 2 fit"
    if c.dq_serial and bwd_fits_smem(dataclasses.replace(c, dq_serial=False), ctx) is None:
        return "dq_serial while the whole dQ tile fits"
    return None


def _bwd_default(ctx: SpaceContext) -> HSTUCuteBwdConfig:
    return default_cute_bwd_config(ctx.dqk, ctx.dv)


BWD_RULES = (
    hopper_only,
    head_dims_supported,
    tile_fits_length,
    bwd_wgmma_shapes,
    bwd_fits_smem,
    bwd_fits_registers,
    bwd_pipelined,
)
HSTU_BWD_CUTE = SearchSpace("hstu_attention_bwd/cute", HSTUCuteBwdConfig, BWD_PARAMS, BWD_RULES, _bwd_default)
