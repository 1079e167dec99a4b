"""Spec of the fused ``dropout(LN(attn) * u)`` op: forward and backward, Triton and torch backends."""

from __future__ import annotations

from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec

_P = "kernel_templates.fused_ln_mul_dropout"
_FILES = (
    "kernel_templates/config_base.py",
    "kernel_templates/layer_norm/config.py",
    "kernel_templates/fused_ln_mul_dropout/config.py",
    "kernel_templates/fused_ln_mul_dropout/triton_ln_mul_dropout.py",
)


def _kernel(direction: str) -> KernelSpec:
    cls = "LnMulDropoutFwdConfig" if direction == "fwd" else "LnMulDropoutBwdConfig"
    return KernelSpec(
        name=f"ln_mul_dropout_{direction}",
        direction=direction,
        make_inputs=f"{_P}.tuning:make_inputs_{direction}",
        reference=f"{_P}.tuning:reference_{direction}",
        flops=f"{_P}.tuning:flops_{direction}",
        bytes=f"{_P}.tuning:bytes_{direction}",
        alloc_out=f"{_P}.tuning:alloc_out_{direction}",
        output_names=("out",) if direction == "fwd" else ("dx", "du", "dweight", "dbias"),
        backends=(
            BackendSpec(
                name="triton",
                launcher=f"{_P}.launch:ln_mul_dropout_{direction}",
                config=f"{_P}.config:{cls}",
                space=f"search_spaces.ln_mul_dropout_triton:LN_MUL_DROPOUT_{direction.upper()}_TRITON",
                tune_launch=f"{_P}.tuning:launch_triton_{direction}",
                sources=_FILES,
                interpretable=True,
                jit_functions=f"{_P}.tuning:jit_{direction}",
            ),
            BackendSpec(
                name="torch",
                launcher=f"{_P}.launch:ln_mul_dropout_{direction}_torch",
                config=f"{_P}.torch_impl:TorchLnMulDropoutConfig",
                space=f"search_spaces.ln_mul_dropout_triton:LN_MUL_DROPOUT_{direction.upper()}_TORCH",
                tune_launch=f"{_P}.tuning:launch_torch_{direction}",
                sources=(
                    *_FILES,
                    "kernel_templates/fused_ln_mul_dropout/torch_impl.py",
                    "kernel_templates/gemm_silu/reference.py",
                ),
                interpretable=True,
            ),
        ),
        default_backend="triton",
        default=f"{_P}.spec:defaults_{direction}",
    )


def defaults_fwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .config import LnMulDropoutFwdConfig, default_fwd_config
    from .torch_impl import TorchLnMulDropoutConfig

    cfg = LnMulDropoutFwdConfig(4, 1) if interpret else default_fwd_config(num_heads * dv)
    return {"triton": cfg, "torch": TorchLnMulDropoutConfig()}


def defaults_bwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .config import LnMulDropoutBwdConfig, default_bwd_config
    from .torch_impl import TorchLnMulDropoutConfig

    cfg = LnMulDropoutBwdConfig(4, 1, 4) if interpret else default_bwd_config(num_heads * dv)
    return {"triton": cfg, "torch": TorchLnMulDropoutConfig()}


SPEC = OpSpec(
    name="ln_mul_dropout",
    kernels=(_kernel("fwd"), _kernel("bwd")),
    doc="dropout(LayerNorm(attn) * u) of the HSTU layer; the mask is drawn from a seed, never stored.",
)
