"""Fused ``dropout(LayerNorm(x) * u)`` of the HSTU layer: reference, Triton kernels, autograd function."""

from .op import FusedLNMulDropout, fused_ln_mul_dropout
from .reference import ln_mul_dropout_reference

__all__ = ["FusedLNMulDropout", "fused_ln_mul_dropout", "ln_mul_dropout_reference"]
