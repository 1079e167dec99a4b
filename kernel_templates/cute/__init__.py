"""CuTe DSL (CUTLASS Python API) templates for Hopper: jagged HSTU attention forward and backward."""

from .bwd_config import HSTUCuteBwdConfig, bwd_smem_bytes, check_bwd_config, default_cute_bwd_config
from .bwd_op import BwdKey, bwd_key, compile_bwd, hstu_attention_cute_bwd
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
    "BwdKey",
    "FwdKey",
    "HSTUCuteBwdConfig",
    "HSTUCuteFwdConfig",
    "bwd_key",
    "bwd_smem_bytes",
    "check_bwd_config",
    "check_fwd_config",
    "compile_bwd",
    "compile_fwd",
    "default_cute_bwd_config",
    "default_cute_fwd_config",
    "fwd_key",
    "hstu_attention_cute",
    "hstu_attention_cute_bwd",
    "hstu_attention_cute_fwd",
    "smem_bytes",
]
