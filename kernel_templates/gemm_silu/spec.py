"""Spec of the uvqk projection silu(x W^T + b): forward (CuTe DSL fused epilogue, torch) and backward
(Triton SiLU' pass + cuBLAS, torch)."""

from __future__ import annotations

from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec

_P = "kernel_templates.gemm_silu"
_CUTE_SHARED = ("kernel_templates/cute_runtime.py", "kernel_templates/cute_sm90.py", "kernel_templates/config_base.py")
_TORCH = ("kernel_templates/gemm_silu/reference.py", "kernel_templates/gemm_silu/torch_impl.py")

FWD = KernelSpec(
    name="gemm_silu",
    direction="fwd",
    make_inputs=f"{_P}.tuning:make_inputs",
    reference=f"{_P}.tuning:reference",
    flops=f"{_P}.tuning:flops",
    alloc_out=f"{_P}.tuning:alloc_out",
    output_names=("y", "pre"),
    backends=(
        BackendSpec(
            name="cute",
            launcher=f"{_P}.op:gemm_silu_fwd",
            config=f"{_P}.config:GemmSiluConfig",  # pure Python: reading an artifact never imports cutlass
            space="search_spaces.gemm_silu_cute:GEMM_SILU_CUTE",
            tune_launch=f"{_P}.tuning:launch_cute",
            sources=(
                *(
                    f"kernel_templates/gemm_silu/{f}"
                    for f in ("config.py", "gemm_silu_sm90.py", "op.py", "reference.py")
                ),
                *_CUTE_SHARED,
            ),
            requires=("cutlass",),
            needs_cuda=True,
            compute_capability=(9, 0),
        ),
        BackendSpec(
            name="torch",
            launcher=f"{_P}.launch:gemm_silu_fwd_torch",
            config=f"{_P}.torch_impl:TorchGemmSiluConfig",
            space="search_spaces.gemm_silu_bwd_triton:GEMM_SILU_TORCH",
            tune_launch=f"{_P}.tuning:launch_torch",
            sources=_TORCH,
            interpretable=True,
        ),
    ),
    default_backend="cute",
    default=f"{_P}.spec:defaults_fwd",
)

BWD = KernelSpec(
    name="gemm_silu_bwd",
    direction="bwd",
    make_inputs=f"{_P}.tuning:make_inputs_bwd",
    reference=f"{_P}.tuning:reference_bwd",
    flops=f"{_P}.tuning:flops_bwd",
    alloc_out=f"{_P}.tuning:alloc_out_bwd",
    output_names=("dx", "dweight", "dbias"),
    backends=(
        BackendSpec(
            name="triton",
            launcher=f"{_P}.launch:gemm_silu_bwd",
            config=f"{_P}.bwd_config:GemmSiluBwdConfig",
            space="search_spaces.gemm_silu_bwd_triton:GEMM_SILU_BWD_TRITON",
            tune_launch=f"{_P}.tuning:launch_triton_bwd",
            sources=(
                "kernel_templates/config_base.py",
                *_TORCH,
                "kernel_templates/gemm_silu/bwd_config.py",
                "kernel_templates/gemm_silu/triton_bwd.py",
            ),  # fmt: skip
            interpretable=True,
            jit_functions=f"{_P}.tuning:jit_bwd",
        ),
        BackendSpec(
            name="torch",
            launcher=f"{_P}.launch:gemm_silu_bwd_torch",
            config=f"{_P}.torch_impl:TorchGemmSiluConfig",
            space="search_spaces.gemm_silu_bwd_triton:GEMM_SILU_BWD_TORCH",
            tune_launch=f"{_P}.tuning:launch_torch_bwd",
            sources=_TORCH,
            interpretable=True,
        ),
    ),
    default_backend="triton",
    default=f"{_P}.spec:defaults_bwd",
)


def defaults_fwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    """The CuTe kernel's heuristic where it runs (sm90, bf16/fp16), else the torch composition."""
    from .config import default_gemm_silu_config
    from .torch_impl import TorchGemmSiluConfig

    out: dict[str, object] = {}
    if str(dtype).removeprefix("torch.") in ("bfloat16", "float16"):
        out["cute"] = default_gemm_silu_config(131072, 4 * num_heads * dqk, num_heads * dv)
    out["torch"] = TorchGemmSiluConfig()
    return out


def defaults_bwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .bwd_config import GemmSiluBwdConfig, default_bwd_config
    from .torch_impl import TorchGemmSiluConfig

    cfg = GemmSiluBwdConfig(4, 32, 1, 1) if interpret else default_bwd_config(4 * num_heads * dqk)
    return {"triton": cfg, "torch": TorchGemmSiluConfig()}


SPEC = OpSpec(name="gemm_silu", kernels=(FWD, BWD), doc="uvqk projection: silu(x W^T + b) and its backward.")
