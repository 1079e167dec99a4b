"""Search space of the CuTe DSL (sm90, TMA + wgmma) GEMM + bias + SiLU (the HSTU uvqk projection).

A GEMM task reuses the attention task's fields (``kernel_templates/gemm_silu/tuning.py``): K = hidden = heads x dv,
N = 4 x heads x dqk, M = the batch's jagged token count. ``SpaceContext`` carries dqk and dv but not
the head count, so the divisibility rules test the per-head widths (4 dqk, dv): they divide N and K
for every head count. Rules reject, before any compile: non-Hopper targets, dtypes other than
bf16/fp16, shared memory over the per-block limit (stages x (x + W tiles) + epilogue buffers + bias),
accumulators over the setmaxnreg budget, clusters over 4 CTAs, N tiles that leave a ragged edge, k-tiles
that do not divide K, and shallow pipelines where a deeper one fits. ``check_gemm_silu_config`` is the
launcher's check, so a config the space admits never fails there.
"""

from __future__ import annotations

import dataclasses

from kernel_templates.gemm_silu.config import (
    PERSISTENT_CLUSTER,
    PINGPONG_TILE_M,
    REG_OVERHEAD,
    REGS,
    GemmSiluConfig,
    accumulator_regs,
    default_gemm_silu_config,
    smem_bytes,
)
from search_spaces.base import SearchSpace, SpaceContext

GEMM_PARAMS: dict[str, tuple] = {
    "tile_m": (64, 128, 192),
    "tile_n": (64, 96, 128, 160, 192, 224, 256),
    "tile_k": (32, 64, 128),
    "cluster_m": (1, 2),
    "cluster_n": (1, 2),
    "num_stages": (2, 3, 4, 5, 6, 7, 8),
    "raster": ("m", "n"),
    "persistent": (False, True),
    "pingpong": (False, True),
}
ASSUMED_TOKENS = 1 << 17  # the projection sees batch x tokens rows: size the default for a large M


def gemm_dims(ctx: SpaceContext) -> tuple[int, int]:
    """(N, K) per head: 4 dqk output columns (u, v, q, k) and dv hidden columns."""
    return 4 * ctx.dqk, ctx.dv


def hopper_only(c, ctx: SpaceContext) -> str | None:
    """wgmma, TMA multicast and setmaxnreg exist on sm90 only."""
    if ctx.gpu.compute_capability[0] != 9:
        return f"sm90 kernel, target is sm{ctx.gpu.compute_capability[0]}{ctx.gpu.compute_capability[1]}"
    return None


def dtype_supported(c, ctx: SpaceContext) -> str | None:
    if ctx.dtype not in ("bfloat16", "float16"):
        return f"dtype {ctx.dtype}: the CuTe GEMM takes bfloat16 and float16"
    return None


def fits_smem(c, ctx: SpaceContext) -> str | None:
    need = smem_bytes(c, ctx.elem_bytes)
    if need > ctx.gpu.smem_per_block:
        return f"shared memory {need // 1024} KB > {ctx.gpu.smem_per_block // 1024} KB"
    return None


def fits_registers(c, ctx: SpaceContext) -> str | None:
    """The fp32 accumulator (tile_m x tile_n over the MMA threads) plus overhead within setmaxnreg's budget."""
    regs = accumulator_regs(c) + REG_OVERHEAD
    budget = REGS[c.mma_warpgroups][0]
    if regs > budget:
        return f"~{regs} registers per MMA thread > {budget}"
    return None


def wgmma_shapes(c, ctx: SpaceContext) -> str | None:
    """wgmma: M = 64 per warpgroup atom, N a multiple of 16 (<= 256), K-tile a multiple of 16."""
    if c.tile_m % 64 or c.tile_n % 16 or c.tile_n > 256 or c.tile_k % 16:
        return f"tile {c.tile_m}x{c.tile_n}x{c.tile_k} breaks wgmma shapes"
    return None


def cluster_ok(c, ctx: SpaceContext) -> str | None:
    if c.cluster_size > 4:
        return f"cluster {c.cluster_m}x{c.cluster_n} > 4 CTAs"
    if c.persistent and c.cluster_size > PERSISTENT_CLUSTER:
        return f"a persistent kernel runs clusters of at most {PERSISTENT_CLUSTER} CTAs"
    return None


def pingpong_ok(c, ctx: SpaceContext) -> str | None:
    """Two warpgroups take turns on whole tiles of a persistent walk: tile_m 64 (one warpgroup's wgmma atom)."""
    if c.pingpong and not (c.persistent and c.tile_m in PINGPONG_TILE_M):
        return f"pingpong needs persistent and tile_m in {PINGPONG_TILE_M}"
    return None


def n_tiles_exact(c, ctx: SpaceContext) -> str | None:
    """tile_n must divide N (= heads x 4 dqk): a ragged last N tile wastes a column of CTAs."""
    n, k = gemm_dims(ctx)
    if n % c.tile_n:
        return f"tile_n {c.tile_n} does not divide 4*dqk = {n}"
    if k % c.tile_k:
        return f"tile_k {c.tile_k} does not divide dv = {k}"
    return None


def pipelined(c, ctx: SpaceContext) -> str | None:
    """Two stages leave no slack for the producer; keep them only where three do not fit."""
    if c.num_stages == 2:
        deeper = dataclasses.replace(c, num_stages=3)
        if fits_smem(deeper, ctx) is None:
            return "num_stages=2 while 3 stages fit"
    return None


def _default(ctx: SpaceContext) -> GemmSiluConfig:
    n, k = gemm_dims(ctx)
    return default_gemm_silu_config(ASSUMED_TOKENS, n, k)


GEMM_RULES = (
    hopper_only,
    dtype_supported,
    wgmma_shapes,
    cluster_ok,
    pingpong_ok,
    n_tiles_exact,
    fits_smem,
    fits_registers,
    pipelined,
)
GEMM_SILU_CUTE = SearchSpace("gemm_silu/cute", GemmSiluConfig, GEMM_PARAMS, GEMM_RULES, _default)
