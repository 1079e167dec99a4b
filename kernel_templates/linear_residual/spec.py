"""Spec of the output projection + residual: a tuned forward (two cuBLAS formulations, ``impl``) and a tuned
backward (dy and dW, the order and stream of its two cuBLAS GEMMs, ``bwd_impl``; the bias gradient is summed
by the layer's input LayerNorm backward).
"""

from __future__ import annotations

from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec

_P = "kernel_templates.linear_residual"

SPEC = OpSpec(
    name="linear_residual",
    kernels=(
        KernelSpec(
            name="linear_residual_fwd",
            direction="fwd",
            make_inputs=f"{_P}.tuning:make_inputs",
            reference=f"{_P}.tuning:reference",
            flops=f"{_P}.tuning:flops",
            alloc_out=f"{_P}.tuning:alloc_out",
            backends=(
                BackendSpec(
                    name="torch",
                    launcher=f"{_P}.launch:linear_residual",
                    config=f"{_P}.impl:LinearResidualConfig",
                    space="search_spaces.linear_residual_torch:LINEAR_RESIDUAL_TORCH",
                    tune_launch=f"{_P}.tuning:launch",
                    sources=("kernel_templates/config_base.py", "kernel_templates/linear_residual/impl.py"),
                    interpretable=True,
                ),
            ),
            default_backend="torch",
            default=f"{_P}.spec:defaults",
        ),
        KernelSpec(
            name="linear_residual_bwd",
            direction="bwd",
            make_inputs=f"{_P}.tuning:make_inputs_bwd",
            reference=f"{_P}.tuning:reference_bwd",
            flops=f"{_P}.tuning:flops_bwd",
            alloc_out=f"{_P}.tuning:alloc_out_bwd",
            output_names=("dy", "dweight"),
            backends=(
                BackendSpec(
                    name="torch",
                    launcher=f"{_P}.launch:linear_residual_bwd",
                    config=f"{_P}.bwd_impl:LinearResidualBwdConfig",
                    space="search_spaces.linear_residual_bwd_torch:LINEAR_RESIDUAL_BWD_TORCH",
                    tune_launch=f"{_P}.tuning:launch_bwd",
                    sources=("kernel_templates/config_base.py", "kernel_templates/linear_residual/bwd_impl.py"),
                    interpretable=True,
                ),
            ),
            default_backend="torch",
            default=f"{_P}.spec:defaults_bwd",
        ),
    ),
    doc="out = residual + y W_o^T + b_o (the HSTU layer's output projection) and its dy, dW_o.",
)


def defaults(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .impl import LinearResidualConfig

    return {"torch": LinearResidualConfig("linear_add")}


def defaults_bwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .bwd_impl import LinearResidualBwdConfig

    return {"torch": LinearResidualBwdConfig("serial")}
