"""Tile configuration of the CuTe DSL GEMM + bias + SiLU kernel for Hopper (sm90).

Frozen and hashable, so it keys the compile cache and serialises to artifacts as plain JSON. The
constructor checks structure (each field alone); ``check_gemm_silu_config`` checks what depends on
the problem and the GPU (shared memory, registers, N/K divisibility) before anything is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kernel_templates.config_base import JsonConfig

SMEM_BYTES_SM90 = 227 * 1024
EPI_N = 32  # columns of one epilogue sub-tile (registers -> smem -> TMA store)
EPI_STAGES = 2  # epilogue smem buffers, so one TMA store drains while the next sub-tile is written
SMEM_RESERVED_BYTES = 1024  # mbarriers and alignment padding
# tile_m 256 (two warpgroups of 128 rows, MMA_M = 2 per warpgroup) compiled but gave wrong results on
# an H100: the epilogue's sub-tile walk assumes one 64-row wgmma atom per warpgroup. Not offered.
TILE_M = (64, 128, 192)
PINGPONG_TILE_M = (64,)  # one warpgroup's whole tile is one 64-row wgmma atom (the epilogue walks one)
TILE_N = (64, 96, 128, 160, 192, 224, 256)
TILE_K = (32, 64, 128)
CLUSTER = (1, 2)
# A persistent grid is one cluster per cluster_size SMs; pairs always fit (two SMs share a TPC), while how
# many larger clusters can be resident at once depends on the GPU's GPC layout (the rest would run late).
PERSISTENT_CLUSTER = 2
RASTERS = ("m", "n")
# (MMA warpgroups) -> (registers per MMA thread, per producer thread) after setmaxnreg (sum * 128 <= 64K).
REGS = {1: (256, 56), 2: (240, 24), 3: (160, 32)}
REG_OVERHEAD = 40  # addressing, pipeline state, epilogue temporaries per MMA thread


@dataclass(frozen=True)
class GemmSiluConfig(JsonConfig):
    """CTA tile (tile_m x tile_n, k-step tile_k), TMA-multicast cluster, smem stages, raster order.

    ``tile_m`` rows are split over MMA warpgroups of 64 rows each; one extra producer warpgroup issues
    the TMA loads. ``persistent``: one CTA per SM walks the tiles (clusters of at most 2 CTAs, which walk
    tile pairs in step), so the next tile's loads and this tile's output stores overlap the epilogue and
    the next main loop. ``pingpong`` (needs ``persistent``, tile_m 64): two MMA warpgroups each own
    a whole tile and take turns on the tensor cores, so one's epilogue (bias, SiLU, stores) runs while the
    other's main loop does. ``cluster_m`` CTAs along M share (multicast) each W tile, ``cluster_n`` CTAs
    along N share each x tile. ``raster`` picks which tile index varies fastest across the launch: "n"
    keeps an x row-block hot in L2 while every N tile consumes it (good when W fits L2), "m" the converse.
    """

    kind: ClassVar[str] = "gemm_silu_cute"
    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 1
    cluster_n: int = 1
    num_stages: int = 4
    raster: str = "n"
    persistent: bool = False
    pingpong: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("tile_m", TILE_M), ("tile_n", TILE_N), ("tile_k", TILE_K)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v not in allowed:
                raise ValueError(f"GemmSiluConfig.{name} must be one of {allowed}, got {v!r}")
        for name in ("cluster_m", "cluster_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v not in CLUSTER:
                raise ValueError(f"GemmSiluConfig.{name} must be one of {CLUSTER}, got {v!r}")
        n = self.num_stages
        if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= 8:
            raise ValueError(f"GemmSiluConfig.num_stages must be an int in [2, 8], got {n!r}")
        if self.raster not in RASTERS:
            raise ValueError(f"GemmSiluConfig.raster must be one of {RASTERS}, got {self.raster!r}")
        if not isinstance(self.persistent, bool):
            raise ValueError(f"GemmSiluConfig.persistent must be a bool, got {self.persistent!r}")
        if not isinstance(self.pingpong, bool):
            raise ValueError(f"GemmSiluConfig.pingpong must be a bool, got {self.pingpong!r}")

    @property
    def mma_warpgroups(self) -> int:
        """One consumer warpgroup per 64 rows (the wgmma M); two whole-tile ones with ``pingpong``."""
        return 2 if self.pingpong else self.tile_m // 64

    @property
    def tiles_in_flight(self) -> int:
        """Output tiles the MMA warpgroups hold at once (each has its own epilogue buffers and bias)."""
        return 2 if self.pingpong else 1

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n


def smem_bytes(config: GemmSiluConfig, elem_bytes: int = 2) -> int:
    """Shared memory: stages x (x tile + W tile), the epilogue buffers, the fp32 bias tile, barriers."""
    c = config
    mainloop = c.num_stages * (c.tile_m + c.tile_n) * c.tile_k * elem_bytes
    epilogue = c.tiles_in_flight * EPI_STAGES * c.tile_m * EPI_N * elem_bytes
    return mainloop + epilogue + c.tiles_in_flight * 4 * c.tile_n + SMEM_RESERVED_BYTES


def accumulator_regs(config: GemmSiluConfig) -> int:
    """fp32 accumulator registers per MMA thread: tile_m x tile_n over the warpgroups that share a tile."""
    sharing = config.mma_warpgroups // config.tiles_in_flight
    return config.tile_m * config.tile_n // (128 * sharing)


def check_gemm_silu_config(
    config: GemmSiluConfig, n: int | None = None, k: int | None = None, smem_limit: int = SMEM_BYTES_SM90
) -> None:
    """Raise ``ValueError`` saying why ``config`` cannot run (for this N and K when given)."""
    if not isinstance(config, GemmSiluConfig):
        raise ValueError(f"config must be a GemmSiluConfig, got {type(config).__name__}")
    need = smem_bytes(config)
    if need > smem_limit:
        raise ValueError(f"config {config.to_dict()} needs {need} bytes of shared memory, above the {smem_limit} limit")
    budget = REGS[config.mma_warpgroups][0]
    regs = accumulator_regs(config) + REG_OVERHEAD
    if regs > budget:
        raise ValueError(f"config {config.to_dict()} needs about {regs} registers per MMA thread, above {budget}")
    if config.cluster_size > 4:
        raise ValueError(f"config {config.to_dict()}: cluster of {config.cluster_size} CTAs, at most 4")
    if config.persistent and config.cluster_size > PERSISTENT_CLUSTER:
        raise ValueError(f"config {config.to_dict()}: a persistent kernel runs clusters of at most 2 CTAs")
    if config.pingpong and not (config.persistent and config.tile_m in PINGPONG_TILE_M):
        raise ValueError(f"config {config.to_dict()}: pingpong needs persistent and tile_m in {PINGPONG_TILE_M}")
    if n is not None and (n <= 0 or n % 8):
        raise ValueError(f"N (out_features) must be a positive multiple of 8 for TMA (16-byte rows), got {n}")
    if k is not None and (k <= 0 or k % 8):
        raise ValueError(f"K (in_features) must be a positive multiple of 8 for TMA (16-byte rows), got {k}")


def default_gemm_silu_config(m: int, n: int, k: int) -> GemmSiluConfig:
    """Heuristic before tuning: for a large M, 64 x 256 x 64 tiles in pingpong (two warpgroups take turns, one's
    epilogue under the other's main loop), persistent pairs of CTAs sharing each W k-tile, 5 stages (the best
    measured on an H100 with the pre-activation stored too, 6-10% ahead of 128 x 256 cooperative tiles at
    131072 rows); smaller N tiles when few tiles would fill the GPU.

    N-fastest raster keeps each x row-block in L2 while all N tiles use it (W is small: N x K). Tiles divide
    N and K where they can (a narrow head dim gives K or N of 32 or 96): a k-tile past K loads only zeros.
    """
    tile_k = next((t for t in (64, 32) if k % t == 0), 64)
    tiles = -(-max(m, 1) // 128) * -(-n // 256)
    if tiles >= 132 and n % 256 == 0:
        return GemmSiluConfig(64, 256, tile_k, 2, 1, 5, "n", True, True)
    tile_n = next((t for t in (128, 64) if n % t == 0), 128 if n > 128 else 64)
    return GemmSiluConfig(128, tile_n, tile_k, 1, 1, 5 if tile_n == 128 else 6, "n")
