"""Search spaces of the Triton HSTU attention templates (forward and backward).

To extend: add a choice to ``FWD_PARAMS`` / ``BWD_PARAMS`` or a rule function to ``FWD_RULES`` /
``BWD_RULES``. A rule is ``(config, ctx) -> reason or None``; reasons are shown in dry runs and stored
on infeasible trials. The resource estimates are deliberately simple upper-bound models of what the
Triton compiler allocates; the compiler's own report (registers, spills, shared memory) is recorded
on every compiled trial, so a wrong estimate shows up there.
"""

from __future__ import annotations

from kernel_templates.hstu_attention.config import (
    SUPPORTED_HEAD_DIMS,
    HSTUBwdConfig,
    HSTUFwdConfig,
    default_bwd_config,
    default_fwd_config,
)
from search_spaces.base import SearchSpace, SpaceContext

FWD_PARAMS: dict[str, tuple] = {
    "block_m": (16, 32, 64, 128, 256),
    "block_n": (16, 32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3, 4),
    "l2_group": (0, 2, 8, 16),  # sequence-heads launched together (L2 reuse); 0 = all
}
BWD_PARAMS: dict[str, tuple] = {
    "block_m": (16, 32, 64, 128),
    "block_n": (16, 32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3),
    "dq_mode": ("atomic", "separate", "tma"),
    "dq_block_m": (0, 32, 64, 128),  # query rows of the separate dQ kernel; 0 = block_m
    "dq_block_n": (0, 32, 64, 128),  # keys per step of the separate dQ kernel; 0 = block_n
    "dkv_split": (False, True),  # dV and dK in two key-block passes (one accumulator each)
    "l2_group": (0, 2, 8, 16),  # sequence-heads launched together (L2 reuse); 0 = all
}
# Largest S tile the interpreter is allowed (it runs numpy per program: big tiles only cost CI time).
INTERPRET_MAX_TILE = 64 * 64


def _threads(c) -> int:
    return c.num_warps * 32


