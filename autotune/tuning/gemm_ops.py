"""Registration of the ``gemm_silu`` op (HSTU uvqk projection ``silu(x W^T + b)``) and its backends.

A GEMM task reuses the attention ``Task`` unchanged, read as the HSTU layer that owns the projection:
M = the jagged token count of the task's representative batch (sum of its lengths: ``--buckets`` x
``--batch`` with ``--distributions``), K = hidden = heads x dv, N = 4 x heads x dqk (u, v, q, k).
E.g. ``autotune run --kernel gemm_silu --dims 256 --heads 4 --buckets 4K --batch 32 --distributions
uniform`` tunes M = 131072, K = 1024, N = 4096. The mask is irrelevant (leave it ``causal``).

Backends: ``cute`` (the sm90 kernel, its heuristic default is the study's baseline) and ``torch``
(``F.silu(F.linear(...))``, one config), so a tuned CuTe config must also beat what the model runs today.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from autotune.runtime.artifacts import TEMPLATE_SOURCES
from autotune.tuning.registry import Backend, Op, cute_available, register_backend, register_op
from kernel_templates.gemm_silu.reference import gemm_silu_flops, gemm_silu_reference
from search_spaces.base import SearchSpace, SpaceContext
from search_spaces.gemm_silu_cute import GEMM_SILU_CUTE

OP = "gemm_silu"
CUTE_FILES = TEMPLATE_SOURCES[(OP, "cute")]
TORCH_FILES = TEMPLATE_SOURCES[(OP, "torch")]


def gemm_shape(task: Any, lengths: list[int]) -> tuple[int, int, int]:
    """(M, N, K) of a task's projection: tokens, 4 heads dqk, heads dv."""
    return int(sum(lengths)), 4 * task.num_heads * task.dqk, task.num_heads * task.dv


def make_inputs(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    """x ~ N(0, 1), W ~ N(0, 1/K) (nn.Linear scale, so pre-activations are O(1)), b ~ N(0, 0.25)."""
    m, n, k = gemm_shape(task, lengths)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    return {"x": rnd(m, k), "weight": rnd(n, k, scale=1.0 / math.sqrt(k)), "bias": rnd(n, scale=0.5)}


def reference(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    """fp32 oracle (compute_dtype=float32) or PyTorch in the kernel's dtype."""
    with torch.no_grad():
        return (gemm_silu_reference(inputs["x"], inputs["weight"], inputs["bias"], compute_dtype),)


def flops(inputs: dict) -> float:
    x, w = inputs["x"], inputs["weight"]
    return gemm_silu_flops(x.shape[0], w.shape[0], x.shape[1])


def alloc_out(inputs: dict) -> tuple:
    """NaN-filled output: the correctness check then proves every element (M tail included) was written."""
    x, w = inputs["x"], inputs["weight"]
    return (torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device),)


def launch_cute(inputs: dict, config: Any, out: tuple | None) -> tuple:
    from kernel_templates.gemm_silu.op import gemm_silu_fwd

    i = inputs
    return (gemm_silu_fwd(i["x"], i["weight"], i["bias"], config, out=out[0] if out else None),)


@dataclass(frozen=True)
class TorchGemmSiluConfig:
    """The unfused PyTorch path has nothing to tune: one config, so it is measured once per study."""

    kind: ClassVar[str] = "gemm_silu_torch"

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TorchGemmSiluConfig:
        if d:
            raise ValueError(f"TorchGemmSiluConfig takes no fields, got {sorted(d)}")
        return cls()


def launch_torch(inputs: dict, config: Any, out: tuple | None) -> tuple:
    """cuBLAS addmm (bias fused) then an in-place SiLU pass, i.e. what F.silu(F.linear(...)) runs."""
    x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
    if out is None:
        return (torch.nn.functional.silu(torch.nn.functional.linear(x, w, b)),)
    torch.addmm(b, x, w.t(), out=out[0])
    return (torch.nn.functional.silu(out[0], inplace=True),)


def _torch_default(ctx: SpaceContext) -> TorchGemmSiluConfig:
    return TorchGemmSiluConfig()


TORCH_SPACE = SearchSpace("gemm_silu/torch", TorchGemmSiluConfig, {}, (), _torch_default)

register_op(
    Op(
        OP,
        make_inputs=make_inputs,
        reference=reference,
        flops=flops,
        alloc_out=alloc_out,
        output_names=("out",),
        direction="fwd",
    )
)
register_backend(Backend(OP, "cute", GEMM_SILU_CUTE, launch_cute, CUTE_FILES, available=cute_available))
register_backend(Backend(OP, "torch", TORCH_SPACE, launch_torch, TORCH_FILES))
