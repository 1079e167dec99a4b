"""Spec of the jagged HSTU attention op: forward and backward kernels, Triton and CuTe DSL backends."""

from __future__ import annotations

from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec

_MASKS = ("causal", "targets", "context", "context+targets", "window")
_T = "kernel_templates.hstu_attention"
_TUNING = f"{_T}.tuning"
_TRITON_COMMON = (
    "kernel_templates/config_base.py",
    *(f"{_T.replace('.', '/')}/{f}" for f in ("config.py", "triton_common.py")),
)
_CUTE_SHARED = ("kernel_templates/cute_runtime.py", "kernel_templates/cute_sm90.py", "kernel_templates/config_base.py")
_CUTE_FWD = ("config.py", "schedule.py", "tile_table.py", "launch.py", "hstu_fwd_sm90.py", "op.py")
_CUTE_BWD = (
    "config.py", "schedule.py", "tile_table.py", "launch.py", "hstu_fwd_sm90.py", "bwd_config.py",
    "hstu_bwd_sm90.py", "hstu_bwd_step.py", "bwd_op.py",
)  # fmt: skip


def _triton(direction: str) -> BackendSpec:
    files = ("triton_fwd.py",) if direction == "fwd" else ("triton_fwd.py", "triton_bwd.py")
    cls = "HSTUFwdConfig" if direction == "fwd" else "HSTUBwdConfig"
    return BackendSpec(
        name="triton",
        # The runtime entry takes inputs its caller validated (``autotune.runtime.ops``, the fused layer).
        launcher=f"{_T}.triton_{direction}:hstu_attention_{direction}_validated",
        config=f"{_T}.config:{cls}",
        space=f"search_spaces.hstu_triton:HSTU_{direction.upper()}_TRITON",
        tune_launch=f"{_TUNING}:launch_triton_{direction}",
        sources=(*_TRITON_COMMON, *(f"kernel_templates/hstu_attention/{f}" for f in files)),
        interpretable=True,
        jit_functions=f"{_TUNING}:_jit_{direction}",
        grid_rows=f"{_T}.spec:grid_rows_triton_{direction}",
    )


def _cute(direction: str) -> BackendSpec:
    files = _CUTE_FWD if direction == "fwd" else _CUTE_BWD
    cls = "config:HSTUCuteFwdConfig" if direction == "fwd" else "bwd_config:HSTUCuteBwdConfig"
    return BackendSpec(
        name="cute",
        # The runtime entries take inputs ``autotune.runtime.ops`` validated (the backward's own check is off).
        launcher=f"kernel_templates.cute:hstu_attention_cute_{direction}_validated",
        config=f"kernel_templates.cute.{cls}",  # pure Python: reading an artifact never imports cutlass
        space=f"search_spaces.hstu_attention_cute:HSTU_{direction.upper()}_CUTE",
        tune_launch=f"{_TUNING}:launch_cute_{direction}",
        sources=(*(f"kernel_templates/cute/{f}" for f in files), *_CUTE_SHARED),
        requires=("cutlass",),
        needs_cuda=True,
        compute_capability=(9, 0),
        index_dtype="int32",
        grid_rows=f"{_T}.spec:grid_rows_cute_{direction}",
    )


def _kernel(direction: str) -> KernelSpec:
    return KernelSpec(
        name=f"hstu_attention_{direction}",
        direction=direction,
        make_inputs=f"{_TUNING}:make_inputs_{direction}",
        reference=f"{_TUNING}:reference_{direction}",
        flops=f"{_TUNING}:flops_{direction}",
        alloc_out=f"{_TUNING}:alloc_out_{direction}",
        output_names=("out",) if direction == "fwd" else ("dq", "dk", "dv"),
        verify_masks=_MASKS,
        backends=(_triton(direction), _cute(direction)),
        default_backend="triton",
        default=f"{_T}.spec:default_configs_{direction}",
    )


SPEC = OpSpec(
    name="hstu_attention",
    kernels=(_kernel("fwd"), _kernel("bwd")),
    doc="Jagged causal HSTU attention (SiLU scores, 1/n scaling, context/target/window masks).",
)


def default_configs_fwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    """Heuristic defaults by backend, in preference order (what runs when nothing is tuned)."""
    from .config import default_fwd_config

    return {"triton": default_fwd_config(dqk, dv, interpret, dtype)}


def default_configs_bwd(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, object]:
    from .config import default_bwd_config

    return {"triton": default_bwd_config(dqk, dv, interpret, dtype)}


# Rows per block along each kernel's 65535-capped grid dimension (``BackendSpec.grid_rows``): the Triton grids
# are (sequence x head, row block); the CuTe grid order is (head, sequence, row block), while its compact and
# persistent orders put every tile in x.
def grid_rows_triton_fwd(config) -> int:
    return config.block_m


def grid_rows_triton_bwd(config) -> int:
    return min(config.block_n, config.dq_rows)  # the key-block kernel's grid, and the dQ kernel's when it runs


def grid_rows_cute_fwd(config) -> int | None:
    return None if config.compact else config.block_m


def grid_rows_cute_bwd(config) -> int | None:
    return None if config.compact or config.persistent else config.block_n
