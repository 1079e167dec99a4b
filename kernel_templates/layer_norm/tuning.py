"""Tuner adapter of the LayerNorm kernels (see ``autotune.spec`` for the contracts).

A task is read as the HSTU layer owning the op: rows = the batch's tokens, width = heads x dv. The
input is the residual stream in the task's dtype; weight and bias are fp32 (master parameters).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import LayerNormBwdConfig, LayerNormFwdConfig
from .reference import layer_norm_bwd_torch, layer_norm_fwd_torch, layer_norm_reference
from .triton_layer_norm import layer_norm_bwd, layer_norm_fwd

EPS = 1e-5


def _base(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    rows, d = int(sum(lengths)), task.num_heads * task.dv

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale + shift

    return {
        "x": (rnd(rows, d, scale=2.0, shift=0.5)).to(dtype),
        "weight": rnd(d, scale=0.1, shift=1.0),
        "bias": rnd(d, scale=0.1),
        "gen": gen,
    }


def make_inputs_fwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    inputs = _base(task, lengths, seed, device, dtype)
    inputs.pop("gen")
    return inputs


def make_inputs_bwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    inputs = _base(task, lengths, seed, device, dtype)
    gen = inputs.pop("gen")
    x = inputs["x"]
    _, mean, rstd = layer_norm_reference(x, inputs["weight"], inputs["bias"], EPS)
    dy = torch.randn(x.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    rg = torch.randn(x.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return {**inputs, "dy": dy, "mean": mean, "rstd": rstd, "residual_grad": rg}


def reference_fwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    x = inputs["x"].float() if compute_dtype == torch.float32 else inputs["x"]
    y, _, _ = layer_norm_reference(x, inputs["weight"], inputs["bias"], EPS, compute_dtype, compute_dtype)
    return (y,)


def reference_bwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    """fp32 oracle, or the gradient rounded through ``compute_dtype`` (PyTorch's own error)."""
    i = {k: (v.to(compute_dtype) if k in ("x", "dy", "residual_grad") else v) for k, v in inputs.items()}
    dx, dw, db = layer_norm_bwd_torch(i["dy"], i["x"], i["weight"], i["bias"], i["mean"], i["rstd"],
                                      residual_grad=i["residual_grad"])  # fmt: skip
    return dx, dw, db


def flops_fwd(inputs: dict) -> float:
    return 8.0 * inputs["x"].numel()


def flops_bwd(inputs: dict) -> float:
    return 16.0 * inputs["x"].numel()


def bytes_fwd(inputs: dict) -> float:
    x = inputs["x"]
    return 2.0 * x.numel() * x.element_size()


def bytes_bwd(inputs: dict) -> float:
    x = inputs["x"]
    return 4.0 * x.numel() * x.element_size()


def alloc_out_fwd(inputs: dict) -> tuple:
    return (torch.full_like(inputs["x"], float("nan")),)


def alloc_out_bwd(inputs: dict) -> tuple:
    x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
    return tuple(torch.full_like(t, float("nan")) for t in (x, w, b))


def launch_triton_fwd(inputs: dict, config: LayerNormFwdConfig, out: tuple | None) -> tuple:
    i = inputs
    return (layer_norm_fwd(i["x"], i["weight"], i["bias"], EPS, config=config, out=out[0] if out else None)[0],)


def launch_triton_bwd(inputs: dict, config: LayerNormBwdConfig, out: tuple | None) -> tuple:
    i = inputs
    return tuple(layer_norm_bwd(i["dy"], i["x"], i["weight"], i["bias"], i["mean"], i["rstd"], config=config,
                                residual_grad=i["residual_grad"], out=out))  # fmt: skip


def launch_torch_fwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    i = inputs
    return (layer_norm_fwd_torch(i["x"], i["weight"], i["bias"], EPS, out=out[0] if out else None)[0],)


def launch_torch_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    i = inputs
    return tuple(layer_norm_bwd_torch(i["dy"], i["x"], i["weight"], i["bias"], i["mean"], i["rstd"],
                                      residual_grad=i["residual_grad"], out=out))  # fmt: skip


def jit_fwd() -> list:
    from . import triton_layer_norm

    return [triton_layer_norm._ln_fwd_kernel]


def jit_bwd() -> list:
    from . import triton_layer_norm

    return [triton_layer_norm._ln_bwd_kernel]