def _reg_limit(c, ctx: SpaceContext) -> int:
    return min(ctx.gpu.max_regs_per_thread, ctx.gpu.regs_per_sm // _threads(c))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def head_dims_supported(c, ctx: SpaceContext) -> str | None:
    """The templates load whole head dims as one power-of-two tile."""
    if ctx.dqk not in SUPPORTED_HEAD_DIMS or ctx.dv not in SUPPORTED_HEAD_DIMS:
        return f"head dims ({ctx.dqk}, {ctx.dv}) not in {SUPPORTED_HEAD_DIMS}"
    return None


def tile_fits_length(c, ctx: SpaceContext) -> str | None:
    """A tile longer than the longest sequence only computes padding."""
    cap = max(16, _next_pow2(ctx.max_len))
    if c.block_m > cap or c.block_n > cap:
        return f"tile {c.block_m}x{c.block_n} exceeds the longest sequence ({ctx.max_len})"
    return None


def enough_work_per_thread(c, ctx: SpaceContext) -> str | None:
    """Fewer than 4 score elements per thread leaves warps idle (and breaks some MMA layouts)."""
    if c.block_m * c.block_n < 4 * _threads(c):
        return f"tile {c.block_m}x{c.block_n} too small for {c.num_warps} warps"
    return None


def interpreter_limits(c, ctx: SpaceContext) -> str | None:
    """The interpreter ignores warps, stages and launch order; vary only tiles, small ones, to keep CI fast."""
    order = type(c).l2_group  # the dataclass default: one spelling of a moot choice
    if ctx.interpret and (
        c.num_warps != 4 or c.num_stages != 1 or c.l2_group != order or c.block_m * c.block_n > INTERPRET_MAX_TILE
    ):
        return f"interpreter: num_warps=4, num_stages=1, l2_group={order} (order is moot), tile <= 64x64 only"
    return None


def fwd_smem_bytes(c, ctx: SpaceContext) -> int:
    """Q tile + num_stages buffers of K and V tiles + the P tile fed to the second MMA."""
    e = ctx.elem_bytes
    stages = max(1, c.num_stages)
    return e * (c.block_m * ctx.dqk + stages * c.block_n * (ctx.dqk + ctx.dv) + c.block_m * c.block_n)


def fwd_fits_smem(c, ctx: SpaceContext) -> str | None:
    need = fwd_smem_bytes(c, ctx)
    if need > ctx.gpu.smem_per_block:
        return f"shared memory ~{need // 1024} KB > {ctx.gpu.smem_per_block // 1024} KB"
    return None


def fwd_fits_registers(c, ctx: SpaceContext) -> str | None:
    """fp32 accumulator (BLOCK_M x Dv) plus the fp32 score tile, per thread."""
    regs = (c.block_m * ctx.dv + c.block_m * c.block_n) // _threads(c)
    if regs > _reg_limit(c, ctx):
        return f"~{regs} fp32 registers/thread for accumulators > {_reg_limit(c, ctx)}"
    return None


def bwd_smem_bytes(c, ctx: SpaceContext) -> int:
    """Resident K,V (or Q,dO) tiles + num_stages buffers of the streamed pair (+ one transposed tile
    when the key-block kernel makes dQ: dS^T is an operand there; P^T and dS^T of the dK/dV products
    stay in registers, so 32x128 s3 at d256, 229 KB by this count, compiles and runs on an H100)."""
    e = ctx.elem_bytes
    stages = max(1, c.num_stages)
    d = ctx.dqk + ctx.dv
    kv = e * (c.block_n * d + stages * c.block_m * d)
    if c.dq_mode != "separate":
        kv += e * c.block_m * c.block_n
    if c.dq_mode == "separate":
        # The dQ kernel's compiled footprint on H100 (d256, ptxas "Required" of failed builds and the
        # builds that fit) matches num_stages - 1 buffers of the streamed K/V pair: 32x128 s3 needs
        # 296 KB, 32x128 s2 fits (measured 178 TFLOP/s with dkv_split). A model with num_stages
        # buffers rejected that config; the rare overshoot (64-row dQ tiles) fails at compile time.
        m, n = c.dq_rows, c.dq_cols
        q = e * (m * d + max(1, stages - 1) * n * d + m * n)
        return max(kv, q)
    if c.dq_mode == "tma":
        kv += 4 * c.block_m * ctx.dqk  # the fp32 dQ tile staged for the TMA reduce
    return kv


def bwd_fits_smem(c, ctx: SpaceContext) -> str | None:
    need = bwd_smem_bytes(c, ctx)
    if need > ctx.gpu.smem_per_block:
        return f"shared memory ~{need // 1024} KB > {ctx.gpu.smem_per_block // 1024} KB"
    return None


def bwd_fits_registers(c, ctx: SpaceContext) -> str | None:
    """dK, dV fp32 accumulators plus two fp32 (BLOCK_N x BLOCK_M) tiles (S^T, dP^T), and the fp32 dQ
    partial when the key-block kernel makes it, per thread."""
    dq_tile = c.block_m * ctx.dqk if c.dq_mode != "separate" else 0
    acc = c.block_n * (max(ctx.dqk, ctx.dv) if c.dkv_split else ctx.dqk + ctx.dv)
    kv = (acc + 2 * c.block_m * c.block_n + dq_tile) // _threads(c)
    m = c.dq_rows
    q = (m * ctx.dqk + 2 * m * c.dq_cols) // _threads(c) if c.dq_mode == "separate" else 0
    regs = max(kv, q)
    if regs > _reg_limit(c, ctx):
        return f"~{regs} fp32 registers/thread for accumulators > {_reg_limit(c, ctx)}"
    return None


def dq_block_only_when_separate(c, ctx: SpaceContext) -> str | None:
    """dq_block_m/n only shape the separate dQ kernel; one spelling per config (0 means block_m/n)."""
    for name, own in (("dq_block_m", c.block_m), ("dq_block_n", c.block_n)):
        val = getattr(c, name)
        if c.dq_mode != "separate" and val != 0:
            return f"{name} is unused with dq_mode={c.dq_mode!r} (must be 0)"
        if val == own:
            return f"{name} == {name[3:]}: spelled 0"
        if val > max(16, _next_pow2(ctx.max_len)):
            return f"{name} {val} exceeds the longest sequence ({ctx.max_len})"
    if c.dq_mode == "separate" and c.dq_rows * c.dq_cols < 4 * _threads(c):
        return f"dQ tile {c.dq_rows}x{c.dq_cols} too small for {c.num_warps} warps"
    return None


def tma_dq_needs_hopper(c, ctx: SpaceContext) -> str | None:
    """The TMA reduce-add exists from sm90 on, and the CPU interpreter does not implement it."""
    if c.dq_mode == "tma" and (ctx.interpret or ctx.gpu.compute_capability[0] < 9):
        return "dq_mode='tma' needs sm90+ (TMA reduce) and is not in the interpreter"
    return None


def _fwd_default(ctx: SpaceContext) -> HSTUFwdConfig:
    return default_fwd_config(ctx.dqk, ctx.dv, interpret=ctx.interpret, dtype=ctx.dtype)


def _bwd_default(ctx: SpaceContext) -> HSTUBwdConfig:
    return default_bwd_config(ctx.dqk, ctx.dv, interpret=ctx.interpret, dtype=ctx.dtype)


COMMON_RULES = (head_dims_supported, interpreter_limits, tile_fits_length, enough_work_per_thread)
FWD_RULES = (*COMMON_RULES, fwd_fits_smem, fwd_fits_registers)
BWD_RULES = (*COMMON_RULES, dq_block_only_when_separate, tma_dq_needs_hopper, bwd_fits_smem, bwd_fits_registers)

HSTU_FWD_TRITON = SearchSpace("hstu_attention_fwd/triton", HSTUFwdConfig, FWD_PARAMS, FWD_RULES, _fwd_default)
HSTU_BWD_TRITON = SearchSpace("hstu_attention_bwd/triton", HSTUBwdConfig, BWD_PARAMS, BWD_RULES, _bwd_default)
