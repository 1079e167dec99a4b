"""CuTe DSL GEMM + bias + SiLU for Hopper (sm90): the HSTU layer's uvqk projection ``silu(x W^T + b)``."""

from .config import GemmSiluConfig, check_gemm_silu_config, default_gemm_silu_config, smem_bytes
from .op import GemmSiluKey, compile_gemm_silu, gemm_silu, gemm_silu_fwd, validate_gemm_silu_inputs
from .reference import gemm_silu_flops, gemm_silu_pre_reference, gemm_silu_reference, gemm_silu_torch

__all__ = [
    "GemmSiluConfig",
    "GemmSiluKey",
    "check_gemm_silu_config",
    "compile_gemm_silu",
    "default_gemm_silu_config",
    "gemm_silu",
    "gemm_silu_flops",
    "gemm_silu_fwd",
    "gemm_silu_pre_reference",
    "gemm_silu_reference",
    "gemm_silu_torch",
    "smem_bytes",
    "validate_gemm_silu_inputs",
]
