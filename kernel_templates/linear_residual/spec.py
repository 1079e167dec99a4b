"""Spec of the output projection + residual: one tuned forward kernel on cuBLAS (two formulations).

Its backward is plain GEMMs (``impl.linear_residual_bwd``), run by the fused layer, not tuned.
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
    ),
    doc="out = residual + y W_o^T + b_o (the HSTU layer's output projection).",
)


def defaults(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .impl import LinearResidualConfig

    return {"torch": LinearResidualConfig("linear_add")}
