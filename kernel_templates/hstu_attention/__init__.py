"""Jagged HSTU attention: PyTorch reference, Triton forward/backward templates and their configs."""

from .config import HSTUBwdConfig, HSTUFwdConfig, default_bwd_config, default_fwd_config
from .op import HSTUAttentionFunction, hstu_attention, validate_hstu_inputs
from .reference import hstu_attention_flops, hstu_attention_reference, hstu_mask, hstu_position_ids

__all__ = [
    "HSTUAttentionFunction",
    "HSTUBwdConfig",
    "HSTUFwdConfig",
    "default_bwd_config",
    "default_fwd_config",
    "hstu_attention",
    "hstu_attention_flops",
    "hstu_attention_reference",
    "hstu_mask",
    "hstu_position_ids",
    "validate_hstu_inputs",
]
