"""Tile configuration of the CuTe DSL HSTU attention backward (Hopper sm90).

Frozen and hashable: it keys the compile cache and serialises to artifacts as plain JSON. Structural
checks live in ``__post_init__``; resource checks that depend on head dims and dtype (shared memory,
registers, wgmma shapes) live in ``check_bwd_config``, which the launcher and the search space share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kernel_templates.config_base import L2_GROUPS, JsonConfig

from .config import CUTE_HEAD_DIMS, SMEM_BYTES_SM90, SMEM_RESERVED_BYTES

BWD_DTYPES = ("bfloat16", "float16")
# setmaxnreg budget of each MMA thread, by number of MMA warpgroups (one producer warpgroup besides).
BWD_MMA_REGS = {2: 240}
# Registers per MMA thread for addressing, mask state and loop counters besides the fragments.
BWD_REG_OVERHEAD = 24


@dataclass(frozen=True)
class HSTUCuteBwdConfig(JsonConfig):
    """Backward tiles of the warp-specialised TMA + wgmma kernel (one CTA per key block).

    ``block_n`` keys per CTA (dK and dV stay in registers), ``block_m`` query rows per step of the
    loop over query blocks, ``num_stages`` Q buffers and ``do_stages`` dO buffers in flight (default: as
    many as Q; dO is released earlier in the step, so it needs fewer). ``mma_warpgroups`` MMA warpgroups
    (2; a producer warpgroup besides: one TMA load warp and one dQ reduce warp). ``dq_mode``: "tma"
    writes each dQ partial dS K to shared memory and a dedicated warp adds it to the fp32 dQ buffer
    with a TMA reduce-add (cp.reduce.async.bulk.tensor). ``l2_group`` sequence-heads launch together
    so their Q/dO is re-read from L2 (see ``schedule.py``). ``dq_serial``: the MMA warpgroups pass their
    slices of the dQ partial through one buffer in turns; it halves that fp32 tile (64 KB at 64 x 256) so
    a second Q stage fits at D=256, for a short wait of the second warpgroup on the reduce. ``compact``
    launches only the real key tiles of a jagged batch, heaviest first, from a table built on the device
    (``tile_table.py``; ``l2_group`` then counts whole sequences' heads). ``swap_sdp`` computes S^T = K Q^T
    and dP^T = V dO^T instead, each MMA warpgroup owning 64 keys, so P^T and dS^T stay in registers as
    the A operands of dV and dK (no P tile in shared memory, no barrier before those products); dS^T
    alone goes to shared memory, double-buffered, for dQ. Needs ``block_n == 64 * mma_warpgroups``.
    ``tanh_silu``: sigmoid(x) = 1/2 + tanh(x/2)/2 (one MUFU op per score instead of ex2 and rcp).
    ``persistent`` (with ``compact``): one CTA per SM walks the compact table with a stride of the grid,
    so the Q/dO ring runs on from one key tile into the next and the next tile's K/V load overlaps the
    dK/dV stores of the last one, instead of every short tile paying a CTA launch and a pipeline fill.
    """

    kind: ClassVar[str] = "hstu_attention_bwd_cute"
    block_m: int = 64
    block_n: int = 64
    num_stages: int = 1
    mma_warpgroups: int = 2
    dq_mode: str = "tma"
    l2_group: int = 8
    do_stages: int | None = None
    dq_serial: bool = False
    compact: bool = False
    swap_sdp: bool = False
    tanh_silu: bool = False
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.block_m not in (64, 128):
            raise ValueError(f"HSTUCuteBwdConfig.block_m must be 64 or 128, got {self.block_m!r}")
        if self.block_n not in (64, 128):
            raise ValueError(f"HSTUCuteBwdConfig.block_n must be 64 or 128, got {self.block_n!r}")
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or not 1 <= self.num_stages <= 3:
            raise ValueError(f"HSTUCuteBwdConfig.num_stages must be an int in [1, 3], got {self.num_stages!r}")
        if self.mma_warpgroups not in BWD_MMA_REGS:
            raise ValueError(
                f"HSTUCuteBwdConfig.mma_warpgroups must be one of {tuple(BWD_MMA_REGS)}, got {self.mma_warpgroups!r}"
            )
        if self.l2_group not in L2_GROUPS:
            raise ValueError(f"HSTUCuteBwdConfig.l2_group must be one of {L2_GROUPS}, got {self.l2_group!r}")
        if self.do_stages is None:
            object.__setattr__(self, "do_stages", self.num_stages)
        if (
            not isinstance(self.do_stages, int)
            or isinstance(self.do_stages, bool)
            or not 1 <= self.do_stages <= self.num_stages
        ):
            raise ValueError(
                f"HSTUCuteBwdConfig.do_stages must be an int in [1, num_stages={self.num_stages}], "
                f"got {self.do_stages!r}"
            )
        for name in ("dq_serial", "compact", "swap_sdp", "tanh_silu", "persistent"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HSTUCuteBwdConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dq_mode not in ("tma",):
            raise ValueError(f"HSTUCuteBwdConfig.dq_mode must be 'tma', got {self.dq_mode!r}")
        if self.persistent and not self.compact:
            raise ValueError("HSTUCuteBwdConfig.persistent needs compact=True (the CTAs walk the compact tile table)")


def bwd_smem_bytes(config: HSTUCuteBwdConfig, dqk: int, dv: int, elem_bytes: int = 2) -> int:
    """Shared memory: Q and dO stages, the K/V tiles, P and dS tiles (two dS^T buffers with ``swap_sdp``),
    and the fp32 dQ partial tile (one warpgroup's slice of it with ``dq_serial``)."""
    qdo = config.block_m * (config.num_stages * dqk + config.do_stages * dv)
    kv = config.block_n * (dqk + dv)
    pds = 2 * config.block_m * config.block_n
    dq = 4 * config.block_m * dqk // (config.mma_warpgroups if config.dq_serial else 1)
    return (qdo + kv + pds) * elem_bytes + dq + SMEM_RESERVED_BYTES


def bwd_accumulator_regs(config: HSTUCuteBwdConfig, dqk: int, dv: int) -> int:
    """Peak 32-bit registers per MMA thread held by fragments: dK + dV always, then either
    S/dsilu + dP + 16-bit P, or the dQ partial."""
    threads = 128 * config.mma_warpgroups
    dkv = config.block_n * (dqk + dv) // threads
    s = config.block_m * config.block_n // threads
    dq = config.block_m * dqk // threads
    return dkv + max(2 * s + s // 2, dq)


def wgmma_split(config: HSTUCuteBwdConfig) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Warpgroup layouts (M-split, N-split) of the S/dP (S^T/dP^T with ``swap_sdp``), dK/dV and dQ
    products (64 rows per wgmma)."""
    wg = config.mma_warpgroups
    am = config.block_m // 64
    bm = config.block_n // 64
    dkv = (bm, wg // max(bm, 1))
    sdp = dkv if config.swap_sdp else (am, wg // max(am, 1))
    return sdp, dkv, (am, wg // max(am, 1))


def wgmma_shape_error(config: HSTUCuteBwdConfig, dqk: int) -> str | None:
    """Why the five products cannot be split over the MMA warpgroups (None when they can): 64-row
    slices, N a multiple of 16 and at most 256; with ``swap_sdp`` every warpgroup owns 64 whole keys."""
    wg = config.mma_warpgroups
    sdp_n = config.block_m if config.swap_sdp else config.block_n
    if config.swap_sdp and config.block_n != 64 * wg:
        return f"swap_sdp needs block_n == 64 * mma_warpgroups = {64 * wg}, got block_n={config.block_n}"
    for name, (m_split, n_split), n_total in zip(
        ("S/dP", "dK/dV", "dQ"), wgmma_split(config), (sdp_n, dqk, dqk), strict=True
    ):
        if m_split * n_split != wg or n_total % n_split or (n_total // n_split) % 16 or n_total // n_split > 256:
            return (
                f"the {name} wgmma cannot be split over {wg} warpgroups "
                f"(wgmma shapes: 64-row slices, N multiple of 16 and at most 256)"
            )
    return None


def check_bwd_config(
    config: HSTUCuteBwdConfig,
    dtype: str,
    dqk: int,
    dv: int,
    smem_limit: int = SMEM_BYTES_SM90,
    max_regs: int | None = None,
) -> None:
    """Raise ``ValueError`` saying why ``config`` cannot run for this dtype and these head dims."""
    if not isinstance(config, HSTUCuteBwdConfig):
        raise ValueError(f"config must be an HSTUCuteBwdConfig, got {type(config).__name__}")
    if dtype not in BWD_DTYPES:
        raise ValueError(f"dtype: CuTe HSTU backward supports {BWD_DTYPES}, got {dtype!r}")
    if dqk not in CUTE_HEAD_DIMS or dv not in CUTE_HEAD_DIMS:
        raise ValueError(f"CuTe HSTU backward supports head dims {CUTE_HEAD_DIMS}, got Dqk={dqk}, Dv={dv}")
    if dqk != dv:
        raise ValueError(f"CuTe HSTU backward needs Dqk == Dv, got Dqk={dqk}, Dv={dv}")
    wg = config.mma_warpgroups
    shape_error = wgmma_shape_error(config, dqk)
    if shape_error is not None:
        raise ValueError(f"config {config.to_dict()}: {shape_error}")
    need = bwd_smem_bytes(config, dqk, dv)
    if need > smem_limit:
        raise ValueError(
            f"config {config.to_dict()} needs {need} bytes of shared memory for D={dqk}, above the {smem_limit} limit"
        )
    if max_regs is None:
        max_regs = BWD_MMA_REGS[wg]
    regs = bwd_accumulator_regs(config, dqk, dv) + BWD_REG_OVERHEAD
    if regs > max_regs:
        raise ValueError(
            f"config {config.to_dict()} needs about {regs} registers per MMA thread for D={dqk}, above {max_regs}"
        )


def default_cute_bwd_config(dqk: int, dv: int) -> HSTUCuteBwdConfig:
    """Heuristic default before tuning (FA3-like tiles): 64 x 64 at D=256, 64 x 128 below."""
    if max(dqk, dv) >= 256:
        return HSTUCuteBwdConfig(block_m=64, block_n=64, num_stages=1)
    return HSTUCuteBwdConfig(block_m=64, block_n=128, num_stages=2)
