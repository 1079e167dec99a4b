"""Tuner adapter of the fused ``dropout(LN(x) * u)`` kernels (contracts in ``autotune.spec``).

Rows = the batch's tokens, width = heads x dv; u is a column slice of a (rows, 4 width) tensor, as
the layer passes it (a view of uvqk); dropout p = 0.1 with a fixed seed, so the oracle applies the
kernels' own mask (``dropout_keep_mask``) and the check is exact about which elements are dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from .torch_impl import ln_mul_dropout_bwd_torch, ln_mul_dropout_fwd_torch
from .triton_ln_mul_dropout import ln_mul_dropout_bwd, ln_mul_dropout_fwd

EPS, P = 1e-5, 0.1


def _base(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> tuple[dict, Any]:
    gen = torch.Generator(device=device).manual_seed(seed)
    rows, d = int(sum(lengths)), task.num_heads * task.dv

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale + shift

    uvqk = rnd(rows, 4 * d).to(dtype)
    inputs = {
        "x": rnd(rows, d, scale=2.0, shift=0.3).to(dtype),
        "u": uvqk[:, :d],
        "weight": rnd(d, scale=0.1, shift=1.0),
        "bias": rnd(d, scale=0.1),
        "seed": torch.tensor([1234 + seed], dtype=torch.int64, device=device),
    }
    return inputs, gen


def make_inputs_fwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    return _base(task, lengths, seed, device, dtype)[0]


def make_inputs_bwd(task: Any, lengths: list[int], seed: int, device: str, dtype: torch.dtype) -> dict:
    inputs, gen = _base(task, lengths, seed, device, dtype)
    i = inputs
    _, mean, rstd = ln_mul_dropout_fwd_torch(i["x"], i["u"], i["weight"], i["bias"], EPS, 0.0, i["seed"])
    do = torch.randn(i["x"].shape, generator=gen, device=device, dtype=torch.float32).to(i["x"].dtype)
    return {**inputs, "do": do, "mean": mean, "rstd": rstd}


def _cast(inputs: dict, compute_dtype: torch.dtype) -> dict:
    return {k: (v.to(compute_dtype) if k in ("x", "u", "do") else v) for k, v in inputs.items()}


def reference_fwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    i = _cast(inputs, compute_dtype)
    return (ln_mul_dropout_fwd_torch(i["x"], i["u"], i["weight"], i["bias"], EPS, P, i["seed"])[0],)


def reference_bwd(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    i = _cast(inputs, compute_dtype)
    args = (i["do"], i["x"], i["u"], i["weight"], i["bias"], i["mean"], i["rstd"], P, i["seed"])
    return tuple(ln_mul_dropout_bwd_torch(*args))


def flops_fwd(inputs: dict) -> float:
    return 10.0 * inputs["x"].numel()


def flops_bwd(inputs: dict) -> float:
    return 20.0 * inputs["x"].numel()


def bytes_fwd(inputs: dict) -> float:
    x = inputs["x"]
    return 3.0 * x.numel() * x.element_size()


def bytes_bwd(inputs: dict) -> float:
    x = inputs["x"]
    return 5.0 * x.numel() * x.element_size()


def alloc_out_fwd(inputs: dict) -> tuple:
    return (torch.full_like(inputs["x"], float("nan")),)


def alloc_out_bwd(inputs: dict) -> tuple:
    """NaN-filled dx, du (a column slice of a wider buffer, as in the layer), dweight, dbias."""
    x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
    wide = torch.full((x.shape[0], 4 * x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    return (
        torch.full_like(x, float("nan")),
        wide[:, : x.shape[1]],
        torch.full_like(w, float("nan")),
        torch.full_like(b, float("nan")),
    )


def _fwd_args(i: dict) -> tuple:
    return (i["x"], i["u"], i["weight"], i["bias"], EPS, P, i["seed"])


def _bwd_args(i: dict) -> tuple:
    return (i["do"], i["x"], i["u"], i["weight"], i["bias"], i["mean"], i["rstd"], P, i["seed"])


def launch_triton_fwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    return (ln_mul_dropout_fwd(*_fwd_args(inputs), config=config, out=out[0] if out else None)[0],)


def launch_triton_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    return tuple(ln_mul_dropout_bwd(*_bwd_args(inputs), config=config, out=out))


def launch_torch_fwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    return (ln_mul_dropout_fwd_torch(*_fwd_args(inputs), out=out[0] if out else None)[0],)


def launch_torch_bwd(inputs: dict, config: Any, out: tuple | None) -> tuple:
    return tuple(ln_mul_dropout_bwd_torch(*_bwd_args(inputs), out=out))


def jit_fwd() -> list:
    from . import triton_ln_mul_dropout

    return [triton_ln_mul_dropout._ln_mul_dropout_fwd_kernel]


def jit_bwd() -> list:
    from . import triton_ln_mul_dropout

    return [triton_ln_mul_dropout._ln_mul_dropout_bwd_kernel]
