"""Input LayerNorm of the HSTU layer: Triton forward/backward with explicit configs, torch reference."""

from .config import LayerNormBwdConfig, LayerNormFwdConfig, default_bwd_config, default_fwd_config
from .launch import layer_norm_bwd, layer_norm_fwd

__all__ = [
    "LayerNormBwdConfig",
    "LayerNormFwdConfig",
    "default_bwd_config",
    "default_fwd_config",
    "layer_norm_bwd",
    "layer_norm_fwd",
]
