"""CuTe DSL (CUTLASS Python API) templates for Hopper: jagged HSTU attention forward."""

from .config import CUTE_HEAD_DIMS, HSTUCuteFwdConfig, check_fwd_config, smem_bytes
from .op import (
    FwdKey,
    compile_fwd,
    default_cute_fwd_config,
    fwd_key,
    hstu_attention_cute,
    hstu_attention_cute_fwd,
)

__all__ = [
    "CUTE_HEAD_DIMS",
    "FwdKey",
    "HSTUCuteFwdConfig",
    "check_fwd_config",
    "compile_fwd",
    "default_cute_fwd_config",
    "fwd_key",
    "hstu_attention_cute",
    "hstu_attention_cute_fwd",
    "smem_bytes",
]
