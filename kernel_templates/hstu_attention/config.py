"""Tile configurations of the Triton HSTU attention templates.

A config is a frozen, hashable dataclass so it can key compile caches and be written to artifacts as
plain JSON. ``default_*`` is the heuristic used when nothing was tuned; the full search space and its
feasibility rules live in ``search_spaces/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kernel_templates.config_base import L2_GROUPS, JsonConfig

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)


def padded_head_dim(d: int) -> int | None:
    """The smallest kernel head dim >= ``d`` (a call with another head dim runs zero-padded to it), None
    above the largest."""
    return next((s for s in SUPPORTED_HEAD_DIMS if s >= d), None)


DQ_MODES = ("atomic", "separate", "tma")


@dataclass(frozen=True)
class _ConfigBase(JsonConfig):
    """Checks shared by the Triton configs' tile, warp, stage and launch-order fields."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name.startswith("block_") and (not isinstance(val, int) or val < 16 or val & (val - 1)):
                raise ValueError(f"{type(self).__name__}.{f.name} must be a power of two >= 16, got {val!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{type(self).__name__}.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"{type(self).__name__}.num_stages must be an int in [1, 8], got {self.num_stages!r}")
        if self.l2_group not in L2_GROUPS:
            raise ValueError(f"{type(self).__name__}.l2_group must be one of {L2_GROUPS}, got {self.l2_group!r}")


@dataclass(frozen=True)
class HSTUFwdConfig(_ConfigBase):
    """Forward tiles: BLOCK_M query rows per program, BLOCK_N keys per inner step; ``l2_group``
    sequence-heads launch together so their K/V stays in L2 (see ``triton_common.grouped_block_order``)."""

    kind: ClassVar[str] = "hstu_attention_fwd"
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    l2_group: int = 8


@dataclass(frozen=True)
class HSTUBwdConfig(_ConfigBase):
    """Backward tiles: one program owns BLOCK_N keys and walks query blocks of BLOCK_M rows.

    ``dq_mode`` says how dQ is produced: ``atomic`` adds each tile's fp32 contribution into a dQ
    accumulator from the key-block programs; ``tma`` does the same with one TMA reduce-add per tile
    (Hopper; not in the CPU interpreter); ``separate`` runs a second kernel parallel over query
    blocks that recomputes S and dP (more FLOPs, no atomics) on ``dq_block_m`` x ``dq_block_n``
    tiles (0: the key-block kernel's). ``dkv_split`` runs the key-block kernel twice, once for dV
    and once for dK (+ dQ when made there): one more S^T product, but one fp32 accumulator per pass
    instead of two, which at D=256 is the difference between spilling and not.
    """

    kind: ClassVar[str] = "hstu_attention_bwd"
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    dq_mode: str = "atomic"
    dq_block_m: int = 0
    l2_group: int = 8
    dkv_split: bool = False
    dq_block_n: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.dkv_split, bool):
            raise ValueError(f"HSTUBwdConfig.dkv_split must be a bool, got {self.dkv_split!r}")
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"HSTUBwdConfig.dq_mode must be one of {DQ_MODES}, got {self.dq_mode!r}")
        if self.dq_block_m not in (0, 16, 32, 64, 128, 256):
            raise ValueError(
                f"HSTUBwdConfig.dq_block_m must be 0 (= block_m) or a power of two 16..256, got {self.dq_block_m!r}"
            )
        if self.dq_block_n not in (0, 16, 32, 64, 128, 256):
            raise ValueError(
                f"HSTUBwdConfig.dq_block_n must be 0 (= block_n) or a power of two 16..256, got {self.dq_block_n!r}"
            )

    @property
    def dq_rows(self) -> int:
        """Query rows per program of the separate dQ kernel."""
        return self.dq_block_m or self.block_m

    @property
    def dq_cols(self) -> int:
        """Keys per inner step of the separate dQ kernel: its K/V tiles need not match the key-block
        kernel's, whose BLOCK_N sizes the resident dK/dV accumulators."""
        return self.dq_block_n or self.block_n


def _is_fp32(dtype: object) -> bool:
    return str(dtype).removeprefix("torch.") == "float32"


def default_fwd_config(dqk: int, dv: int, interpret: bool = False, dtype: object = None) -> HSTUFwdConfig:
    """Heuristic forward tiles, chosen from GPU sweeps on H100/H200 (see artifacts for tuned ones).

    ``dtype`` float32 (torch dtype or name) takes smaller tiles: the half-precision tiles of
    head dims 128/256 need twice the shared memory in fp32, more than an H100 has (the Triton
    space's smem model; fp32 is the correctness path, not a tuned one)."""
    if interpret:
        return HSTUFwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    d = max(dqk, dv)
    if _is_fp32(dtype) and d > 64:
        return HSTUFwdConfig(block_m=64, block_n=64 if d <= 128 else 32, num_warps=4, num_stages=2)
    if d >= 256:
        # H100, b32 h4 d256 4K uniform: 303 TFLOP/s (128x64 w8 s3 and 128x128 s2 exceed 227 KB smem);
        # l2_group=8 (the dataclass default) lifts it to 370 (L2-grouped launch order, docs/RESULTS.md).
        return HSTUFwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    # H100, d128 4K: 64x64 w4 s3 282 TFLOP/s vs 128x64 w8 s3 274.
    return HSTUFwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


def default_bwd_config(dqk: int, dv: int, interpret: bool = False, dtype: object = None) -> HSTUBwdConfig:
    """Heuristic backward tiles (float32: smaller ones that fit, as for the forward)."""
    if interpret:
        return HSTUBwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    d = max(dqk, dv)
    if _is_fp32(dtype) and d > 64:
        if d <= 128:
            return HSTUBwdConfig(block_m=32, block_n=64, num_warps=4, num_stages=2, dq_mode="atomic")
        return HSTUBwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1, dq_mode="atomic")
    if d >= 256:
        # H100, d256 4K uniform (the Triton backward sweep in docs/RESULTS.md): fp32 dQ atomics of 64x256
        # tiles throttle the key-block kernel (45-66 TFLOP/s); 64x64 with a separate dQ pass: 157
        # (both kernels spill at 255 registers). dV and dK in two passes over 128-key blocks (one
        # accumulator each) with 3 stages of 32 query rows, and the dQ kernel on its own 128x32 tiles:
        # 268 (key-block passes 6.5 ms + dQ 3.8 ms).
        return HSTUBwdConfig(
            block_m=32,
            block_n=128,
            num_warps=8,
            num_stages=3,
            dq_mode="separate",
            dq_block_m=128,
            dkv_split=True,
            dq_block_n=32,
        )
    # H100, d128 4K: 64x128 w8 s2 atomic 238 TFLOP/s, 287 with l2_group=8.
    return HSTUBwdConfig(block_m=64, block_n=128, num_warps=8, num_stages=2, dq_mode="atomic")
