"""Tuner adapter of the output projection + residual and its backward (contracts in ``autotune.spec``):
M = tokens, K = N = hidden (heads x dv); the residual in the task's dtype."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .bwd_impl import linear_residual_bwd
from .impl import linear_residual


def _randn(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype):
    """(M, hidden, rnd): rnd(*shape, scale=1) draws N(0, scale^2) values from one generator seeded ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    return int(sum(lengths)), task.num_heads * task.dv, rnd


def make_inputs(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    m, h, rnd = _randn(task, lengths, seed, device, dtype)
    return {"y": rnd(m, h), "weight": rnd(h, h, scale=1 / math.sqrt(h)), "bias": rnd(h, scale=0.1),
            "residual": rnd(m, h)}  # fmt: skip


def make_inputs_bwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    """dout ~ N(0, 1) (the residual stream's gradient), y and W as the forward's."""
    m, h, rnd = _randn(task, lengths, seed, device, dtype)
    return {"y": rnd(m, h), "weight": rnd(h, h, scale=1 / math.sqrt(h)), "dout": rnd(m, h)}


def reference(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    i = {k: v.to(compute_dtype) for k, v in inputs.items()}
    return (i["residual"] + F.linear(i["y"], i["weight"], i["bias"]),)


def reference_bwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    """(dy, dweight): fp32 oracle (compute_dtype=float32) or PyTorch in the kernel's dtype."""
    g, y, w = (inputs[k].to(compute_dtype) for k in ("dout", "y", "weight"))
    return g @ w, g.t() @ y


def flops(inputs: dict) -> float:
    y, w = inputs["y"], inputs["weight"]
    return 2.0 * y.shape[0] * y.shape[1] * w.shape[0]


def flops_bwd(inputs: dict) -> float:
    """Two GEMMs of the forward's size (dgrad, wgrad): 4 M N K."""
    return 2.0 * flops(inputs)


def alloc_out(inputs: dict) -> tuple:
    return (torch.full_like(inputs["residual"], float("nan")),)


def alloc_out_bwd(inputs: dict) -> tuple:
    """NaN-filled (dy, dweight): the check then proves every element was written."""
    return tuple(torch.full_like(inputs[n], float("nan")) for n in ("y", "weight"))


def launch(inputs: dict, config: Any, out: tuple | None) -> tuple:
    i = inputs
    return (linear_residual(i["y"], i["weight"], i["bias"], i["residual"], config=config, out=out[0] if out else None),)


def launch_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    """Joined before returning (no ``pending``): a timed call ends when both GEMMs have."""
    i = inputs
    return tuple(linear_residual_bwd(i["dout"], i["y"], i["weight"], config=config, out=out))
