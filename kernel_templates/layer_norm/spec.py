"""Spec of the input LayerNorm op: forward and backward kernels, Triton and torch backends."""

from __future__ import annotations

from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec

_P = "kernel_templates.layer_norm"
_FILES = (
    "kernel_templates/config_base.py",
    "kernel_templates/layer_norm/config.py",
    "kernel_templates/layer_norm/triton_layer_norm.py",
)


def _kernel(direction: str) -> KernelSpec:
    cls = "LayerNormFwdConfig" if direction == "fwd" else "LayerNormBwdConfig"
    return KernelSpec(
        name=f"layer_norm_{direction}",
        direction=direction,
        make_inputs=f"{_P}.tuning:make_inputs_{direction}",
        reference=f"{_P}.tuning:reference_{direction}",
        flops=f"{_P}.tuning:flops_{direction}",
        bytes=f"{_P}.tuning:bytes_{direction}",
        alloc_out=f"{_P}.tuning:alloc_out_{direction}",
        output_names=("y",) if direction == "fwd" else ("dx", "dweight", "dbias"),
        backends=(
            BackendSpec(
                name="triton",
                launcher=f"{_P}.launch:layer_norm_{direction}",
                config=f"{_P}.config:{cls}",
                space=f"search_spaces.layer_norm_triton:LAYER_NORM_{direction.upper()}_TRITON",
                tune_launch=f"{_P}.tuning:launch_triton_{direction}",
                sources=_FILES,
                interpretable=True,
                jit_functions=f"{_P}.tuning:jit_{direction}",
            ),
            BackendSpec(
                name="torch",
                launcher=f"{_P}.launch:layer_norm_{direction}_torch",
                config=f"{_P}.reference:TorchLayerNormConfig",
                space=f"search_spaces.layer_norm_triton:LAYER_NORM_{direction.upper()}_TORCH",
                tune_launch=f"{_P}.tuning:launch_torch_{direction}",
                sources=("kernel_templates/layer_norm/reference.py",),
                interpretable=True,
            ),
        ),
        default_backend="triton",
        default=f"{_P}.spec:defaults_{direction}",
    )


def defaults_fwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .config import LayerNormFwdConfig, default_fwd_config
    from .reference import TorchLayerNormConfig

    cfg = LayerNormFwdConfig(4, 1) if interpret else default_fwd_config(num_heads * dv)
    return {"triton": cfg, "torch": TorchLayerNormConfig()}


def defaults_bwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .config import LayerNormBwdConfig, default_bwd_config
    from .reference import TorchLayerNormConfig

    cfg = LayerNormBwdConfig(4, 1, 4) if interpret else default_bwd_config(num_heads * dv)
    return {"triton": cfg, "torch": TorchLayerNormConfig()}


SPEC = OpSpec(
    name="layer_norm",
    kernels=(_kernel("fwd"), _kernel("bwd")),
    doc="LayerNorm of the residual stream before the uvqk projection (fp32 statistics, output in the GEMM dtype).",
)
