"""Fused ``dropout(LayerNorm(x) * u)`` of the HSTU layer: reference, Triton kernels, autograd function."""

from .op import fused_ln_mul_dropout, ln_mul_dropout_bwd_op, ln_mul_dropout_fwd_op
from .reference import ln_mul_dropout_reference

__all__ = ["fused_ln_mul_dropout", "ln_mul_dropout_bwd_op", "ln_mul_dropout_fwd_op", "ln_mul_dropout_reference"]
