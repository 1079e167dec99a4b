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


def hstu_attention_cute_bwd_validated(
    do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen, config,
    out=None,
):  # fmt: skip
    """``hstu_attention_cute_bwd`` as dispatch launches it: like every runtime launcher it takes inputs its
    caller (``autotune.runtime.ops``, the fused layer) has validated, so the call does not check them a second
    time. ``out=(dq, dk, dv)`` receives the gradients (the fused layer's d(uvqk) slices)."""
    return hstu_attention_cute_bwd(
        do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len,
        scaling_seqlen, config=config, out=out, validate=False,
    )  # fmt: skip


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
    "hstu_attention_cute_bwd_validated",
    "hstu_attention_cute_fwd",
    "smem_bytes",
]
