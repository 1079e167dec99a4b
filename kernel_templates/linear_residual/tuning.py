"""Tuner adapter of the output projection + residual (contracts in ``autotune.spec``): M = tokens,
K = N = hidden (heads x dv); the residual in the task's dtype."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .impl import linear_residual


def make_inputs(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    m, h = int(sum(lengths)), task.num_heads * task.dv

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    return {"y": rnd(m, h), "weight": rnd(h, h, scale=1 / math.sqrt(h)), "bias": rnd(h, scale=0.1),
            "residual": rnd(m, h)}  # fmt: skip


def reference(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    i = {k: v.to(compute_dtype) for k, v in inputs.items()}
    return (i["residual"] + F.linear(i["y"], i["weight"], i["bias"]),)


def flops(inputs: dict) -> float:
    y, w = inputs["y"], inputs["weight"]
    return 2.0 * y.shape[0] * y.shape[1] * w.shape[0]


def alloc_out(inputs: dict) -> tuple:
    return (torch.full_like(inputs["residual"], float("nan")),)


def launch(inputs: dict, config: Any, out: tuple | None) -> tuple:
    i = inputs
    return (linear_residual(i["y"], i["weight"], i["bias"], i["residual"], config=config, out=out[0] if out else None),)
