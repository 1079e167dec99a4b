"""Tuner adapter of the uvqk projection (contracts in ``autotune.spec``).

A task is read as the HSTU layer owning the projection: M = the batch's tokens (sum of its lengths),
K = hidden = heads x dv, N = 4 x heads x dqk (u, v, q, k). E.g. ``autotune run --kernel gemm_silu
--dims 256 --heads 4 --buckets 4K --batch 32 --distributions uniform`` tunes M = 131072, K = 1024,
N = 4096. The mask is irrelevant (leave it causal).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .reference import gemm_silu_flops, gemm_silu_pre_reference
from .torch_impl import gemm_silu_bwd_reference, gemm_silu_bwd_torch
from .triton_bwd import gemm_silu_bwd


def gemm_shape(task: Any, lengths: list[int]) -> tuple[int, int, int]:
    """(M, N, K) of a task's projection: tokens, 4 heads dqk, heads dv."""
    return int(sum(lengths)), 4 * task.num_heads * task.dqk, task.num_heads * task.dv


def _rnd(gen: torch.Generator, device: str, dtype: torch.dtype, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def make_inputs(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    """x ~ N(0, 1), W ~ N(0, 1/K) (nn.Linear scale, so pre-activations are O(1)), b ~ N(0, 0.25)."""
    m, n, k = gemm_shape(task, lengths)
    gen = torch.Generator(device=device).manual_seed(seed)
    return {
        "x": _rnd(gen, device, dtype, m, k),
        "weight": _rnd(gen, device, dtype, n, k, scale=1.0 / math.sqrt(k)),
        "bias": _rnd(gen, device, dtype, n, scale=0.5),
    }


def make_inputs_bwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    inputs = make_inputs(task, lengths, seed, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    m, n, _ = gemm_shape(task, lengths)
    return {**inputs, "dy": _rnd(gen, device, dtype, m, n)}


def reference(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    """(y, pre): fp32 oracle (compute_dtype=float32) or PyTorch in the kernel's dtype."""
    i = inputs
    with torch.no_grad():
        pre = gemm_silu_pre_reference(i["x"], i["weight"], i["bias"], compute_dtype)
    return torch.nn.functional.silu(pre), pre


def reference_bwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    i = inputs
    return gemm_silu_bwd_reference(i["dy"], i["x"], i["weight"], i["bias"], compute_dtype)


def flops(inputs: dict) -> float:
    x, w = inputs["x"], inputs["weight"]
    return gemm_silu_flops(x.shape[0], w.shape[0], x.shape[1])


def flops_bwd(inputs: dict) -> float:
    """Three GEMMs (the pre-activation recomputed, dx, dW): 6 M N K."""
    return 3.0 * flops(inputs)


def alloc_out(inputs: dict) -> tuple:
    """NaN-filled (y, pre): the correctness check then proves every element (M tail included) was written.
    Tasks time the projection as the HSTU layer runs it, with the pre-activation stored for the backward."""
    x, w = inputs["x"], inputs["weight"]
    return tuple(torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device) for _ in "yp")


def _outs(inputs: dict, out: tuple | None) -> tuple:
    """The caller's (y, pre), else fresh uninitialised ones (no fill pass inside a timed call)."""
    if out:
        if len(out) != 2:
            raise ValueError(f"out must be the pair (y, pre) of alloc_out, got {len(out)} tensors")
        return tuple(out)
    x, w = inputs["x"], inputs["weight"]
    return tuple(x.new_empty((x.shape[0], w.shape[0])) for _ in "yp")


def alloc_out_bwd(inputs: dict) -> tuple:
    return tuple(torch.full_like(inputs[n], float("nan")) for n in ("x", "weight", "bias"))


def launch_cute(inputs: dict, config: Any, out: tuple | None) -> tuple:
    from .op import gemm_silu_fwd

    i, (y, pre) = inputs, _outs(inputs, out)
    return (gemm_silu_fwd(i["x"], i["weight"], i["bias"], config, out=y, pre_out=pre), pre)


def launch_torch(inputs: dict, config: Any, out: tuple | None) -> tuple:
    from .launch import gemm_silu_fwd_torch

    i, (y, pre) = inputs, _outs(inputs, out)
    return (gemm_silu_fwd_torch(i["x"], i["weight"], i["bias"], out=y, pre_out=pre), pre)


def launch_triton_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    i = inputs
    return tuple(gemm_silu_bwd(i["dy"], i["x"], i["weight"], i["bias"], config=config, out=out))


def launch_torch_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    i = inputs
    return tuple(gemm_silu_bwd_torch(i["dy"], i["x"], i["weight"], i["bias"], out=out))


def jit_bwd() -> list:
    from . import triton_bwd

    return [triton_bwd._silu_bwd_kernel]
